"""Detached processes and the lab's cgroup, so that `down` can stop exactly what `up` started.

A process is named by its PID and its start time (field 22 of /proc/PID/stat), so a reused PID
is never signalled. Every process the lab starts runs in a cgroup below `gpuhost-sandbox/` in
each mounted cgroup hierarchy that tracks processes (cgroup2, v1 name=systemd); whatever a host
spawns stays in there, and `down` empties that tree.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sandbox.layout import LAB

CGROUP_NAME = "gpuhost-sandbox" + (f"-lab{LAB}" if LAB else "")


@dataclass(frozen=True)
class Proc:
    """A process as the lab recorded it."""

    pid: int
    start: int

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "start": self.start}

    @classmethod
    def from_json(cls, data: dict[str, int] | None) -> Proc | None:
        return cls(int(data["pid"]), int(data["start"])) if data else None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a live PID, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def identify(pid: int) -> Proc | None:
    """The recordable identity of a running PID."""
    st = _stat(pid)
    return Proc(pid, st[1]) if st else None


def alive(proc: Proc | None) -> bool:
    """True while the recorded process runs (a zombie, or a new process on its PID, is not it)."""
    if proc is None:
        return False
    st = _stat(proc.pid)
    return st is not None and st[0] not in ("Z", "X") and st[1] == proc.start


def send(proc: Proc | None, sig: int) -> bool:
    """Signal the recorded process if it is still that process; True when sent."""
    if not alive(proc):
        return False
    assert proc is not None
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


def wait_gone(procs: Iterable[Proc | None], timeout: float) -> list[Proc]:
    """Wait until none of `procs` runs; returns those still running at the deadline."""
    left = [p for p in procs if p is not None]
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in left if alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def stop(procs: Iterable[Proc | None], timeout: float) -> None:
    """SIGTERM, then SIGKILL what is left after `timeout` seconds."""
    procs = [p for p in procs if p is not None]
    for p in procs:
        send(p, signal.SIGTERM)
    for p in wait_gone(procs, timeout):
        send(p, signal.SIGKILL)
    wait_gone(procs, 5)


def cgroup_roots() -> list[Path]:
    """Mounted hierarchies that track processes: cgroup2 and the v1 name=systemd one."""
    roots = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fstype, _source, options = (post.split() + ["", ""])[:3]
            mountpoint = pre.split()[4]
            if fstype == "cgroup2" or (fstype == "cgroup" and "name=systemd" in options.split(",")):
                roots.append(Path(mountpoint))
    return roots


def cgroup_dirs(leaf: str | None = None) -> list[Path]:
    """The lab's cgroup (or its `leaf` child) in every tracking hierarchy."""
    base = [root / CGROUP_NAME for root in cgroup_roots()]
    return [b / leaf for b in base] if leaf else base


def spawn_detached(
    argv: list[str],
    log: Path,
    cgroup: str,
    env: dict[str, str] | None = None,
) -> Proc:
    """Start `argv` in its own session, out of this process's tree (double fork), with stdin
    from /dev/null and stdout/stderr appended to `log`, in the lab cgroup `cgroup`.

    Raises OSError when the program cannot be started.
    """
    groups = cgroup_dirs(cgroup)
    for g in groups:
        g.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if env is None else env)
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(report_r)
            os.setsid()
            grandchild = os.fork()
            if grandchild == 0:
                out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(out, 1)
                os.dup2(out, 2)
                try:
                    for g in groups:
                        with open(g / "cgroup.procs", "w") as f:
                            f.write(str(os.getpid()))
                    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
                    os.execvpe(argv[0], argv, env)
                except BaseException as exc:
                    os.write(2, f"sandbox: cannot start {argv[0]}: {exc}\n".encode())
                    os._exit(127)
            os.write(report_w, str(grandchild).encode())
        except BaseException:
            os._exit(127)
        os._exit(0)
    os.close(report_w)
    with os.fdopen(report_r, "rb") as r:
        data = r.read()
    os.waitpid(pid, 0)
    if not data:
        raise OSError(f"could not start {argv[0]}")
    child = int(data)
    proc = identify(child)
    if proc is None:
        raise OSError(f"{argv[0]} exited at once; see {log}")
    return proc


def cgroup_pids(leaf: str | None = None) -> set[int]:
    """PIDs anywhere in the lab's cgroup tree (or below `leaf`)."""
    pids: set[int] = set()
    for top in cgroup_dirs(leaf):
        if not top.is_dir():
            continue
        for dirpath, _dirs, _files in os.walk(top):
            try:
                text = (Path(dirpath) / "cgroup.procs").read_text()
            except OSError:
                continue
            pids.update(int(x) for x in text.split())
    return pids


def empty_cgroup(leaf: str | None = None, timeout: float = 10) -> set[int]:
    """SIGKILL everything in the lab's cgroup tree (or below `leaf`) and remove the cgroups;
    returns the PIDs that would not die."""
    deadline = time.monotonic() + timeout
    while True:
        pids = cgroup_pids(leaf)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not pids or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for top in cgroup_dirs(leaf):
        if not top.is_dir():
            continue
        for dirpath, _dirs, _files in os.walk(top, topdown=False):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
    return cgroup_pids(leaf)
