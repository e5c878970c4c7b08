"""``python -m sandbox link NAME up`` (sandbox/network.py set_link) returns once the host's SSH
port answers again, as a test's next ssh expects; its switch port alone is only set."""

from __future__ import annotations

import pytest

from sandbox import network
from sandbox.layout import HostSpec


@pytest.fixture
def calls(monkeypatch):
    seen: list = []
    monkeypatch.setattr(network, "_ip", lambda *args, **kw: seen.append(("ip", *args)))
    answers = iter([OSError("No route to host"), OSError("No route to host"), None])

    class Socket:
        def close(self):
            seen.append(("answered",))

    def connect(address, timeout):
        seen.append(("connect", address))
        failure = next(answers)
        if failure:
            raise failure
        return Socket()

    monkeypatch.setattr(network.socket, "create_connection", connect)
    monkeypatch.setattr(network.time, "sleep", lambda s: None)
    return seen


def test_link_up_waits_until_the_host_answers(calls):
    spec = HostSpec(1)
    network.set_link(spec, True)
    assert [c for c in calls if c[0] == "connect"] == [("connect", (spec.address, 22))] * 3
    assert calls[-1] == ("answered",)


def test_the_switch_port_alone_is_only_set(calls):
    network.set_link(HostSpec(1), True, switch_only=True)
    assert [c[0] for c in calls] == ["ip"]
