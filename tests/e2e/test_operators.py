"""Real operators' conditions, end to end on one sandbox host: the deploy logs in as a sudo user
to a host whose locale is German (the sandbox's default, so every e2e test runs so), two runs
meet at one host, apt's lists lock is taken by someone else, and the link drops during the
flash-attn build. Checks go through plain ssh as root, never through pyinfra.

Each of these failed before the product handled it: as a sudo user the run ended "executed 0
commands" (callbacks without sudo); in German, apt-cache's "Installationskandidat:" made a false
"no kernel headers" refusal; a second run went ahead beside the first; apt's lists lock failed
the run at once; a dropped link hung the run, then a traceback, and the next run deleted the
build that had finished meanwhile and compiled again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e import audit, lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BUILD_UNIT = "gpuhost-flash-attn-build.service"
BUILD_DIR = "/opt/gpuhost/build/flash-attn"
VENV = "/opt/gpuhost/venv"
HOLDERS = "/run/gpuhost/deploy-lock.d"


class Background:
    """A deploy running beside the test; stopped when the test ends, however it ends."""

    running: list[Background] = []

    def __init__(self, inventory: Path, log: Path):
        self.log = log
        Background.running.append(self)
        self.proc = subprocess.Popen(
            [str(lab.PYINFRA), "-y", str(inventory), "deploy.py"], cwd=lab.ROOT,
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def output(self) -> str:
        return self.log.read_text()

    def until(self, what: str, seen, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if seen():
                return
            if self.proc.poll() is not None:
                pytest.fail(f"the deploy ended before {what}:\n{self.output()[-6000:]}")
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"no {what} within {timeout:g} s:\n{self.output()[-6000:]}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        lab.GUARD.observe(f"background deploy {self.log.name}", self.output())


@pytest.fixture(autouse=True)
def no_deploy_left_behind():
    yield
    while Background.running:
        Background.running.pop().stop()


@pytest.fixture(scope="module")
def host():
    # a converged host where the suite keeps images: its first deploy here is this module's
    # first (as the sudo user, in German); a bare converge as that user is every bare
    # module's (the sandbox's default login), tests/e2e/test_deploy.py's first of all
    (h,) = lab.up_from_image(hosts=1, first_deploy=False)
    # 40 s builds (real: up to an hour), so that a deploy can be met in the middle of one
    h.set_scenario_host(flash_attn_build_seconds=40)
    yield h
    lab.sandbox("down", check=False)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("operators")


def inventory(work: Path, name: str = "inv", **data) -> Path:
    return audit.write_inventory(work / f"{name}.py", data)


def as_operator(host: lab.Host, command: str) -> str:
    listed = json.loads(lab.sandbox("status", "--json").stdout)[0]
    result = subprocess.run(
        ["ssh", "-i", host.ssh_key, "-o", "StrictHostKeyChecking=no",
         "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
         f"{listed['ssh_user']}@{host.address}", command],
        text=True, capture_output=True, timeout=60, check=True)
    return result.stdout


def needs_a_build(host: lab.Host, work: Path) -> Path:
    """flash-attn gone from the venv, no earlier build's wheel on the host and an empty wheel
    cache: the next deploy builds."""
    host.ssh(f"{VENV}/bin/python -m pip uninstall -y -q flash-attn 2>/dev/null; "
             f"rm -rf {BUILD_DIR}")
    cache = work / f"cache-{time.monotonic_ns()}"
    return inventory(work, f"inv-{cache.name}", gpuhost_wheel_cache=str(cache))


def build_running(host: lab.Host) -> bool:
    # check=False: on a fresh host the deploy reboots it before the build
    return host.ssh(f"systemctl is-active {BUILD_UNIT}", check=False).strip() == "active"


def test_as_a_sudo_user_on_a_german_host(host, work):
    # the host is as hostile as promised
    assert "Installationskandidat:" in as_operator(host, "apt-cache policy bash")
    assert as_operator(host, "id -u").strip() != "0"
    first = lab.deploy(inventory=str(inventory(work)))
    assert first.returncode == 0, first.output[-8000:]
    assert "executed 0 commands" not in first.output
    logins = host.ssh("journalctl -q --no-pager -t sshd -t sshd-session | grep Accepted || true")
    assert "Accepted publickey for gpuops" in logins
    # what the deploy wrote is root's, as if root had written it
    assert host.ssh("stat -c '%U:%G %a' /etc/gpuhost/server.env").split() == ["root:root", "600"]
    pid = host.main_pid()
    again = lab.deploy("--json", inventory=str(inventory(work)))
    assert again.returncode == 0, again.output[-6000:]
    changed = [op["name"] for op in again.results["results"]["operations"]
               if op["success"] or op["error"]]
    assert changed == [], changed
    assert host.main_pid() == pid
    assert host.ssh(f"ls -A {HOLDERS}").strip() == "", "a finished run left its lock holder"


def test_two_deploys_at_once(host, work):
    slow = needs_a_build(host, work)
    first = Background(slow, work / "first.log")
    first.until("the first run's deploy lock",
                lambda: host.ssh(f"ls {HOLDERS} 2>/dev/null || true").strip())
    second = lab.deploy(inventory=str(inventory(work)))
    assert second.returncode != 0
    assert "gpu1 is being deployed: a deploy by" in second.output, second.output[-4000:]
    assert "logged in as gpuops" in second.output
    assert "gpuhost_deploy_lock_wait" in second.output
    assert "nothing was changed" in second.output
    assert "Traceback" not in second.output
    waiter = Background(inventory(work, "inv-wait", gpuhost_deploy_lock_wait=600),
                        work / "waiter.log")
    waiter.until("the waiting run's message", lambda: "deploy lock: waiting up to 600 s"
                 in waiter.output())
    assert first.wait(timeout=600) == 0, first.output()[-6000:]
    assert waiter.wait(timeout=600) == 0, waiter.output()[-6000:]
    # the waiter planned after the first run ended: it found the host converged
    assert "flash-attn build" not in waiter.output()
    assert "No changes" in waiter.output()


def test_apt_waits_for_its_lists_lock(host, work):
    # someone else's apt (apt-daily, a person) holds the lists lock for 20 s
    host.ssh("systemd-run --unit=test-apt-lists-lock python3 -c \"import fcntl, time; "
             "f = open('/var/lib/apt/lists/lock', 'w'); fcntl.lockf(f, fcntl.LOCK_EX); "
             "time.sleep(20)\"")
    host.ssh("rm /etc/apt/preferences.d/gpuhost-nvidia-driver")  # the deploy updates its lists
    run = lab.deploy(inventory=str(inventory(work)))
    assert run.returncode == 0, run.output[-6000:]
    assert "waiting for apt's lists lock" in run.output


def compiling(host: lab.Host) -> bool:
    """Past pip's downloads from the lab's index (which a dropped link would fail): pip logs
    "Building wheel for flash-attn (...): started" once it runs the build (its non-interactive
    spinner: pip/_internal/operations/build/wheel.py, cli/spinners.py)."""
    log = host.ssh(f"cat {BUILD_DIR}/build.log 2>/dev/null || true", check=False)
    return "Building wheel for " in log


def test_a_link_that_drops_during_the_build(host, work):
    slow = needs_a_build(host, work)
    run = Background(slow, work / "dropped.log")
    run.until("the flash-attn build", lambda: build_running(host) and compiling(host))
    lab.sandbox("link", "gpu1", "down")
    try:
        rc = run.wait(timeout=240)
    finally:
        lab.sandbox("link", "gpu1", "up")
    out = run.output()
    assert rc != 0
    assert "connection to gpu1 lost during the flash-attn build" in out, out[-4000:]
    assert "run again" in out and "the next run takes its wheel" in out
    assert "Traceback" not in out
    # the build went on without the deploy
    deadline = time.monotonic() + 180
    while host.ssh(f"test -e {BUILD_DIR}/complete && echo done || true").strip() != "done":
        assert time.monotonic() < deadline, "the build did not finish on the host"
        time.sleep(2)
    log_before = host.ssh(f"stat -c '%i %Y' {BUILD_DIR}/build.log")
    # the dead run's lock lets go once its connection is found gone: the next run may wait
    again = lab.deploy(inventory=str(inventory(
        work, "inv-after-drop", gpuhost_wheel_cache=str(work / "cache-after-drop"),
        gpuhost_deploy_lock_wait=400)))
    assert again.returncode == 0, again.output[-6000:]
    assert "finished meanwhile" in again.output
    assert "build started" not in again.output
    assert host.ssh(f"stat -c '%i %Y' {BUILD_DIR}/build.log") == log_before
    assert host.ssh(f"systemctl show -p LoadState --value {BUILD_UNIT}").strip() == "not-found"
    assert host.ssh("systemctl is-active sglang.service").strip() == "active"
