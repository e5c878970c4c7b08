"""Upgrades that cannot leave a host down, end to end on one sandbox host: the server runs from
its lock's own venv under /opt/gpuhost/venvs, a new lock is built beside the running server,
which serves until the one restart, and a venv of an earlier gpuhost at gpuhost_venv_path is
taken over (removed, replaced by the link) without a flash-attn build.
Checked with ssh on the host (the link, the server's command line, its main PID), not through
pyinfra."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from operations.venvs import VENVS_DIR, stack_venv
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


def test_a_new_lock_is_built_beside_the_serving_venv(host, sandbox_lock, new_lock):
    old, pid, lock = stack_venv(sandbox_lock), host.main_pid(), new_lock
    new = stack_venv(lock)
    assert new != old
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
        run = lab.deploy("--data", f"gpuhost_lock={lock}")
    finally:
        done.set()
        watcher.join()
    assert run.returncode == 0, run.output[-6000:]
    # the old server served while the new venv had its stack in it, before the one restart
    assert (pid, True) in seen, seen
    assert host.main_pid() != pid
    assert served_venv(host) == new
    assert host.ssh(f"readlink {LINK}").strip() == new
    assert host.ssh(f"test -x {old}/bin/python && echo kept").strip() == "kept"
    again = lab.deploy("--data", f"gpuhost_lock={lock}")
    assert again.returncode == 0, again.output[-6000:]
    assert host.ssh(f"readlink {LINK}").strip() == new


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

