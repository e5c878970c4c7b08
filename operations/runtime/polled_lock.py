"""An exclusive flock(2) on the controller, polled: the lock a pyinfra run takes where its hosts
(gevent greenlets of one thread) or another run on this controller must go one at a time.

A blocking flock would stop every greenlet of the run while one waits, the holder's included;
so LOCK_NB is tried every ``poll_s`` seconds (``time.sleep`` is gevent's under pyinfra's CLI,
which patches it). The kernel lets go of the lock when its holder dies.
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Callable
from typing import IO


def lock_exclusive(fd: int | IO, on_first_wait: Callable[[], None], poll_s: float) -> None:
    """Take an exclusive flock on ``fd``; ``on_first_wait`` is called once if it must wait."""
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not waited:
                on_first_wait()
                waited = True
            time.sleep(poll_s)
