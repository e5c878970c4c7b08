"""operations/runtime/run_exit.py: a refused run ends with its message once, whatever the number of
hosts pyinfra loads the deploy file for (one greenlet each)."""

import gevent
import pytest
from gevent import GreenletExit

from operations.runtime import run_exit


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(run_exit, "_ended", False)


def test_first_refusal_is_systemexit_the_other_hosts_greenlets_end_quietly():
    first, second, third = (gevent.spawn(run_exit.end_run, "gpuhost: refused") for _ in range(3))
    # gevent raises a greenlet's SystemExit in the main greenlet (Hub.handle_system_error)
    with pytest.raises(SystemExit, match="gpuhost: refused"):
        gevent.joinall([first, second, third])
    gevent.joinall([second, third])
    assert isinstance(first.exception, SystemExit)
    # a GreenletExit is gevent's "not an error": nothing printed at the interpreter's shutdown
    assert isinstance(second.value, GreenletExit) and isinstance(third.value, GreenletExit)


def test_outside_pyinfras_greenlets_every_refusal_is_systemexit():
    for _ in range(2):
        with pytest.raises(SystemExit, match="gpuhost: refused"):
            run_exit.end_run("gpuhost: refused")
