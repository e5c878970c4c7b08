"""The ML venv end to end on two fresh sandbox hosts: GPUs other than host data says stop the hosts
before any build, then one flash-attn build between them, a second
run that changes nothing, a venv changed by hand replaced by one built beside it (a superseded
kernel cache removed), a rebuilt VM served from the cache.
Checked with ssh on the hosts (the build log systemd wrote, pip list), not through pyinfra."""

import json

import pytest

from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

VENV = "/opt/gpuhost/venv"
BUILD_LOG = "/opt/gpuhost/build/flash-attn/build.log"
KERNELS = "/var/cache/gpuhost/kernels"
#: the kernel cache folder of the default lock (flashinfer-python 0.6.3, torch 2.9.1), CUDA 12.8
#: and the reference lab's SM120
KERNEL_KEY = "flashinfer0.6.3-torch2.9.1-cuda12.8-sm120"


@pytest.fixture(scope="module")
def hosts():
    """Two fresh sandbox hosts of the reference lab scenario, removed afterwards."""
    yield lab.up(hosts=2, scenario="reference-lab")
    lab.sandbox("down", check=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """An empty controller cache of built wheels, this module's own."""
    return tmp_path_factory.mktemp("wheels")


def deploy(cache, *extra: str) -> lab.Run:
    return lab.deploy("--data", f"gpuhost_wheel_cache={cache}", *extra)


def changed(run: lab.Run) -> list[str]:
    assert run.results is not None, run.output[-3000:]
    return [f"{op['name']}: changed on {op['success']}, failed on {op['error']}"
            for op in run.results["results"]["operations"] if op["success"] or op["error"]]


def built_here(host: lab.Host) -> bool:
    """Whether a flash-attn build ran on the host (systemd wrote its log there)."""
    return host.ssh(f"test -s {BUILD_LOG} && echo yes || echo no").strip() == "yes"


def pip_list(host: lab.Host) -> dict[str, str]:
    listed = json.loads(host.ssh(f"{VENV}/bin/python -m pip list --format=json "
                                 "--disable-pip-version-check 2>/dev/null"))
    return {d["name"].lower().replace("_", "-"): d["version"] for d in listed}


def flash_attn_build_env(host: lab.Host) -> dict:
    script = "import json, flash_attn; print(json.dumps(flash_attn.build_env()))"
    return json.loads(host.ssh(f"{VENV}/bin/python -c '{script}'"))


def _wheel_folders(cache):
    """The controller cache's flash-attn wheel folders (beside them: their .lock files, and
    locked/ with the locked wheels a host downloaded)."""
    return [p for p in cache.glob("flash_attn-*") if p.is_dir()]


def test_gpus_other_than_host_data_stop_before_the_build(hosts, cache):
    # fresh hosts: no driver answers while planning, so only the deploy itself, once the driver
    # stage has loaded it, can compare the GPUs (SM120) with host data
    run = deploy(cache, "--data", "gpuhost_compute_capability=9.0")
    assert run.returncode != 0, run.output[-6000:]
    assert ("the GPUs have compute capability 12.0 (nvidia-smi), host data says "
            "gpuhost_compute_capability = '9.0': set gpuhost_compute_capability = '12.0'"
            in run.output), run.output[-6000:]
    assert "Traceback" not in run.output
    assert not any(built_here(h) for h in hosts)
    assert _wheel_folders(cache) == []  # no flash-attn wheel cached
    for h in hosts:
        assert h.ssh(f"ls {VENV}/lib/python3*/site-packages/ | grep -c '^flash_attn' "
                     "|| true").strip() == "0"


def test_two_fresh_hosts_converge_with_one_build(hosts, cache):
    first = deploy(cache)
    assert first.returncode == 0, first.output[-6000:]
    assert [built_here(h) for h in hosts].count(True) == 1, first.output[-6000:]
    envs = [flash_attn_build_env(h) for h in hosts]
    # what the CUDA toolkit's cuobjdump lists in the installed extension module
    for h in hosts:
        listed = h.ssh(f"/usr/local/cuda-12.8/bin/cuobjdump --list-elf "
                       f"{VENV}/lib/python3*/site-packages/flash_attn_2_cuda.*.so")
        assert ".sm_120.cubin" in listed, listed
    assert envs[0] == envs[1]  # one wheel, installed on both
    assert envs[0]["FLASH_ATTN_CUDA_ARCHS"] == "120"
    assert envs[0]["torch_cuda"] == envs[0]["nvcc_release"] == "12.8"
    assert len(_wheel_folders(cache)) == 1
    pids = [h.main_pid() for h in hosts]

    second = deploy(cache, "--json")
    assert second.returncode == 0, second.output[-6000:]
    assert changed(second) == []
    assert [h.main_pid() for h in hosts] == pids


def test_drift_is_reported_and_repaired(hosts, cache):
    host = hosts[0]
    before = pip_list(host)
    # by hand: one locked distribution removed, one at another version, one the lock lacks
    host.ssh(f"{VENV}/bin/python -m pip uninstall -y -q sgl-kernel")
    for name, version in (("flashinfer-cubin", "0.6.2"), ("gpuhost-e2e-extra", "1.0")):
        host.ssh(f"rm -rf /tmp/{name} && mkdir -p /tmp/{name} && printf '%s' "
                 f"\"from setuptools import setup; setup(name='{name}', version='{version}')\" "
                 f"> /tmp/{name}/setup.py && {VENV}/bin/python -m pip install -q --no-deps "
                 f"--no-index --no-build-isolation /tmp/{name}")
    drifted = pip_list(host)
    assert "sgl-kernel" not in drifted and drifted["flashinfer-cubin"] == "0.6.2"
    # a kernel cache of an older flashinfer, left by an earlier stack
    host.ssh(f"mkdir -p {KERNELS}/flashinfer0.6.2-torch2.9.1-cuda12.8-sm120/triton && "
             f"touch {KERNELS}/flashinfer0.6.2-torch2.9.1-cuda12.8-sm120/triton/k.cubin")

    repair = deploy(cache)
    assert repair.returncode == 0, repair.output[-6000:]
    for line in ("sgl-kernel missing -> 0.3.21 (lock)", "flashinfer-cubin 0.6.2 -> 0.6.3 (lock)",
                 "gpuhost-e2e-extra 1.0 not in the lock"):
        assert line in repair.output, repair.output[-6000:]
    assert pip_list(host) == before
    assert host.ssh(f"ls {KERNELS}").split() == [KERNEL_KEY]
    assert host.ssh(f"ls {KERNELS}/{KERNEL_KEY}").split() == [
        "flashinfer", "torch_extensions", "torchinductor", "triton"]
    unit_env = host.ssh("systemctl show -p Environment sglang.service")
    for name, sub in (("FLASHINFER_WORKSPACE_BASE", "flashinfer"), ("TRITON_CACHE_DIR", "triton"),
                      ("TORCHINDUCTOR_CACHE_DIR", "torchinductor"),
                      ("TORCH_EXTENSIONS_DIR", "torch_extensions")):
        assert f"{name}={KERNELS}/{KERNEL_KEY}/{sub}" in unit_env.split(), unit_env

    again = deploy(cache, "--json")
    assert again.returncode == 0, again.output[-6000:]
    assert changed(again) == []


def test_a_rebuilt_venv_installs_the_cached_wheel(hosts, cache):
    host = hosts[1]
    host.ssh(f"rm -rf {VENV} /opt/gpuhost/venvs /opt/gpuhost/build")  # the link, the venvs
    run = deploy(cache)
    assert run.returncode == 0, run.output[-6000:]
    assert not built_here(host)
    assert flash_attn_build_env(host) == flash_attn_build_env(hosts[0])


def test_a_failed_build_fails_the_host_with_its_log(hosts, tmp_path):
    host = hosts[0]
    pid = host.main_pid()
    # the "hardware" now kills any parallel compile (as too little memory would); the stamp,
    # the host's finished build (which a run would adopt) and the cache are gone: this host
    # must build, and the build fails
    hardware = "/etc/gpuhost-sandbox/hardware.json"
    host.ssh(f"cp {hardware} /tmp/hardware.json && python3 -c \"import json; p='{hardware}'; "
             "d=json.load(open(p)); d['host']['flash_attn_max_parallel_jobs']=0; "
             f"json.dump(d, open(p, 'w'))\" && rm -rf {VENV}/gpuhost-flash-attn.json "
             "/opt/gpuhost/build")  # the build ran on either host
    try:
        run = deploy(tmp_path / "empty-cache")
    finally:
        host.ssh(f"cp /tmp/hardware.json {hardware}")
    assert run.returncode != 0
    assert "flash-attn build failed: gpuhost-flash-attn-build.service ended with result " \
           "exit-code" in run.output, run.output[-6000:]
    assert "Killed signal terminated program cc1plus" in run.output  # the log's tail
    assert "flash-attn build: " in run.output  # progress was polled and printed
    assert host.ssh("systemctl is-active sglang.service").strip() == "active"
    assert host.main_pid() == pid  # the server stage never ran on the failed host


def test_a_torch_change_rebuilds(hosts, tmp_path):
    host = hosts[1]
    first = deploy(tmp_path / "cache")  # converges (a no-op where an earlier test did)
    assert first.returncode == 0, first.output[-6000:]
    # the stamp says flash-attn was built against another torch; the cache is empty
    host.ssh(f"rm -rf /opt/gpuhost/build && sed -i 's/\"torch\": \"2.9.1+cu128\"/\"torch\": "
             f"\"2.9.0+cu128\"/' {VENV}/gpuhost-flash-attn.json")
    run = deploy(tmp_path / "empty-cache")
    assert run.returncode == 0, run.output[-6000:]
    assert "torch changed: built against 2.9.0+cu128, the lock has 2.9.1" in run.output
    assert built_here(host)
    stamp = json.loads(host.ssh(f"cat {VENV}/gpuhost-flash-attn.json"))
    assert stamp["torch"] == "2.9.1+cu128" and stamp["source"] == f"built on {host.name}"
