"""Build parallelism for flash-attn, drift between a venv and its lock."""

import pytest

from operations.mlenv import BuildError, build_parallelism, drift, pip_index_args


@pytest.mark.parametrize(
    ("cores", "gib", "jobs", "threads", "bound"),
    [
        (2, 22.5, 1, 3, 3),     # this machine: 24 GiB, 2 cores
        (16, 124.6, 6, 4, 24),  # the lent H200 host: 125 GiB, 16 cores
        (64, 480.0, 23, 4, 95),  # a large VM: memory, not cores, bounds the jobs
        (8, 5.0, 1, 1, 1),      # too little memory still builds, one thread at a time
    ],
)
def test_build_parallelism(cores, gib, jobs, threads, bound):
    p = build_parallelism(cores, gib)
    assert (p.max_jobs, p.nvcc_threads, p.thread_bound) == (jobs, threads, bound)
    assert p.max_jobs * p.nvcc_threads <= max(1, bound) or p.max_jobs == 1


def test_host_data_may_lower():
    p = build_parallelism(16, 124.6, max_jobs=2, nvcc_threads=2)
    assert (p.max_jobs, p.nvcc_threads) == (2, 2)


def test_host_data_may_not_raise_past_the_bound():
    with pytest.raises(BuildError, match="gpuhost_max_jobs = 128 exceeds the safe bound of 6"):
        build_parallelism(16, 124.6, max_jobs=128)
    with pytest.raises(BuildError, match="gpuhost_nvcc_threads = 8 exceeds the safe bound of 3"):
        build_parallelism(2, 22.5, nvcc_threads=8)


def test_drift():
    wanted = {"torch": "2.9.1", "sglang": "0.5.9", "flashinfer-python": "0.6.1"}
    installed = {"torch": "2.9.1+cu128", "sglang": "0.5.8"}
    assert drift(installed, wanted) == {
        "sglang": ("0.5.8", "0.5.9"),
        "flashinfer-python": (None, "0.6.1"),
    }
    assert drift({"torch": "2.9.1+cu128"}, {"torch": "2.9.1+cu128"}) == {}


def test_http_index_is_trusted_for_transport_only():
    assert pip_index_args("https://pypi.org/simple") == ["--index-url", "https://pypi.org/simple"]
    assert pip_index_args("http://10.213.1.1:8080/simple/")[-2:] == [
        "--trusted-host", "10.213.1.1"]
