"""Build parallelism for flash-attn, drift between a venv and its lock, the venv's Python
against the one the lock was resolved for."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from operations.facts.venv_facts import VenvPackages
from operations.plans.lock import read_lock
from operations.stages.mlenv import BuildError, build_parallelism, python_problem
from operations.stages.pip_index import pip_index_args
from operations.stages.venv_install import drift


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


# --- the venv's Python against the lock's ---------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
PIN = "sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n"


def lock_with_header(tmp_path, header):
    path = tmp_path / "lock.txt"
    path.write_text(header + PIN)
    return read_lock(path)


def test_the_real_lock_is_resolved_for_python_3_12():
    assert read_lock(ROOT / "locks" / "cuda12.8.txt").python_version == "3.12"


def test_the_stand_in_lock_declares_the_sandbox_hosts_python(tmp_path):
    from sandbox.pypi_index import LOCK_HEADER
    assert lock_with_header(tmp_path, LOCK_HEADER).python_version == "3.11"


def test_a_lock_without_a_python_version(tmp_path):
    lock = lock_with_header(tmp_path, "# a lock by hand\n")
    assert lock.python_version is None
    assert python_problem(lock, "my.txt", "3.11", "/opt/v", venv_exists=False) is None


def test_python_problem_names_both_versions_and_what_to_do():
    lock = read_lock(ROOT / "locks" / "cuda12.8.txt")
    assert python_problem(lock, "locks/cuda12.8.txt", "3.12", "/opt/v", False) is None
    assert python_problem(lock, "locks/cuda12.8.txt", None, "/opt/v", False) is None
    fresh = python_problem(lock, "locks/cuda12.8.txt", "3.11", "/opt/gpuhost/venv", False)
    assert fresh.startswith("the lock locks/cuda12.8.txt is resolved for Python 3.12 (its "
                            "header's --python-version), and the host's python3, which would "
                            "make the venv /opt/gpuhost/venv, is Python 3.11")
    assert "Deploy to a host whose python3 is 3.12 (Ubuntu 24.04's is 3.12)" in fresh
    assert "set gpuhost_lock to a lock resolved for Python 3.11" in fresh
    assert "'#: python-version = 3.11', then python tools/lock.py <stack>" in fresh
    made = python_problem(lock, "locks/cuda12.8.txt", "3.10", "/opt/gpuhost/venv", True)
    assert "the venv /opt/gpuhost/venv was made with Python 3.10: remove it" in made


def test_venv_packages_read_as_pip_list_reads_them(tmp_path):
    """The fact's script and pip 26's own ``pip list --format=json``, both on a real venv made
    here (pip and a distribution with a local version and one with an unnormalised version).
    The venv's pip is this interpreter's (pip 26.3, what the fact mirrors), copied in as a
    wheel's install leaves it: ensurepip would install its bundled pip 23.2.1, and took 70 s
    of the unit tests' run on a loaded machine (2 s so)."""
    import pip as pip_module

    pip_version = pip_module.__version__
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    source = Path(pip_module.__file__).parent
    shutil.copytree(source, site / "pip")
    shutil.copytree(source.parent / f"pip-{pip_version}.dist-info",
                    site / f"pip-{pip_version}.dist-info")
    for name, version in (("Torch_Stand-In", "2.9.1+cu128"), ("Old.Style", "3.05.1-rc1")):
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    fact = VenvPackages()
    script = subprocess.run(fact.command(str(venv)), shell=True, check=True, text=True,
                            capture_output=True).stdout.splitlines()
    pip = subprocess.run([f"{venv}/bin/python", "-m", "pip", "list", "--format=json",
                          "--disable-pip-version-check"], check=True, text=True,
                         capture_output=True).stdout.splitlines()
    assert fact.process(script) == fact.process(pip)
    assert fact.process(script)["old-style"] == "3.5.1rc1"
    assert fact.process(script)["torch-stand-in"] == "2.9.1+cu128"
    assert fact.process(pip)["pip"] == pip_version
