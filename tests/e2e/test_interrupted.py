"""Interrupted deploys, end to end on one sandbox host: the deploy is killed at six points, each
time with the remote work it was doing, and each time the next deploy converges to a healthy
server, with one NVIDIA apt source, no package or venv left half-installed and in use, no lock
left held, and nothing lost (the model's weights, the P2P measurement, the verified server).

The points, in order:

1. during the driver's apt install (the kernel module's DKMS build: dpkg, apt-get and the
   postinst are killed with the deploy, as a lost session or a power cut would);
2. during the venv install (pip killed too);
3. during the flash-attn build (the build goes on: it runs detached, in a systemd unit);
4. after the new unit file is written, before systemd reloads it;
5. after systemd reloaded it, before the server restarts;
6. during the health gate's wait (the gate's process killed too).

Points 4 and 5 are hit exactly: a test instrument on the host (a `systemctl` in /usr/local/sbin
that passes every call through) drops the deploy's SSH connection at the first `daemon-reload`
or `restart` once armed, before calling systemd. The others are hit by watching the host for
the process of that step (the sandbox's DKMS and flash-attn builds are given 30 s). Checks go
through ssh, never through pyinfra. (Patterns given to pgrep/pkill are written so that they do
not match the shell that runs them: "[.]postinst", "[-]m".)
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e import audit, lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

UNIT = "sglang.service"
BUILD_UNIT = "gpuhost-flash-attn-build.service"
VENV = "/opt/gpuhost/venv"
#: the venvs themselves, one per lock digest (VENV links to the serving one:
#: operations/stages/venvs.py)
VENVS = "/opt/gpuhost/venvs"
KILL_AT = "/run/gpuhost-test-kill-at"
#: The test instrument (module docstring): when KILL_AT names this call's verb, the deploy's
#: SSH connection dies here and systemd is not called.
SYSTEMCTL_INSTRUMENT = f"""#!/bin/sh
# Test instrument of tests/e2e/test_interrupted.py; passes every call to systemctl.
if [ -f {KILL_AT} ]; then
    for arg in "$@"; do
        if [ "$arg" = "$(cat {KILL_AT})" ]; then
            rm -f {KILL_AT}
            pkill -KILL -f '^sshd(-session)?: gpuops'
            exit 1
        fi
    done
fi
exec /usr/bin/systemctl "$@"
"""


class Deploy:
    """A deploy running in the background, killable at any moment."""

    def __init__(self, inventory: Path, log: Path):
        self.log = log
        self.proc = subprocess.Popen(
            [str(lab.PYINFRA), "-y", str(inventory), "deploy.py"], cwd=lab.ROOT,
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def output(self) -> str:
        return self.log.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        lab.GUARD.observe(f"interrupted deploy {self.log.name}", self.output())

    def wait_for(self, host: lab.Host, check: str, what: str, timeout: float = 600) -> None:
        """Until ``check`` (a shell command on the host) prints something; fails when the
        deploy ended first or the time is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if host.ssh(check, check=False).strip():
                return
            if self.proc.poll() is not None:
                pytest.fail(f"the deploy ended (exit {self.proc.returncode}) before {what}:\n"
                            + self.output()[-6000:])
            time.sleep(0.2)
        self.kill()
        pytest.fail(f"no {what} within {timeout:g} s:\n" + self.output()[-6000:])


@pytest.fixture(scope="module")
def host():
    (h,) = lab.up(hosts=1, scenario="reference-lab")
    # The slow builds take 30 s here (real: minutes), so that a deploy can be caught in them.
    h.set_scenario_host(dkms_build_seconds=30, flash_attn_build_seconds=30)
    yield h
    lab.sandbox("down", check=False)


def converge(inventory: Path) -> lab.Run:
    run = lab.deploy(inventory=str(inventory))
    assert run.returncode == 0, run.output[-8000:]
    return run


def assert_healthy_and_whole(host: lab.Host, model: str = "glm-5") -> int:
    """The checks after every recovery (module docstring); returns the server's MainPID."""
    assert host.ssh(f"systemctl is-active {UNIT}").strip() == "active"
    models = json.loads(host.http_get("http://127.0.0.1:8000/v1/models"))
    assert [m["id"] for m in models["data"]] == [model]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}]})
    script = ("import urllib.request; print(urllib.request.urlopen(urllib.request.Request("
              f"'http://127.0.0.1:8000/v1/chat/completions', data={body!r}.encode(), "
              "headers={'Content-Type': 'application/json'})).read().decode())")
    answer = json.loads(host.ssh(f"python3 -c {json.dumps(script)}"))
    assert answer["choices"][0]["message"]["content"].strip()
    # one NVIDIA source, dpkg consistent, no lock held
    sources = host.ssh("grep -rhs '^deb .*cuda' /etc/apt/sources.list "
                       "/etc/apt/sources.list.d/ || true").splitlines()
    assert len(sources) == 1, sources
    assert host.ssh("dpkg --audit; ls -A /var/lib/dpkg/updates").strip() == ""
    held = host.ssh("python3 -c \"import fcntl; [fcntl.lockf(open(p, 'w'), fcntl.LOCK_EX | "
                    "fcntl.LOCK_NB) for p in ('/var/lib/dpkg/lock-frontend', "
                    "'/var/lib/dpkg/lock', '/var/lib/apt/lists/lock')]; print('free')\"")
    assert held.strip() == "free"
    # the venv is whole and is what the server runs
    assert "No broken requirements" in host.ssh(f"{VENV}/bin/python -m pip check")
    pre = host.ssh("grep -m1 '^ExecStartPre=' /etc/systemd/system/sglang.service").strip()
    # less the command's prefixes (systemd.service(5): "+" runs it as root, beside User=)
    argv = shlex.split(pre.removeprefix("ExecStartPre=").lstrip("+-@:!|"))
    del argv[argv.index("--write"):argv.index("--write") + 2]
    (stamp,) = [a for a in argv if a.endswith("/.gpuhost-model.json")]
    started = host.ssh("cat /run/gpuhost-sglang/inputs").strip()
    now = host.ssh(shlex.join(argv)).strip()
    assert started == now, "the running server predates the files it reads"
    assert host.ssh(f"systemctl show -p LoadState --value {BUILD_UNIT}").strip() == "not-found"
    assert host.ssh("systemctl show -p NeedDaemonReload --value sglang.service").strip() == "no"
    assert host.ssh("find /opt/gpuhost /etc/gpuhost /var/lib/gpuhost /etc/systemd/system "
                    "-name '*.tmp'").strip() == ""
    # nothing lost: the weights complete, the P2P measurement and the server's verification
    snapshot = json.loads(host.ssh(f"cat {stamp}"))
    assert snapshot["sha"] and snapshot["files"]
    assert json.loads(host.ssh("cat /var/lib/gpuhost/p2p.json"))["decision"]["p2p"] == "off"
    verified = host.ssh("cat /var/lib/gpuhost/sglang.verified").split()
    assert verified == [host.ssh(f"systemctl show -p InvocationID --value {UNIT}").strip()]
    return host.main_pid()


def no_change(inventory: Path, pid: int, host: lab.Host) -> None:
    again = lab.deploy("--json", inventory=str(inventory))
    assert again.returncode == 0, again.output[-6000:]
    assert again.results is not None
    changed = [op["name"] for op in again.results["results"]["operations"]
               if op["success"] or op["error"]]
    assert changed == [], changed
    assert host.main_pid() == pid


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("interrupted")


@pytest.fixture(scope="module")
def state() -> dict:
    """What one point leaves for the next: the server's MainPID, the P2P measurement's time."""
    return {}


def inventory(work: Path, name: str = "inv", **data) -> Path:
    return audit.write_inventory(work / f"{name}.py", data)


# The points run in this order, each on the host the one before left converged.


def test_1_during_the_drivers_apt_install(host, work, state):
    """dpkg, apt-get and the DKMS postinst die with the deploy."""
    run = Deploy(inventory(work), work / "k1.log")
    run.wait_for(host, r"pgrep -f '/var/lib/dpkg/info/[^ ]*nvidia[^ ]*\.postinst' || true",
                 "the kernel module's DKMS build")
    run.kill()
    host.ssh("pkill -KILL -x apt-get; pkill -KILL -x dpkg; pkill -KILL -f '[.]postinst'; true")
    assert host.ssh("dpkg --audit").strip(), "dpkg was not left interrupted"
    first = converge(inventory(work))
    assert "an earlier package run was interrupted" in first.output
    state["pid"] = assert_healthy_and_whole(host)
    state["p2p_measured_at"] = json.loads(host.ssh("cat /var/lib/gpuhost/p2p.json"))[
        "measured_at"]


def test_2_during_the_venv_install(host, work, state):
    """The venv is gone (a fresh rebuild); pip dies with the deploy. The venv the unit names
    is gone under the running server: the other folder of the lock is built, never the one
    the server started from; the next run finds it half-installed (pip's temporary files in
    it), clears it and builds it from empty."""
    serving = host.process_args(state["pid"])[0].removesuffix("/bin/python")
    host.ssh(f"rm -rf {VENV} {VENVS}")  # the link and the venvs it names
    run = Deploy(inventory(work), work / "k2.log")
    # pip installing, and a distribution of the lock's written (not pip's own, ensurepip's)
    installed = (f"ls -d {VENVS}/*/lib/python3*/site-packages/*.dist-info 2>/dev/null "
                 "| grep -v -E '/(pip|setuptools)-[^/]*$' | head -n 1")
    run.wait_for(host, f"pgrep -f '{VENVS}/[0-9a-f]+(-b)?/bin/python.* [-]m pip install' "
                       f">/dev/null && {installed} || true", "the venv's pip install")
    run.kill()
    host.ssh("pkill -KILL -f ' [-]m pip install'; true")
    assert host.main_pid() == state["pid"]  # the server still runs, its venv half-installed
    assert host.ssh(f"test -e {serving} || echo gone").strip() == "gone"  # never built there
    # what pip leaves when killed while it writes a distribution's INSTALLER (pip's
    # utils/filesystem.py adjacent_tmp_file: NamedTemporaryFile(prefix=<name>, suffix=".tmp")
    # beside it, renamed over it once written), whether or not this kill hit that moment
    left = host.ssh(installed).strip()
    host.ssh(f"touch {left}/INSTALLERk2wq9x1m.tmp")
    recovered = converge(inventory(work))
    assert "cleared and built again" in recovered.output, recovered.output[-6000:]
    pid = assert_healthy_and_whole(host)
    assert pid != state["pid"]  # restarted on the rebuilt venv
    assert host.process_args(pid)[0] != f"{serving}/bin/python"
    state["pid"] = pid


def test_3_during_the_flash_attn_build(host, work, state):
    """An empty wheel cache: the host compiles; the build goes on without the deploy."""
    host.ssh(f"{VENV}/bin/python -m pip uninstall -y -q flash-attn")
    cache = inventory(work, "inv-cache", gpuhost_wheel_cache=str(work / "empty-cache"))
    run = Deploy(cache, work / "k3.log")
    run.wait_for(host, f"systemctl is-active {BUILD_UNIT} | grep -x active || true",
                 "the flash-attn build")
    run.kill()
    assert host.ssh(f"systemctl is-active {BUILD_UNIT}").strip() == "active"
    third = converge(cache)
    # joined while it runs, or its wheel taken if it finished meanwhile: never built again
    assert "following it" in third.output or "finished meanwhile" in third.output
    assert "build started" not in third.output
    state["pid"] = assert_healthy_and_whole(host)
    for lock in (work / "empty-cache").glob("*.lock"):
        # the controller's wheel-cache lock: not held by the killed deploy
        with lock.open() as fh:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.fixture
def systemctl_instrument(host):
    host.ssh(f"cat > /usr/local/sbin/systemctl <<'EOF'\n{SYSTEMCTL_INSTRUMENT}EOF\n"
             "chmod 755 /usr/local/sbin/systemctl")
    yield
    host.ssh(f"rm -f /usr/local/sbin/systemctl {KILL_AT}")


@pytest.mark.parametrize(("point", "verb", "requests"), [
    ("4_after_the_unit_is_written", "daemon-reload", 32),
    ("5_after_systemd_reloaded_it", "restart", 48),
])
def test_4_5_a_changed_unit_before_the_restart(host, work, state, systemctl_instrument,
                                               point, verb, requests):
    """A changed server setting; the connection dies at the first ``systemctl {verb}``."""
    pid = state["pid"]
    changed = inventory(work, f"inv-{requests}", gpuhost_max_running_requests=requests)
    host.ssh(f"echo {verb} > {KILL_AT}")
    run = Deploy(changed, work / f"k{point[0]}.log")
    run.proc.wait(timeout=900)
    run.kill()
    assert not host.ssh(f"ls {KILL_AT} 2>/dev/null || true").strip(), run.output()[-4000:]
    assert f"--max-running-requests {requests}" in host.ssh(
        "cat /etc/systemd/system/sglang.service")
    assert host.main_pid() == pid, "the server was restarted"
    args = host.process_args(pid)  # the running server still has the old value
    assert args[args.index("--max-running-requests") + 1] != str(requests), args
    reload = host.ssh(f"/usr/bin/systemctl show -p NeedDaemonReload --value {UNIT}").strip()
    assert reload == ("yes" if verb == "daemon-reload" else "no")
    recovered = converge(changed)
    assert "runs with other inputs than the files now" in recovered.output
    pid = assert_healthy_and_whole(host)
    args = host.process_args(pid)
    assert args[args.index("--max-running-requests") + 1] == str(requests)
    state["pid"] = pid


def test_6_during_the_health_gate(host, work, state):
    """A slow start; the gate's poll dies with the deploy. The next run verifies the server
    without restarting it, nothing was measured again, and a last run changes nothing."""
    slow = inventory(work, "inv-slow", gpuhost_max_running_requests=48,
                     gpuhost_server_env={"SANDBOX_SGLANG_STARTUP_SECONDS": "20"})
    run = Deploy(slow, work / "k6.log")
    run.wait_for(host, "pgrep -f 'health_check[.]py .*--poll-for' || true", "the health gate")
    run.kill()
    host.ssh("pkill -KILL -f 'health_check[.]py .*--poll-for'; true")
    restarted = host.main_pid()
    assert restarted != state["pid"]
    recovered = converge(slow)
    assert ("not verified as it runs now: sglang.service started since the health gate last "
            "passed") in recovered.output
    assert "Wait until glm-5 answers" in recovered.output
    pid = assert_healthy_and_whole(host)
    assert pid == restarted  # verified, not restarted again
    measured = json.loads(host.ssh("cat /var/lib/gpuhost/p2p.json"))["measured_at"]
    assert measured == state["p2p_measured_at"]
    no_change(slow, pid, host)
