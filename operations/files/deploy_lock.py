"""Hold the host's deploy lock for as long as the run that took it is connected.

Run by the deploy on the host (as root, through sudo where the login is not root), on an SSH
channel of its own that stays open for the whole run:

    python3 deploy_lock.py --mode exclusive --wait 0 --holder '{"controller": "...", ...}'

An flock(2) on /run/gpuhost/deploy.lock (tmpfs: a reboot releases it): ``exclusive`` for a
deploy, ``shared`` for a dry run (dry runs read together; a deploy waits for them and they for
it). Who holds it is kept beside it, one JSON file per holder in /run/gpuhost/deploy-lock.d/.

Protocol on stdout, one line each: ``waiting <holders JSON>`` (once, when another run holds it
and --wait allows waiting), ``evicted <holders JSON>`` (once, see below), then ``held`` or
``busy <holders JSON>`` (exit 75, EX_TEMPFAIL of sysexits.h), or ``error <why>`` (exit 73,
EX_CANTCREAT) where the lock or a holder's record cannot be made (/run/gpuhost not a writable
folder), or where the lock path is not a plain file: the lock is opened without following a
symbolic link (open(2) O_NOFOLLOW; a link there, ``deploy.lock -> /etc/x``, would otherwise make
root create or lock its target), and a folder, FIFO, socket or device there is refused before it
is opened (lstat(2)), and again after (fstat(2) of what was opened), as is a run folder or record
folder that is not a folder of its own (a symbolic link to one). A holder is a record whose process holds an flock on the lock, as /proc/locks says
(proc(5)): a record a holder killed with SIGKILL left, whose pid another process has since,
counts for nothing. A lock held by no recorded holder (an operator's ``flock`` on it) is said
as the processes holding it: ``[{"pid": ..., "process": "<its command line>"}]``.

``--evict <holders JSON>`` names holders whose run the controller knows is gone (its own
pyinfra process ended: a link that dropped mid-run leaves the old holder waiting for a word that
never comes, up to SILENCE_S). Where every holder of the lock is one of those (the same value
for each key a gone run names: controller, pyinfra pid, the controller's pid space and the
run's start), they are sent SIGTERM and the lock is taken once they are gone; a holder not
named keeps the lock. While held, it reads the controller's heartbeats (any bytes) on stdin
and writes one byte every HEARTBEAT_S seconds; it lets go when stdin ends (the run ended or its
connection closed), when nothing came for SILENCE_S seconds (the link dropped without a word),
or when its own write fails (the connection is gone: once the link is back, the controller's
kernel answers the write with a reset).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import select
import signal
import stat
import sys
import time

RUN_DIR = "/run/gpuhost"
HEARTBEAT_S = 15
SILENCE_S = 300
EX_TEMPFAIL = 75
EX_CANTCREAT = 73
#: Seconds evicted holders get to exit (an flock is let go when its process ends).
EVICT_WAIT_S = 10
#: Seconds a holder that took the lock has to write its record before it is said to be nobody.
RECORD_WAIT_S = 2


def lock_pids(lock_fd: int) -> set[int] | None:
    """The pids holding an flock on ``lock_fd``'s file, from /proc/locks (proc(5): pids as seen
    in the reader's pid namespace, 0 for one outside it; "->" lines are waiters); None where
    /proc/locks cannot be read."""
    st = os.fstat(lock_fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    pids = set()
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device:
            pids.add(int(fields[4]))
    return pids


def _pid(entry: object) -> int | None:
    pid = entry.get("pid") if isinstance(entry, dict) else None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def holders(folder: str, lock_fd: int | None = None, sweep: bool = False) -> list[dict]:
    """The holders recorded in ``folder`` whose process still lives and, where /proc/locks
    tells, holds the lock on ``lock_fd``: a record left by a holder killed with SIGKILL whose
    pid now names another process, or one that is corrupt or names no process of its own (pid 0
    signals the whole group), is no holder. ``sweep``: remove those records."""
    locking = lock_pids(lock_fd) if lock_fd is not None else None
    found = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith(".json"):
            continue
        path = os.path.join(folder, name)
        try:
            with open(path) as fh:
                entry = json.load(fh)
            pid = _pid(entry)
            if pid is None or (locking is not None and pid not in locking):
                raise ProcessLookupError
            os.kill(pid, 0)
        except ProcessLookupError:
            if sweep or _pid(entry) is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)  # a holder killed with its channel (SIGPIPE) left it
            continue
        except (OSError, ValueError):
            if sweep:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            continue
        found.append(entry)
    return found


class NotPlain(OSError):
    """A lock path (or its folder) that is not what it must be: said as is, in one line."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISREG, "a plain file"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a plain file"


def _refusal(path: str, mode: int, wanted: str) -> NotPlain:
    kind = _kind(mode)
    if stat.S_ISLNK(mode):
        try:
            kind += f" (to {os.readlink(path)})"
        except OSError:
            pass
    return NotPlain(f"{path} is {kind}, not {wanted}: the deploy lock does not follow or use it "
                    f"(remove it: sudo rm {'-r ' if stat.S_ISDIR(mode) else ''}{path}; "
                    "gpuhost makes it again)")


def own_folder(path: str) -> None:
    """Make ``path`` (mode 0755) unless it is there; raise NotPlain where it is there as anything
    but a folder (a symbolic link to one included: lstat(2))."""
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    mode = os.lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise _refusal(path, mode, "a folder")


def open_lock(path: str) -> int:
    """The lock file's descriptor, opened read-write (created 0644 where absent) without
    following a link (O_NOFOLLOW: ELOOP on a symbolic link) and without blocking (O_NONBLOCK: a
    FIFO put there). Raises NotPlain where ``path`` is not a plain file, checked on the path
    before opening (a device is never opened) and on what was opened."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG
    if not stat.S_ISREG(mode):
        raise _refusal(path, mode, "a plain file")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o644)
    except OSError as error:  # replaced since the lstat: ELOOP for a link, EISDIR, ENXIO
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            raise error from None
        raise _refusal(path, mode, "a plain file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refusal(path, mode, "a plain file")
    return fd


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _named(entry: dict, gone: list[dict]) -> bool:
    """``entry`` is one of ``gone``: the same value for every key a gone run names (its
    controller, pyinfra pid and, from a Linux controller, boot, pid namespace and start)."""
    return any(isinstance(g, dict) and g.get("controller") and g.get("controller_pid")
               and all(entry.get(k) == v for k, v in g.items()) for g in gone)


def evict(folder: str, fd: int, gone: list[dict]) -> list[dict]:
    """SIGTERM the holders in ``folder`` when every one of them is named in ``gone``; returns
    those sent it (none when a holder not named holds the lock too)."""
    current = holders(folder, fd)
    if not current or not all(_named(h, gone) for h in current):
        return []
    for entry in current:
        with contextlib.suppress(ProcessLookupError):
            os.kill(entry["pid"], signal.SIGTERM)
    return current


def _holding(folder: str, fd: int) -> list[dict]:
    """Who holds the busy lock: a holder writes its record just after it took the lock, so
    none yet (a takeover won a moment ago) is looked for again, for up to RECORD_WAIT_S."""
    deadline = time.monotonic() + RECORD_WAIT_S
    while not (current := holders(folder, fd)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return current or _processes(fd)


def _processes(fd: int) -> list[dict]:
    """The processes holding the lock without a record (not a gpuhost run: an operator's
    ``flock /run/gpuhost/deploy.lock ...``), by pid and command line (/proc/PID/cmdline)."""
    found = []
    for pid in sorted(lock_pids(fd) or ()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                command = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            command = "?"
        if pid > 0:
            found.append({"pid": pid, "process": command[:200]})
    return found


def take(fd: int, mode: str, wait: float, folder: str, gone: list[dict] | None = None) -> bool:
    flag = fcntl.LOCK_EX if mode == "exclusive" else fcntl.LOCK_SH
    deadline = time.monotonic() + wait
    told = evicting = False
    while True:
        try:
            fcntl.flock(fd, flag | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if gone:
            evicted = evict(folder, fd, gone)
            gone = None  # once: a holder that came since is a run of its own
            if evicted:
                say("evicted " + json.dumps(evicted))
                deadline = max(deadline, time.monotonic() + EVICT_WAIT_S)
                evicting = True
        if time.monotonic() >= deadline:
            say("busy " + json.dumps(_holding(folder, fd)))
            return False
        if not told and not evicting:
            say("waiting " + json.dumps(_holding(folder, fd)))
            told = True
        time.sleep(0.2 if evicting else 1)


def hold(silence: float) -> None:
    last = time.monotonic()
    beat = last
    while True:
        ready, _, _ = select.select([0], [], [], min(HEARTBEAT_S, silence))
        now = time.monotonic()
        if ready:
            if not os.read(0, 4096):
                return  # the run ended, or sshd closed the channel
            last = now
        elif now - last > silence:
            return
        if now - beat >= HEARTBEAT_S:
            os.write(1, b".")
            beat = now


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("exclusive", "shared"), required=True)
    parser.add_argument("--wait", type=float, default=0.0)
    parser.add_argument("--holder", default="{}", help="JSON: who takes the lock")
    parser.add_argument("--run-dir", default=RUN_DIR, help="where the lock lives")
    parser.add_argument("--silence", type=float, default=SILENCE_S,
                        help="seconds without a heartbeat before letting go")
    parser.add_argument("--evict", default="[]",
                        help="JSON: holders whose run is gone, to let go of the lock")
    args = parser.parse_args()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a write to a closed channel ends us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # evicted: our record goes too
    folder = os.path.join(args.run_dir, "deploy-lock.d")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.run_dir)), mode=0o755, exist_ok=True)
        own_folder(args.run_dir)
        own_folder(folder)
        fd = open_lock(os.path.join(args.run_dir, "deploy.lock"))
    except OSError as error:
        say(f"error {error}")
        return EX_CANTCREAT
    if not take(fd, args.mode, args.wait, folder, json.loads(args.evict)):
        return EX_TEMPFAIL
    holders(folder, fd, sweep=True)  # records of holders that died with their channel
    entry = {**json.loads(args.holder), "mode": args.mode, "pid": os.getpid(),
             "login": os.environ.get("SUDO_USER") or os.environ.get("USER") or str(os.getuid()),
             "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    mine = os.path.join(folder, f"{os.getpid()}.json")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{mine}.tmp")
        # whole or absent: a reader never sees half; a link put there is not followed
        fh = os.fdopen(os.open(f"{mine}.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL
                               | os.O_NOFOLLOW, 0o644), "w")
        with fh:
            json.dump(entry, fh)
        os.replace(f"{mine}.tmp", mine)
    except OSError as error:
        say(f"error {error}")
        return EX_CANTCREAT
    try:
        say("held")
        hold(args.silence)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(mine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
