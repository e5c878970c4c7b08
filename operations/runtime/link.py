"""The SSH link to each host: one that stops answering fails its host within a bounded time.

pyinfra's SSH connector bounds only the connect (``CONNECT_TIMEOUT``, paramiko's ``timeout``;
pyinfra 3.10 ``connectors/ssh.py``, ``make_paramiko_kwargs``). A command waits for its output
without a deadline unless given ``_timeout``, and an upload (``_put_file``: paramiko's
``SFTPClient.putfo``) has none at all, so a host whose link drops mid-run holds every other
host at that operation (pyinfra runs each operation on every host before the next) until the
kernel gives up retransmitting: up to about 20 minutes (tcp(7), TCP_USER_TIMEOUT), and never
for a connection with nothing in flight.

So each host's SSH socket gets TCP keepalive and ``TCP_USER_TIMEOUT`` (tcp(7): data, keepalive
probes included, unacknowledged that long closes the connection with ETIMEDOUT). paramiko's
transport then ends, its channels close, and the operation waiting on them fails (a command
with no exit status, an upload with SSHException "Server connection dropped"), which pyinfra
counts as the host's failure. :class:`LinkWatch` says so in gpuhost's words and closes the
connection for good (operations/runtime/remote.py ``close``). A host that only works hard keeps its
link: its kernel acknowledges segments and keepalive probes whatever its load.

One failure pyinfra does not count as the host's: a file transfer whose SFTP session cannot be
opened (the link dropped before the upload began) raises pyinfra's ``ConnectError``
(``connectors/ssh.py``, ``get_file_transfer_connection``), which ``_run_host_op`` does not catch
(it catches ``TimeoutError``, ``OSError`` and ``SSHException``; ``api/operations.py``, pyinfra
3.10): the whole run stopped with "pyinfra error in ...", every other host with it (seen in
e2e test_multinode, once a no-op's first remote call was an upload). :func:`watch` has
``Host.put_file`` and ``Host.get_file`` raise it as ``SSHException``, so it fails that host
only, said as a lost link.

A host that closes its end (sshd stopped, the host shutting down: a FIN, where a dropped link
sends nothing) ends paramiko's transport with ``EOFError``, which it keeps and raises again to
the next command that opens a channel (paramiko 4.0 ``transport.py``: ``run`` saves it,
``open_channel`` and ``Channel._wait_for_event`` raise ``get_exception()``), and an upload
under way raises it too (``sftp.py`` ``_write_all``: the channel took no more bytes). pyinfra
does not catch it (``_run_host_op`` and facts' ``_get_fact`` catch ``TimeoutError``, ``OSError``
and ``SSHException``): the whole run stopped with a traceback. :func:`watch` has
``Host.run_shell_command``, ``put_file`` and ``get_file`` raise it as ``SSHException``, so it
fails that host only, said as a connection the host closed.
"""

from __future__ import annotations

import socket
from typing import Final

from functools import wraps
from typing import Any, Callable

from paramiko import SSHException
from pyinfra import logger
from pyinfra.api.exceptions import ConnectError
from pyinfra.api.host import Host
from pyinfra.api.state import BaseStateCallback

from operations.runtime import remote

#: Seconds a host's link may leave data (or a keepalive probe) unacknowledged before its
#: connection is closed: OpenSSH's usual dead-peer bound (ServerAliveInterval 15 x
#: ServerAliveCountMax 4, ssh_config(5)), long enough for a switch's spanning-tree reconvergence.
LINK_TIMEOUT_S: Final = 60
#: Seconds of silence before the first keepalive probe, and between probes (tcp(7):
#: TCP_KEEPIDLE, TCP_KEEPINTVL): an idle connection to a dead host is noticed within
#: LINK_TIMEOUT_S too.
KEEPALIVE_IDLE_S: Final = 10
KEEPALIVE_INTERVAL_S: Final = 5


def _socket(host) -> socket.socket | None:
    client = getattr(host.connector, "client", None)
    transport = client.get_transport() if client is not None else None
    sock = getattr(transport, "sock", None)
    return sock if isinstance(sock, socket.socket) else None


def bound(host) -> bool:
    """Bound ``host``'s SSH link (a no-op for connectors without one: @local, @docker);
    returns whether a socket was bound."""
    sock = _socket(host)
    if sock is None:
        return False
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT,
                    LINK_TIMEOUT_S // KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, LINK_TIMEOUT_S * 1000)
    return True


#: Set on a host, for this run, when a call to it found its link gone before paramiko's
#: transport showed it: the reason to say (a file transfer that could not open its session, a
#: connection the host closed).
_LOST: Final = "_gpuhost_link_lost"
_UNANSWERED: Final = f"its link left data unanswered for {LINK_TIMEOUT_S} s"
_CLOSED: Final = "the host closed it"


def _transport(host):
    client = getattr(host.connector, "client", None)
    return client, (client.get_transport() if client is not None else None)


def lost(host) -> bool:
    """Whether ``host`` had an SSH link that is gone (paramiko's transport no longer active, or
    a call that found it gone: :func:`fails_its_host`)."""
    if vars(host).get(_LOST):
        return True
    client, transport = _transport(host)
    return client is not None and (transport is None or not transport.is_active())


def _why_lost(host) -> str:
    """What ended ``host``'s link, in words: the host closed it (an EOF, paramiko's transport
    keeps it as ``saved_exception``) or it went silent."""
    _, transport = _transport(host)
    if isinstance(getattr(transport, "saved_exception", None), EOFError):
        return _CLOSED
    return vars(host).get(_LOST) or _UNANSWERED


def fails_its_host(call: Callable) -> Callable:
    """``Host.run_shell_command``/``put_file``/``get_file`` raising pyinfra's ConnectError and
    paramiko's EOFError as SSHException, which pyinfra counts as the host's failure (module
    docstring)."""

    @wraps(call)
    def run(self: Host, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(self, *args, **kwargs)
        except ConnectError as exc:
            vars(self)[_LOST] = _UNANSWERED
            raise SSHException(f"file transfer: {exc}") from exc
        except EOFError as exc:
            vars(self)[_LOST] = _CLOSED
            raise SSHException(f"connection closed by the host{f': {exc}' if str(exc) else ''}"
                               ) from exc

    run._gpuhost_link = True  # type: ignore[attr-defined]
    return run


def _bound_calls() -> None:
    for name in ("run_shell_command", "put_file", "get_file"):
        call = getattr(Host, name)
        if not getattr(call, "_gpuhost_link", False):
            setattr(Host, name, fails_its_host(call))


class LinkWatch(BaseStateCallback):
    """Binds every (re)connected host's link; says when a host failed because its link went."""

    @staticmethod
    def host_connect(state, host):
        vars(host).pop(_LOST, None)  # a new connection: a link found gone before is not this one
        bound(host)

    @staticmethod
    def operation_host_error(state, host, op_hash, retry_num=0, max_retries=0):
        if not lost(host):
            return
        names = ", ".join(state.get_op_meta(op_hash).names) or "an operation"
        host.log_styled(f"connection to {host.name} lost during '{names}': {_why_lost(host)}, "
                        "so the host is out of this run (run again once it answers)", fg="red",
                        log_func=logger.error)
        remote.close(host)


def watch(state, host) -> None:
    """Bound this host's link now and every host's later connections (once per run)."""
    bound(host)
    _bound_calls()
    if not any(isinstance(h, LinkWatch) for h in state.callback_handlers):
        state.add_callback_handler(LinkWatch())
