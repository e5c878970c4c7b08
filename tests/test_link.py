"""The SSH link to each host (operations/runtime/link.py): bounded by TCP keepalive and
TCP_USER_TIMEOUT; a host that failed because its link went is said so, once, and its connection
closed."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from operations.runtime import link


class Transport:
    def __init__(self, sock, active=True):
        self.sock = sock
        self.active = active

    def is_active(self):
        return self.active


class Client:
    def __init__(self, transport):
        self.transport = transport
        self.closed = False

    def get_transport(self):
        return self.transport

    def close(self):
        self.closed = True


class FakeHost:
    name = "gpu2"

    def __init__(self, client):
        self.connector = SimpleNamespace(client=client, disconnect=lambda: None)
        self.connected = True
        self.said: list[str] = []

    def log_styled(self, message, fg=None, log_func=None):
        self.said.append(message)


@pytest.fixture
def tcp():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    yield client
    client.close()
    server.close()


def test_a_hosts_ssh_socket_gets_keepalive_and_a_user_timeout(tcp):
    assert link.bound(FakeHost(Client(Transport(tcp))))
    assert tcp.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 60_000
    assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
    assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 5
    # the probes alone would outlast the bound: TCP_USER_TIMEOUT decides (tcp(7))
    assert 10 + 5 * tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) >= 60


def test_a_connector_without_an_ssh_socket_is_left_alone():
    assert not link.bound(SimpleNamespace(connector=SimpleNamespace()))
    assert not link.bound(FakeHost(None))


def _state(*handlers, name="Unit sglang.service"):
    return SimpleNamespace(callback_handlers=list(handlers),
                           add_callback_handler=lambda h: None,
                           get_op_meta=lambda op_hash: SimpleNamespace(names={name}))


def test_a_host_whose_link_went_is_said_lost_and_closed(tcp):
    client = Client(Transport(tcp, active=False))
    host = FakeHost(client)
    link.LinkWatch.operation_host_error(_state(), host, "op")
    assert host.said == ["connection to gpu2 lost during 'Unit sglang.service': its link left "
                         "data unanswered for 60 s, so the host is out of this run (run again "
                         "once it answers)"]
    assert client.closed and host.connected is False


def test_an_operation_name_with_an_apostrophe_is_quoted_the_same_way(tcp):
    # seen in e2e: repr() quoted "apt waits for dpkg's lock" with double quotes
    host = FakeHost(Client(Transport(tcp, active=False)))
    link.LinkWatch.operation_host_error(_state(name="apt waits for dpkg's lock"), host, "op")
    assert host.said[0].startswith("connection to gpu2 lost during 'apt waits for dpkg's "
                                   "lock': ")


def test_a_failure_on_a_live_link_is_not_called_a_lost_link(tcp):
    host = FakeHost(Client(Transport(tcp)))
    link.LinkWatch.operation_host_error(_state(), host, "op")
    assert host.said == [] and host.connected


def test_the_watch_is_installed_once_per_run(tcp):
    added = []
    state = SimpleNamespace(callback_handlers=[], add_callback_handler=added.append)
    link.watch(state, FakeHost(Client(Transport(tcp))))
    state.callback_handlers = added
    link.watch(state, FakeHost(Client(Transport(tcp))))
    assert len(added) == 1 and isinstance(added[0], link.LinkWatch)


def test_a_transfer_that_cannot_open_its_session_fails_its_host_as_a_lost_link(tcp):
    from paramiko import SSHException
    from pyinfra.api.exceptions import ConnectError

    def put_file(self, *args, **kwargs):
        raise ConnectError("Unable to establish SFTP connection. Check that the SFTP "
                           "subsystem for the SSH service at gpu2 is enabled.")

    host = FakeHost(Client(Transport(tcp)))  # pyinfra's connector still holds a live client
    with pytest.raises(SSHException, match="file transfer: Unable to establish SFTP"):
        link.fails_its_host(put_file)(host, "local", "remote")
    link.LinkWatch.operation_host_error(_state(name="Ship health_check.py"), host, "op")
    assert host.said[0].startswith("connection to gpu2 lost during 'Ship health_check.py': ")


def test_pyinfras_transfers_are_wrapped_once(monkeypatch):
    from pyinfra.api.host import Host

    monkeypatch.setattr(Host, "run_shell_command", lambda self, *a, **k: (True, None))
    monkeypatch.setattr(Host, "put_file", lambda self, *a, **k: True)
    monkeypatch.setattr(Host, "get_file", lambda self, *a, **k: True)
    link._bound_calls()
    wrapped = Host.put_file
    link._bound_calls()
    assert Host.put_file is wrapped and wrapped._gpuhost_link and Host.get_file._gpuhost_link
    assert Host.run_shell_command._gpuhost_link


def test_a_connection_the_host_closed_fails_its_host_as_a_lost_link(tcp):
    """paramiko's transport keeps the EOFError that ended it and raises it again to the next
    command that opens a channel (transport.py, open_channel), which pyinfra does not catch."""
    from paramiko import SSHException

    def run_shell_command(self, *args, **kwargs):
        raise EOFError()

    host = FakeHost(Client(Transport(tcp)))
    with pytest.raises(SSHException, match="^connection closed by the host$"):
        link.fails_its_host(run_shell_command)(host, "true")
    link.LinkWatch.operation_host_error(_state(), host, "op")
    assert host.said == ["connection to gpu2 lost during 'Unit sglang.service': the host "
                         "closed it, so the host is out of this run (run again once it "
                         "answers)"]


def test_a_transport_ended_by_an_eof_says_the_host_closed_it(tcp):
    transport = Transport(tcp, active=False)
    transport.saved_exception = EOFError()
    host = FakeHost(Client(transport))
    link.LinkWatch.operation_host_error(_state(), host, "op")
    assert host.said[0].endswith("lost during 'Unit sglang.service': the host closed it, so "
                                 "the host is out of this run (run again once it answers)")


def test_a_reconnected_host_is_not_lost_for_an_earlier_eof(tcp):
    def run_shell_command(self, *args, **kwargs):
        raise EOFError()

    host = FakeHost(Client(Transport(tcp)))
    with pytest.raises(Exception):
        link.fails_its_host(run_shell_command)(host, "cat /proc/sys/kernel/random/boot_id")
    link.LinkWatch.host_connect(None, host)  # e.g. back after a reboot
    assert not link.lost(host)


def test_pyinfra_fails_only_the_host_whose_connection_closed(monkeypatch):
    """pyinfra's own run of an operation (api/operations.py, run_host_op): an EOFError from
    paramiko went uncaught, out of the run with a traceback; now the host fails, said once."""
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.host import Host
    from pyinfra.api.operation import add_op
    from pyinfra.api.operations import run_host_op
    from pyinfra.api.state import StateStage
    from pyinfra.context import ctx_host, ctx_state
    from pyinfra.operations import server

    for name in ("run_shell_command", "put_file", "get_file"):
        monkeypatch.setattr(Host, name, getattr(Host, name))
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    state.current_stage = StateStage.Prepare
    target = inventory.get_host("@local")
    said: list[str] = []
    monkeypatch.setattr(target, "log_styled", lambda message, **kw: said.append(message))
    with ctx_state.use(state), ctx_host.use(target):
        target.connect()
        link.watch(state, target)
        add_op(state, server.shell, name="Check the unit", commands=["true"], host=target)

        def closed(*args, **kwargs):
            raise EOFError()

        monkeypatch.setattr(target.connector, "run_shell_command", closed)
        state.current_stage = StateStage.Execute
        assert run_host_op(state, target, state.get_op_order()[0]) is False
    assert said == ["connection to @local lost during 'Check the unit': the host closed it, "
                    "so the host is out of this run (run again once it answers)"]
