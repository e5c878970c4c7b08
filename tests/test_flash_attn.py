"""flash-attn built once per fleet: the stamp's verdict, the controller's cache, the build's
command line, nvcc against torch; the driver against the venv's CUDA."""

import json
import os
import subprocess
import threading
import time

import pytest
from pyinfra.api.exceptions import OperationError

from operations.plans.cuda_compat import driver_problem, min_driver_for, venv_cuda
from operations.plans.settings import SettingsError, from_host_data
from operations.stages.flash_attn import (
    BuildKey,
    BuildPlan,
    WheelCache,
    build_command,
    check_nvcc,
    parse_nvcc_release,
    read_stamp,
    stale_reasons,
)
from operations.stages.mlenv import build_memory_max
from operations.stages.venv_install import describe_drift, unlocked

KEY = BuildKey("2.8.3.post2", "2.9.1+cu128", "12.8", "3.12", "120")
STAMP = {**KEY.__dict__, "source": "built on gpu1"}
WANTED = {"flash_attn": "2.8.3.post2", "torch_locked": "2.9.1", "torch_installed": "2.9.1",
          "cuda": "12.8", "python": "3.12", "archs": "120"}


def test_stamp_that_matches_needs_nothing():
    assert stale_reasons(STAMP, "2.8.3.post2", **WANTED) == []
    # pip shows PyPI's torch without its local part; torch itself says +cu128
    assert stale_reasons(STAMP, "2.8.3.post2", **{**WANTED, "torch_installed": None}) == []


def test_torch_change_rebuilds():
    # a new lock moves torch: the stamp no longer matches, whatever is installed now
    reasons = stale_reasons(STAMP, "2.8.3.post2", **{**WANTED, "torch_locked": "2.9.2"})
    assert reasons == ["torch changed: built against 2.9.1+cu128, the lock has 2.9.2"]
    # the venv's torch is another CUDA build of the same version
    reasons = stale_reasons(STAMP, "2.8.3.post2", **{**WANTED, "torch_installed": "2.9.1+cu130"})
    assert reasons == ["torch changed: built against 2.9.1+cu128, the venv has 2.9.1+cu130"]


def test_cuda_python_arch_changes_rebuild():
    reasons = stale_reasons(STAMP, "2.8.3.post2",
                            **{**WANTED, "cuda": "13.0", "python": "3.11", "archs": "90;120"})
    assert [r.split(":")[0] for r in reasons] == [
        "CUDA changed", "Python changed", "architectures changed"]


def test_no_stamp_or_no_flash_attn():
    assert stale_reasons(None, "2.8.3.post2", **WANTED) == [
        "no stamp of a flash-attn build in the venv"]
    assert stale_reasons(read_stamp("not json"), None, **WANTED) == [
        "no stamp of a flash-attn build in the venv"]
    assert stale_reasons(STAMP, None, **WANTED) == [
        "flash-attn missing in the venv, the lock has 2.8.3.post2"]


def test_cache_round_trip(tmp_path):
    cache = WheelCache(tmp_path / "cache")
    assert cache.lookup(KEY) is None
    wheel = tmp_path / "flash_attn-2.8.3.post2-cp312-cp312-linux_x86_64.whl"
    wheel.write_bytes(b"wheel")
    path, digest = cache.store(KEY, wheel, "gpu1")
    assert cache.lookup(KEY) == (path, digest)
    assert path.parent.name == "flash_attn-2.8.3.post2-torch2.9.1+cu128-cu12.8-py3.12-sm120"
    meta = json.loads((path.parent / "key.json").read_text())
    assert meta["built_on"] == "gpu1" and meta["torch"] == "2.9.1+cu128"
    # another torch is another key
    assert cache.lookup(BuildKey("2.8.3.post2", "2.9.2+cu128", "12.8", "3.12", "120")) is None
    # a damaged wheel is not used
    path.write_bytes(b"damaged")
    assert cache.lookup(KEY) is None


def test_one_holder_per_key(tmp_path):
    cache = WheelCache(tmp_path)
    order = []

    def hold(name):
        with cache.claimed(KEY, name, poll_s=0.01):
            order.append(f"{name} in")
            time.sleep(0.05)
            order.append(f"{name} out")

    threads = [threading.Thread(target=hold, args=(n,)) for n in ("gpu1", "gpu2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [o.split()[1] for o in order] == ["in", "out", "in", "out"]


def plan(**kw):
    base = {"venv": "/opt/gpuhost/venv", "requirements": "/opt/gpuhost/lock/flash-attn.txt",
            "index_url": "http://10.213.1.1:8080/simple/", "flash_attn": "2.8.3.post2",
            "archs": "120", "compute_capability": "12.0", "cuda_home": "/usr/local/cuda-12.8",
            "max_jobs": 20,
            "nvcc_threads": 4, "memory_max_bytes": build_memory_max(124.6),
            "cache_root": "/tmp/cache"}
    return BuildPlan(**{**base, **kw})


def test_build_runs_detached_with_a_memory_limit():
    command = build_command(plan())
    assert command.startswith("systemd-run --unit=gpuhost-flash-attn-build.service ")
    assert f"--property=MemoryMax={int(120.6 * 2**30)}" in command
    for env in ("MAX_JOBS=20", "NVCC_THREADS=4", "FLASH_ATTN_CUDA_ARCHS=120",
                "FLASH_ATTENTION_FORCE_BUILD=TRUE", "CUDA_HOME=/usr/local/cuda-12.8"):
        assert f"--setenv={env}" in command
    assert "pip wheel --no-deps --require-hashes --no-build-isolation" in command
    assert "--trusted-host 10.213.1.1" in command
    assert "--wait" not in command and "--pty" not in command


def test_memory_max_keeps_headroom():
    assert build_memory_max(22.5) == int(18.5 * 2**30)
    assert build_memory_max(3.0) == 2**30


def test_nvcc_against_torch():
    text = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 12.8, V12.8.93"
    assert parse_nvcc_release(text) == "12.8"
    check_nvcc("12.8", "12.8", "2.9.1+cu128", "/usr/local/cuda-12.8")
    with pytest.raises(OperationError, match=r"nvcc 13.0 \(/usr/local/cuda-13.0\) does not "
                       r"match torch.version.cuda 12.8 \(torch 2.9.1\+cu128\)"):
        check_nvcc("13.0", "12.8", "2.9.1+cu128", "/usr/local/cuda-13.0")
    with pytest.raises(OperationError, match="not a CUDA build"):
        check_nvcc("12.8", "None", "2.9.1+cpu", "/usr/local/cuda-12.8")
    with pytest.raises(OperationError, match="is the CUDA toolkit installed"):
        check_nvcc(None, "12.8", "2.9.1", "/usr/local/cuda-12.8")


def test_unlocked_distributions():
    installed = {"torch": "2.9.1", "pip": "24.0", "requests": "2.32.3"}
    assert unlocked(installed, ["torch"]) == {"requests": "2.32.3"}
    text = describe_drift({"sgl-kernel": (None, "0.3.21"), "torch": ("2.9.0", "2.9.1")},
                          {"requests": "2.32.3"})
    assert text.splitlines() == ["sgl-kernel missing -> 0.3.21 (lock)",
                                 "torch 2.9.0 -> 2.9.1 (lock)",
                                 "requests 2.32.3 not in the lock: removed"]


def test_cuda_the_venv_needs():
    assert venv_cuda({"torch": "2.9.1+cu128"}) == ("12.8", "torch 2.9.1+cu128")
    assert venv_cuda({"torch": "2.9.1", "nvidia-cuda-runtime-cu12": "12.8.90"}) == (
        "12.8", "nvidia-cuda-runtime-cu12 12.8.90")
    assert venv_cuda({"torch": "2.11.0", "flashinfer-jit-cache-cu13": "0.6.9"})[0] == "13.0"
    assert venv_cuda({"torch": "2.9.1", "sglang": "0.5.9"}) is None


def test_driver_against_the_venv(monkeypatch):
    import operations.plans.cuda_compat

    # NVIDIA's table as operations/plans/settings.py had it when these cases were written
    monkeypatch.setattr(operations.plans.cuda_compat, "CUDA_MIN_DRIVER",
                        {"12.8": "570.26", "13.0": "580.65.06"})
    assert min_driver_for("12.8") == "570.26"
    assert min_driver_for("12.9") == "570.26"  # nearest known of the same major
    assert min_driver_for("11.8") is None
    assert driver_problem("12.8", "torch 2.9.1+cu128", "580.105.08") is None
    assert driver_problem("12.8", "torch 2.9.1+cu128", "580") is None
    problem = driver_problem("13.0", "torch 2.11.0+cu130", "570.124.06")
    assert problem.startswith("the venv needs CUDA 13.0 (torch 2.11.0+cu130), which needs "
                              "NVIDIA driver >= 580.65.06; driver 570.124.06 supports CUDA 12.8")
    assert "driver 575 supports CUDA 12.8 at most" in driver_problem("13.0", "x", "575")


@pytest.mark.parametrize("value", ["120", "sm_120", "12", "12.0.1", "compute_120", 120])
def test_an_architecture_that_is_not_a_compute_capability(tmp_path, value):
    lock = tmp_path / "lock.txt"
    lock.write_text("sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n")
    with pytest.raises(SettingsError, match=r"gpuhost_compute_capability = .* is not allowed: "
                       "a compute capability"):
        from_host_data("gpu1", {"gpuhost_lock": str(lock), "gpuhost_compute_capability": value})


def test_wheel_cache_setting(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n")
    s = from_host_data("gpu1", {"gpuhost_lock": str(lock), "gpuhost_wheel_cache": "/srv/wheels"})
    assert s.wheel_cache == "/srv/wheels"
    with pytest.raises(SettingsError, match="gpuhost_wheel_cache = 'wheels' is not allowed"):
        from_host_data("gpu1", {"gpuhost_lock": str(lock), "gpuhost_wheel_cache": "wheels"})


def _refusals_for(installed, torch_cuda, driver_state, lock_text, tmp_path, **data):
    """Run the ML venv stage's driver check on a fake host with these facts; return the
    refusals it recorded."""
    from pyinfra.context import ctx_host, ctx_state
    from pyinfra_testing.util import FakeState, create_host

    from operations.plans import plan
    from operations.plans.lock import read_lock
    from operations.stages.mlenv import check_driver_for_venv

    lock = tmp_path / "lock.txt"
    lock.write_text(lock_text)
    settings = from_host_data("gpu1", {"gpuhost_lock": str(lock), **data})
    state = FakeState()
    host = create_host(state, name="gpu1", facts={
        "venv_facts.VenvTorchCuda": {"venv=/opt/gpuhost/venv": torch_cuda},
        "gpu.NvidiaDriver": driver_state,
    })
    plan._refusals.clear()
    with ctx_state.use(state), ctx_host.use(host):
        check_driver_for_venv(settings, read_lock(lock), installed, "/opt/gpuhost/venv")
    refusals = [r for rs in plan._refusals.values() for r in rs]
    plan._refusals.clear()
    return refusals


SGLANG = "sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n"


def test_driver_refused_for_the_venvs_cuda(tmp_path):
    from operations.facts.nvsmi import DriverState

    refusals = _refusals_for({"torch": "2.11.0+cu130"}, "13.0",
                             DriverState(status="ok", driver_version="570.124.06"),
                             SGLANG, tmp_path, gpuhost_driver_branch="570")
    assert len(refusals) == 1
    assert refusals[0].startswith("ML venv: the venv needs CUDA 13.0 (")
    assert "driver 570.124.06 supports CUDA 12." in refusals[0]
    # the same venv on an R580 driver passes
    assert _refusals_for({"torch": "2.11.0+cu130"}, "13.0",
                         DriverState(status="ok", driver_version="580.105.08"),
                         SGLANG, tmp_path) == []
    # a fresh host: nothing installed, no driver yet, the lock names no CUDA: checked later
    assert _refusals_for({}, None, DriverState(status="absent"), SGLANG, tmp_path) == []


class ScriptedHost:
    """The build's host as _build sees it: each ``systemctl show ...`` answers the next state
    of ``states`` (unit properties, the key the build dir is for, whether it finished);
    every command is kept."""

    def __init__(self, states):
        self.states, self.commands = list(states), []

    def run(self, command: str, what: str, timeout: float = 0) -> str:
        self.commands.append(command)
        if command.startswith("systemctl show"):
            props, key, done = self.states.pop(0) if len(self.states) > 1 else self.states[0]
            # as pyinfra gives stdout: lines joined, the last without its newline; the log's
            # last line has none of its own (pip's progress), hence the blank line printf adds
            return ("\n".join(f"{k}={v}" for k, v in props.items()) + "\n\n---\n"
                    + "Building wheel for flash-attn (setup.py): started\n---\n"
                    + (json.dumps(key.__dict__) if key else "") + "\n\n---"
                    + ("\ncomplete" if done else ""))
        if command.startswith("ls "):
            return "/opt/gpuhost/build/flash-attn/wheels/flash_attn-2.8.3.post2-py3-none-any.whl\n"
        return ""


RUNNING = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"}
EXITED = {"LoadState": "loaded", "ActiveState": "active", "SubState": "exited",
          "Result": "success", "ExecMainStatus": "0"}
GONE = {"LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead"}


def started(host: ScriptedHost) -> bool:
    return any("systemd-run" in c for c in host.commands)


def test_a_build_that_finished_meanwhile_is_taken_not_rebuilt(monkeypatch):
    from operations.stages import flash_attn

    for props in (EXITED, GONE):  # still loaded, or unloaded since (a reboot, a stop)
        host = ScriptedHost([(props, KEY, True)])
        wheel = flash_attn._build(host, plan(), KEY)
        assert wheel.endswith("flash_attn-2.8.3.post2-py3-none-any.whl")
        assert not started(host)


def test_a_running_build_for_the_same_key_is_followed(monkeypatch):
    from operations.stages import flash_attn

    monkeypatch.setattr(flash_attn.time, "sleep", lambda s: None)
    host = ScriptedHost([(RUNNING, KEY, False), (RUNNING, KEY, False), (EXITED, KEY, True)])
    flash_attn._build(host, plan(), KEY)
    assert not started(host)


def test_a_build_for_another_key_is_replaced(monkeypatch):
    from operations.stages import flash_attn

    monkeypatch.setattr(flash_attn.time, "sleep", lambda s: None)
    other = BuildKey("2.8.3.post2", "2.9.2+cu128", "12.8", "3.12", "120")
    for before in [(RUNNING, other, False), (EXITED, other, True), (GONE, None, False)]:
        host = ScriptedHost([before, (RUNNING, KEY, False), (EXITED, KEY, True)])
        flash_attn._build(host, plan(), KEY)
        (start,) = [c for c in host.commands if "systemd-run" in c]
        assert "rm -rf /opt/gpuhost/build/flash-attn" in start
        assert json.dumps(KEY.__dict__, sort_keys=True) in start  # the key.json it writes


def test_an_ended_build_without_its_marker_failed(monkeypatch):
    from operations.stages import flash_attn

    monkeypatch.setattr(flash_attn.time, "sleep", lambda s: None)
    failed = {**EXITED, "Result": "exit-code", "ExecMainStatus": "1"}
    host = ScriptedHost([(GONE, None, False), (RUNNING, KEY, False), (failed, KEY, False)])
    with pytest.raises(OperationError, match="ended with result exit-code, exit status 1"):
        flash_attn._build(host, plan(), KEY)


def test_the_build_marks_its_own_success():
    command = build_command(plan())
    assert "/bin/sh -c '\"$@\" && : > /opt/gpuhost/build/flash-attn/complete' sh" in command


def test_the_controller_does_not_sleep_between_polls_the_host_watches(monkeypatch):
    from operations.stages import flash_attn

    def no_sleep(seconds):
        raise AssertionError(f"the controller slept {seconds} s between polls")

    monkeypatch.setattr(flash_attn.time, "sleep", no_sleep)
    host = ScriptedHost([(GONE, None, False), (RUNNING, KEY, False), (RUNNING, KEY, False),
                         (EXITED, KEY, True)])
    flash_attn._build(host, plan(), KEY)
    after_start = host.commands[next(i for i, c in enumerate(host.commands)
                                     if "systemd-run" in c) + 1:]
    polls = [c for c in after_start if c.startswith(("timeout ", "systemctl show"))]
    # each state read after the start follows a watch of the unit on the host
    assert [c.split()[0] for c in polls] == ["timeout", "systemctl"] * 3


def test_the_watch_ends_within_a_second_of_the_build(tmp_path):
    """watch_command run by sh, with a systemctl on PATH that answers 'running' twice, then
    'exited' (as systemd does for the RemainAfterExit unit once its build ended)."""
    from operations.stages import flash_attn

    count = tmp_path / "count"
    fake = tmp_path / "systemctl"
    fake.write_text(f"#!/bin/sh\necho x >> {count}\n"
                    f'[ "$(wc -l < {count})" -le 2 ] && echo running || echo exited\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    began = time.monotonic()
    subprocess.run(["sh", "-c", flash_attn.watch_command(30)], env=env, check=True)
    took = time.monotonic() - began
    assert len(count.read_text().splitlines()) == 3
    assert took < 2 * flash_attn.WATCH_EVERY_S + 1.0
    began = time.monotonic()  # a build still running: the watch gives up after its seconds
    fake.write_text("#!/bin/sh\necho running\n")
    subprocess.run(["sh", "-c", flash_attn.watch_command(1)], env=env, check=True)
    assert 0.9 < time.monotonic() - began < 3
