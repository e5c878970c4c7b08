"""Ending a run whose input is refused before any host is touched: the message once, exit 1.

pyinfra loads the deploy file for every host at once, each in a greenlet of its pool
(``_parallel_load_hosts``, pyinfra_cli/util.py, pyinfra 3.x), and the deploy file checks every
host's data in each. The first greenlet's SystemExit ends the run: pyinfra prints its message
alone and exits 1 (SystemExit is no Exception, so neither the loader nor the CLI wraps it). The
greenlets still pending then run at the interpreter's shutdown (gevent's patched
``threading._shutdown``), and a second SystemExit there is printed with its traceback (seen
with three sandbox hosts). So after the first, a refusal in another of pyinfra's greenlets
ends that greenlet quietly (GreenletExit: gevent's "not an error", ``Hub.NOT_ERROR``).
"""

from __future__ import annotations

from typing import NoReturn

from gevent import GreenletExit, getcurrent
from gevent.greenlet import Greenlet

_ended = False


def end_run(message: str) -> NoReturn:
    """Raise SystemExit(message); GreenletExit instead in a greenlet of a run already ended."""
    global _ended
    if _ended and isinstance(getcurrent(), Greenlet):
        raise GreenletExit
    _ended = True
    raise SystemExit(message)


def end_answered() -> NoReturn:
    """End a run that only reads (status.py) once its answer is printed: exit 0, before pyinfra
    asks "Press enter to execute" for operations there are none of (pyinfra_cli/cli.py, 3.x:
    a deploy file's run without ``-y`` always confirms; on no terminal, ``input()`` ends in an
    EOFError traceback). The other hosts' greenlets end as :func:`end_run` ends them."""
    global _ended
    if _ended and isinstance(getcurrent(), Greenlet):
        raise GreenletExit
    _ended = True
    raise SystemExit(0)
