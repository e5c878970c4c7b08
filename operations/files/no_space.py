"""A full disk named as such: "no space left on the device (ENOSPC)", the path being written, its
file system and what is free there (as df counts it), in one line instead of a traceback.

Used two ways, always on the host, with the host's python3 (standard library only):

- as a wrapper (operations/stages/venv_install.py: the venv's creation, pip's install and
uninstall)::

      python3 /opt/gpuhost/lib/no_space.py --what "pip install into /opt/gpuhost/venv" \\
          --path /opt/gpuhost/venv -- /opt/gpuhost/venv/bin/python -m pip install ...

  runs the command with its output captured. When it fails and its output says ENOSPC
  (``[Errno 28]``, "No space left on device"), that output is replaced by one line on stderr,
  ``pip install into /opt/gpuhost/venv: no space left on the device (ENOSPC) writing
  /opt/gpuhost/venv/lib/...: /opt is tmpfs mounted on /opt, 0 B free of 4.0 MiB (df)``, and
  the exit status is 28; otherwise its output and exit status are passed on as they are;
- imported by model_fetch.py (shipped beside it): :func:`enospc` finds a full disk in an
  exception, :func:`where` says where the path is and what is free there.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import select
import shutil
import signal
import subprocess
import sys

#: What a program prints for a full disk (LC_ALL=C): Python's OSError ("[Errno 28]": ENOSPC is 28
#: in Linux's asm-generic/errno-base.h), glibc's strerror(3) text, the name itself.
_SIGNS = re.compile(r"\[Errno 28\]|No space left on device|\bENOSPC\b")
#: The file Python's OSError names, where it names one.
_NAMED = re.compile(r"No space left on device: '([^']+)'")


def human(size: float) -> str:
    """Bytes as df -h would round them, in binary units: ``0 B``, ``3.9 MiB``, ``12.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def _mount_point(path: str) -> str:
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def _device(mount: str) -> str:
    """The device /proc/self/mounts gives ``mount`` (the last mount there wins), or "?"."""
    found = "?"
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) > 1 and fields[1].replace("\\040", " ") == mount:
                    found = fields[0]
    except OSError:
        pass
    return found


def where(path: str) -> str:
    """Where ``path`` (or its nearest existing parent) is and what is free there:
    ``/opt/gpuhost is on /dev/vda1 mounted on /, 1.2 GiB free of 20.0 GiB (df)``."""
    existing = _existing(path)
    mount = _mount_point(existing)
    try:
        usage = shutil.disk_usage(existing)
        free = f"{human(usage.free)} free of {human(usage.total)}"
    except OSError as exc:
        free = f"free space unknown ({exc.strerror})"
    return f"{existing} is on {_device(mount)} mounted on {mount}, {free} (df)"


def enospc(exc: BaseException | None) -> OSError | None:
    """The ENOSPC OSError in ``exc`` or in what caused it (``__cause__``, ``__context__``: a
    download's worker thread, a library that wraps it), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def full_disk_line(what: str, path: str, output: str) -> str | None:
    """One line for a command's failure when ``output`` says ENOSPC, else None.

    + what: what was being done ("pip install into /opt/gpuhost/venv")
    + path: where it writes; the file the output names, if it names one, is said instead
    """
    if not _SIGNS.search(output):
        if not is_full(path):
            return None
        return (f"{what}: no space left on the device (ENOSPC: its file system is full) "
                f"writing {path}: {where(path)}")
    named = _NAMED.findall(output)
    written = named[-1] if named else path
    return (f"{what}: no space left on the device (ENOSPC) writing {written}: "
            f"{where(written)}")


def is_full(path: str) -> bool:
    """Whether the file system of ``path`` has less than 1 MiB left for this process (root
    may use the blocks ext4 keeps for it): a program that hides its error's text (venv's
    ensurepip, a build) failed for lack of space there."""
    try:
        st = os.statvfs(_existing(path))
    except OSError:
        return False
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return blocks * st.f_frsize < 2**20


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", required=True, help="what the command does, for the message")
    parser.add_argument("--path", required=True, help="where the command writes")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    # what it makes is readable by the model copy user and operators whatever root's umask
    # (a hardened host's 077, from pam_umask and the profile): files 0644, folders 0755
    os.umask(0o022)
    try:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL)
    except OSError as exc:
        line = full_disk_line(args.what, args.path, str(exc))
        print(line or f"{args.what}: {command[0]}: {exc.strerror}", file=sys.stderr)
        return errno.ENOSPC if line else 127
    out, err = _wait(child)
    if child.returncode != 0:
        line = full_disk_line(args.what, args.path, (out + err).decode("utf-8", "replace"))
        if line:
            print(line, file=sys.stderr)
            return errno.ENOSPC
    sys.stdout.buffer.write(out)
    sys.stderr.buffer.write(err)
    return child.returncode


def _wait(child: subprocess.Popen) -> tuple[bytes, bytes]:
    """The child's output once it exits. The child goes with this process: killed when this
    process is told to stop (SIGTERM, SIGHUP, SIGINT) or when no one reads its stdout any more
    (the SSH channel closed: poll(2) sets POLLERR on a pipe's writing end once its reading end
    is closed), as it would have died of SIGPIPE writing there itself."""

    def stop(signum, _frame):
        child.kill()
        sys.exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, stop)
    watch = select.poll()
    watch.register(sys.stdout.fileno(), select.POLLERR | select.POLLHUP)
    while True:
        try:
            return child.communicate(timeout=1)
        except subprocess.TimeoutExpired:
            if watch.poll(0):
                child.kill()
                child.wait()
                sys.exit(141)  # as SIGPIPE would


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
