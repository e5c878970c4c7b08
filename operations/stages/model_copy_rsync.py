"""rsync run from the controller for a model copy: its progress every PROGRESS_EVERY seconds
through pyinfra's logger, the cause its stderr gives where it fails, and its end with the run."""

from __future__ import annotations

import ctypes
import re
import signal
import subprocess
import sys
import time
from typing import Final

from pyinfra import logger

#: Seconds between progress lines, as the Hub download and the health gate print them.
PROGRESS_EVERY: Final = 10
#: One ``--info=progress2`` update (rsync(1), --info=progress2): bytes so far, percent, rate.
_PROGRESS = re.compile(r"^\s*([\d,]+)\s+(\d+)%\s+(\S+/s)")


def parent_death_signal():
    """A ``preexec_fn`` giving the child SIGTERM when this process ends, a ``kill -9``
    included (prctl(2), PR_SET_PDEATHSIG; Linux): a copy does not outlive its run. None
    elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the child
    pr_set_pdeathsig = 1  # linux/prctl.h
    return lambda: prctl(pr_set_pdeathsig, int(signal.SIGTERM))


def rsync(argv: list[str], prefix: str, what: str) -> tuple[bool, str]:
    """Run rsync, printing ``what``'s bytes, share and rate every PROGRESS_EVERY seconds from
    its --info=progress2 updates; (whether it exited 0, its stderr's last line)."""
    code, err = run_rsync(argv, prefix, what)
    return code == 0, err


def run_rsync(argv: list[str], prefix: str, what: str, send: bytes | None = None
              ) -> tuple[int, str]:
    """:func:`rsync`, returning its exit status; ``send``: what it reads on stdin (the copy key
    sent to the host, model_copy_direct.py), which then stays open until it ends: the host's
    side stops when it closes (this process gone)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if send else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=parent_death_signal())
    try:
        if send:
            assert proc.stdin is not None
            proc.stdin.write(send)
            proc.stdin.flush()
        return _follow(proc, prefix, what)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        if proc.poll() is None:
            proc.terminate()
            proc.wait()


def _follow(proc: subprocess.Popen, prefix: str, what: str) -> tuple[int, str]:
    assert proc.stdout is not None and proc.stderr is not None
    began = last = time.monotonic()
    latest = ""
    buffer = b""
    while True:
        chunk = proc.stdout.read1(65536)  # type: ignore[attr-defined]
        if not chunk:
            break
        buffer += chunk
        *parts, buffer = re.split(rb"[\r\n]", buffer)
        for part in parts:
            match = _PROGRESS.match(part.decode(errors="replace"))
            if match:
                latest = f"{match[1]} bytes ({match[2]}%) at {match[3]}"
        if latest and time.monotonic() - last >= PROGRESS_EVERY:
            last = time.monotonic()
            logger.info(f"{prefix}{what}: {latest}, {last - began:.0f} s")
    err = proc.stderr.read().decode(errors="replace").strip().splitlines()
    # rsync's last line is its generic exit ("rsync error: ... (code 255)"); the cause (ssh's
    # refusal of the key, a file not there) is the first line before it that is not rsync's
    # own "connection unexpectedly closed"
    cause = next((line for line in err[:-1] if not line.startswith(
        ("rsync error:", "rsync: connection unexpectedly closed"))), None)
    return proc.wait(), (f"{cause} ({err[-1]})" if cause else err[-1] if err else "")
