"""Upgrades that cannot leave a host down, end to end on one sandbox host: the server runs from
its lock's own venv under /opt/gpuhost/venvs; a switch to the CUDA 13.0 stack (toolkit and lock)
and back to 12.8, each lock built beside the running server, which serves until the one restart
(the previous venv then removed: retention), a second run changing nothing; a venv of an
earlier gpuhost at gpuhost_venv_path is taken over without a flash-attn build; a flag the
server rejects at start and a new venv with an environment it cannot start with are rolled back
to the last known good, a rollback on request, an interrupted rollback finished by the next run.
Checked with ssh on the host (the link, the server's command line, its main PID), not through
pyinfra."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from operations.stages.venvs import VENVS_DIR, stack_venv
from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LINK = "/opt/gpuhost/venv"
BUILD_LOG = "/opt/gpuhost/build/flash-attn/build.log"


@pytest.fixture(scope="module")
def host(converged_host):
    return converged_host


@pytest.fixture(scope="module")
def sandbox_lock() -> Path:
    (listed,) = json.loads(lab.sandbox("status", "--json").stdout)
    return Path(listed["lock"])


@pytest.fixture(scope="module")
def new_lock(sandbox_lock, tmp_path_factory) -> Path:
    return relocked(sandbox_lock, tmp_path_factory.mktemp("locks") / "relocked.txt")


def deploy_with(tmp_path: Path, *extra: str, **overrides) -> lab.Run:
    """A deploy with ``overrides`` merged into each host's data (an inventory of its own: the
    values are not all text)."""
    entries = [(h["name"], {**lab.inventory_data(h), **overrides})
               for h in json.loads(lab.sandbox("status", "--json").stdout)]
    path = tmp_path / f"inventory{time.monotonic_ns()}.py"
    path.write_text("import json\nsandbox = [tuple(e) for e in json.loads("
                    f"{json.dumps(json.dumps(entries))})]\n")
    return lab.deploy(*extra, inventory=str(path))


def server_env(mode: str) -> dict:
    """The default server environment with the stand-in's mode (its SANDBOX_SGLANG_MODE)."""
    return {"gpuhost_server_env": {"OMP_NUM_THREADS": "8", "SAFETENSORS_FAST_GPU": "1",
                                   "SANDBOX_SGLANG_MODE": mode}}


def serves(host: lab.Host) -> bool:
    host.http_get("http://127.0.0.1:8000/health")  # raises unless it answers 200
    return host.ssh("systemctl is-active sglang.service", check=False).strip() == "active"


def served_venv(host: lab.Host) -> str:
    """The venv the server's main process runs from (its argv[0] is <venv>/bin/python)."""
    return host.process_args(host.main_pid())[0].removesuffix("/bin/python")


def relocked(sandbox_lock: Path, out: Path) -> Path:
    """The sandbox's lock with one more (unmatched) hash on its first pin: another lock digest,
    the same distributions (pip takes a file matching any of a pin's hashes)."""
    text = sandbox_lock.read_text()
    text = re.sub(r"(--hash=sha256:[0-9a-f]{64})", r"\1 --hash=sha256:" + "0" * 64, text, count=1)
    out.write_text(text)
    return out


def test_the_server_runs_from_its_locks_own_venv(host, sandbox_lock):
    venv = stack_venv(sandbox_lock)
    assert venv.startswith(f"{VENVS_DIR}/")
    assert host.ssh(f"readlink {LINK}").strip() == venv
    assert served_venv(host) == venv
    assert host.ssh(f"{LINK}/bin/python -c 'import sglang; print(sglang.__version__)'").strip() \
        == "0.5.9"


def upgraded(host: lab.Host, new: str, *data: str) -> tuple[lab.Run, list[tuple[int, bool]]]:
    """A deploy with ``data`` while the server's main PID and whether the venv ``new`` holds
    sglang yet are read every half second; returns the run and what was seen."""
    seen: list[tuple[int, bool]] = []  # (main PID, the new venv holds sglang) while it runs
    done = threading.Event()

    def watch():
        while not done.is_set():
            out = host.ssh(f"systemctl show -p MainPID --value sglang.service; "
                           f"ls -d {new}/lib/python3*/site-packages/sglang-*.dist-info "
                           "2>/dev/null | wc -l", check=False).split()
            if len(out) == 2:
                seen.append((int(out[0]), out[1] != "0"))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run = lab.deploy(*(a for key in data for a in ("--data", key)))
    finally:
        done.set()
        watcher.join()
    return run, seen


def toolkit(host: lab.Host, cuda: str) -> str:
    """dpkg's status and version of NVIDIA's cuda-toolkit-X-Y, and its nvcc's release line."""
    package = "cuda-toolkit-" + cuda.replace(".", "-")
    return host.ssh(f"dpkg-query -W -f='${{Status}} ${{Version}}\\n' {package}; "
                    f"/usr/local/cuda-{cuda}/bin/nvcc --version | grep release", check=False)


def test_cuda_13_and_back_each_built_beside_the_serving_venv(host, sandbox_lock, new_lock):
    """gpuhost_cuda_toolkit = "13.0" (issue 39): the CUDA 13 toolkit, and the CUDA 13 stack's
    lock (the sandbox's stand-in of locks/cuda13.0.txt, `status --json` locks, named as a real
    lab names its own lock) built into a venv beside the serving one, which serves until the
    new one passed its health gate; then back to 12.8 the same way (a 12.8 lock under another
    digest, so its venv is new too: the retention removed the first), and a run that changes
    nothing."""
    (listed,) = json.loads(lab.sandbox("status", "--json").stdout)
    cuda13_lock = listed["locks"]["13.0"]
    old, pid = stack_venv(sandbox_lock), host.main_pid()
    assert served_venv(host) == old
    assert " ok installed" not in toolkit(host, "13.0")
    new = stack_venv(Path(cuda13_lock))
    assert new != old
    run, seen = upgraded(host, new, "gpuhost_cuda_toolkit=13.0", f"gpuhost_lock={cuda13_lock}")
    assert run.returncode == 0, run.output[-6000:]
    # the CUDA 13.0 toolkit from NVIDIA's (stand-in) repository; 12.8's stays installed
    installed = toolkit(host, "13.0")  # held: dpkg's status says "hold ok installed"
    assert re.search(r"^hold ok installed 13\.0\.\d", installed), installed
    assert "release 13.0" in installed
    # the old server served while the new venv had its stack in it, before the one restart
    assert (pid, True) in seen, seen
    pid13 = host.main_pid()
    assert pid13 != pid and serves(host)
    assert served_venv(host) == new and host.ssh(f"readlink {LINK}").strip() == new
    assert host.process_env(pid13)["CUDA_HOME"] == "/usr/local/cuda-13.0"
    versions = host.ssh(f"{new}/bin/python -c 'import torch, sglang; "
                        "print(torch.__version__, torch.version.cuda, sglang.__version__)'")
    assert versions.split() == ["2.11.0+cu130", "13.0", "0.5.17"]
    assert host.ssh(f"test -e {new}/gpuhost-flash-attn.json && echo built || echo none"
                    ).strip() == "none"  # no flash-attn 2 in this stack: nothing built
    assert f"removed the venv {old} (gpuhost_venvs_kept = 1" in run.output, run.output[-6000:]

    # back to CUDA 12.8, the same way
    back = stack_venv(new_lock)
    run, seen = upgraded(host, back, "gpuhost_cuda_toolkit=12.8", f"gpuhost_lock={new_lock}")
    assert run.returncode == 0, run.output[-6000:]
    assert (pid13, True) in seen, seen
    pid12 = host.main_pid()
    assert pid12 != pid13 and serves(host)
    assert served_venv(host) == back and host.ssh(f"readlink {LINK}").strip() == back
    assert host.process_env(pid12)["CUDA_HOME"] == "/usr/local/cuda-12.8"
    assert host.ssh(f"{back}/bin/python -c 'import torch, sglang; "
                    "print(torch.__version__, sglang.__version__)'").split() == [
        "2.9.1+cu128", "0.5.9"]
    # retention: the last known good (the 12.8 venv, once it passed) and no other
    assert f"removed the venv {new} (gpuhost_venvs_kept = 1" in run.output, run.output[-6000:]
    assert host.ssh(f"ls {VENVS_DIR}").split() == [back.rsplit("/", 1)[1]]

    again = lab.deploy("--json", "--data", "gpuhost_cuda_toolkit=12.8",
                       "--data", f"gpuhost_lock={new_lock}")
    assert again.returncode == 0, again.output[-6000:]
    assert again.results is not None, again.output[-3000:]
    changed = [op["name"] for op in again.results["results"]["operations"]
               if op["success"] or op["error"]]
    assert changed == [], changed
    assert host.main_pid() == pid12 and host.ssh(f"readlink {LINK}").strip() == back


def test_an_earlier_gpuhosts_venv_is_taken_over_without_a_build(host, new_lock):
    # an earlier gpuhost's host: a real venv at the path, the server on the lock's venv
    venv, pid, data = stack_venv(new_lock), host.main_pid(), ("--data", f"gpuhost_lock={new_lock}")
    host.ssh(f"rm -f {BUILD_LOG}; rm {LINK} && python3 -m venv --without-pip {LINK} && "
             f"touch {LINK}/notes.txt")
    refused = lab.deploy(*data)
    assert refused.returncode != 0
    assert (f"gpuhost_venv_path = '{LINK}' is not allowed: it is a folder holding what a venv "
            "does not (notes.txt)") in refused.output, refused.output[-6000:]
    assert "Traceback" not in refused.output
    assert host.ssh(f"test -f {LINK}/notes.txt && echo kept").strip() == "kept"
    host.ssh(f"rm {LINK}/notes.txt")
    run = lab.deploy(*data)
    assert run.returncode == 0, run.output[-6000:]
    assert host.ssh(f"readlink {LINK}").strip() == venv
    assert served_venv(host) == venv
    assert host.ssh(f"test -e {BUILD_LOG} && echo built || echo none").strip() == "none"
    assert host.main_pid() == pid


def test_a_flag_the_server_rejects_at_start_is_rolled_back(host, new_lock, tmp_path):
    venv, pid = stack_venv(new_lock), host.main_pid()
    host.ssh("python3 - <<'EOF'\nimport json\np = '/etc/gpuhost-sandbox/hardware.json'\n"
             "d = json.load(open(p))\nd['serving']['backend_modes'] = {'flashinfer_cutlass': "
             "'crash-on-start'}\njson.dump(d, open(p, 'w'))\nEOF")
    unit = host.ssh("cat /etc/systemd/system/sglang.service")
    run = deploy_with(tmp_path, gpuhost_lock=str(new_lock),
                      gpuhost_moe_runner_backend="flashinfer_cutlass")
    assert run.returncode != 0
    assert "last 50 lines of the journal" in run.output, run.output[-6000:]
    assert "crash-on-start mode" in run.output  # the failed start's own journal line
    assert ("the server with the unit as this run changed it failed the health gate (its "
            "journal above); rolled back to the last known good") in run.output, run.output[-6000:]
    assert "it serves again, verified by the health gate" in run.output
    assert "\nTraceback" not in run.output  # the crash's own is in the journal lines
    new_pid = host.main_pid()
    assert new_pid != pid and serves(host)
    args = host.process_args(new_pid)
    assert args[args.index("--moe-runner-backend") + 1] == "cutlass"  # the launch profile's
    assert host.ssh("cat /etc/systemd/system/sglang.service") == unit
    assert served_venv(host) == venv
    assert host.ssh("test -e /var/lib/gpuhost/rollback.json && echo left || echo gone"
                    ).strip() == "gone"


def test_a_new_venv_failing_the_gate_goes_back_to_the_previous_venv(host, sandbox_lock,
                                                                     new_lock, tmp_path):
    # the sandbox's own lock again (its venv, removed by the retention, is built beside the
    # serving one), with an environment the server cannot start with: unit, environment and
    # venv all go back
    previous, env = stack_venv(new_lock), host.ssh("cat /etc/gpuhost/server.env")
    run = deploy_with(tmp_path, gpuhost_lock=str(sandbox_lock), **server_env("crash-on-start"))
    assert run.returncode != 0
    said = re.search(r"the server with (.*) as this run changed it failed the health gate "
                     r"\(its journal above\); rolled back to the last known good", run.output)
    assert said, run.output[-6000:]
    assert "the unit" in said.group(1) and "the server environment" in said.group(1)
    assert "it serves again, verified by the health gate" in run.output
    assert served_venv(host) == previous and serves(host)
    assert host.ssh(f"readlink {LINK}").strip() == previous
    assert host.ssh("cat /etc/gpuhost/server.env") == env
    record = json.loads(host.ssh("cat /var/lib/gpuhost/last-known-good.json"))
    assert record["server"]["venv"] == previous
    assert host.ssh("stat -c %a /var/lib/gpuhost/last-known-good").strip() == "700"
    assert host.ssh(f"ls {VENVS_DIR}").split() == sorted(
        [previous.rsplit("/", 1)[1], stack_venv(sandbox_lock).rsplit("/", 1)[1]])


def test_a_rollback_on_request_restores_the_last_known_good(host, new_lock):
    env = host.ssh("cat /etc/gpuhost/server.env")
    host.ssh("echo SANDBOX_SGLANG_MODE=crash-on-start >> /etc/gpuhost/server.env && "
             "systemctl stop sglang.service")
    run = lab.deploy("--data", "gpuhost_rollback=true", "--data", f"gpuhost_lock={new_lock}")
    assert run.returncode == 0, run.output[-6000:]
    assert "Rollback: restored /etc/gpuhost/server.env" in run.output, run.output[-6000:]
    assert "the host serves its last known good" in run.output
    assert "Locked ML stack" not in run.output  # nothing else of the deploy ran
    assert host.ssh("cat /etc/gpuhost/server.env") == env and serves(host)


def test_an_interrupted_rollback_is_finished_by_the_next_run(host, new_lock, tmp_path):
    env, venv = host.ssh("cat /etc/gpuhost/server.env"), stack_venv(new_lock)
    inventory = tmp_path / "inventory.py"
    entries = [(h["name"], {**lab.inventory_data(h), "gpuhost_lock": str(new_lock),
                            **server_env("crash-on-start")})
               for h in json.loads(lab.sandbox("status", "--json").stdout)]
    inventory.write_text("import json\nsandbox = [tuple(e) for e in json.loads("
                         f"{json.dumps(json.dumps(entries))})]\n")
    # the controller dies once the rollback has begun (its record written), before the gate
    log = tmp_path / "killed.log"
    run = subprocess.Popen([str(lab.PYINFRA), "-y", str(inventory), "deploy.py"], cwd=lab.ROOT,
                           stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                           start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and run.poll() is None:
        if host.ssh("test -f /var/lib/gpuhost/rollback.json && echo begun", check=False).strip():
            break
        time.sleep(0.2)
    if run.poll() is None:
        os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=30)
    lab.GUARD.observe("interrupted rollback", log.read_text())
    assert host.ssh("test -f /var/lib/gpuhost/rollback.json && echo left", check=False
                    ).strip() == "left", log.read_text()[-6000:]
    host.ssh("systemctl stop sglang.service")  # as if the host rebooted meanwhile
    again = lab.deploy("--data", f"gpuhost_lock={new_lock}")
    assert again.returncode != 0, again.output[-6000:]
    assert "did not finish: finishing it first" in again.output, again.output[-6000:]
    assert "the host serves its last known good" in again.output
    assert "host data's configuration is not applied in this run" in again.output
    assert host.ssh("test -f /var/lib/gpuhost/rollback.json && echo left || echo gone"
                    ).strip() == "gone"
    assert host.ssh("cat /etc/gpuhost/server.env") == env and serves(host)
    third = lab.deploy("--data", f"gpuhost_lock={new_lock}")
    assert third.returncode == 0, third.output[-6000:]
    assert served_venv(host) == venv and serves(host)
