"""Commands an operation's Python callback sends itself: with the arguments pyinfra gives its own
commands (sudo, su, the environment, so ``LC_ALL=C`` too), and a lost connection said in one line
instead of a traceback."""

from __future__ import annotations

import functools
import shlex
from collections.abc import Callable
from typing import Any, Final

import gevent
from paramiko import SSHException
from pyinfra import config, logger
from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS, pop_global_arguments
from pyinfra.api.command import StringCommand
from pyinfra.api.exceptions import OperationError
from pyinfra.context import ctx_config, ctx_state

#: What every command of a run gets in its environment (pyinfra's ``config.ENV``, merged into
#: each command's ``_env``, facts' included): output is parsed in English whatever the host's
#: locale (a German host's apt-cache says "Installationskandidat:"; LC_ALL outranks LANG and
#: LC_*, and GNU gettext ignores LANGUAGE under the C locale: locale(7), gettext manual 2.3.3).
RUN_ENV: Final = {"LC_ALL": "C"}

#: Seconds a callback's command may go without finishing before the connection is checked
#: (a poll of a build or of the server gives less: it answers at once on a live link).
DEFAULT_TIMEOUT_S: Final = 300
#: Seconds a file transfer may take (a wheel of hundreds of MB over a slow link).
TRANSFER_TIMEOUT_S: Final = 1800
#: Seconds a poll (one quick command) may take before the connection is checked.
POLL_TIMEOUT_S: Final = 60
#: Seconds the check (``true``) may take before the connection counts as lost.
PROBE_TIMEOUT_S: Final = 20


def use_run_env() -> None:
    """Give every command of this run :data:`RUN_ENV` (host data's own ``_env`` still adds to it).

    pyinfra loads deploy.py per host under a copy of the run's config (pyinfra_cli/util.py
    ``_parallel_load_hosts``: ``state.config.copy()``, which leaves ``ENV`` out: Config.copy
    copies only ConfigDefaults' keys) and executes the operations under the run's own config:
    both get it, or the commands callbacks send at execution time (``apt-get update`` of
    operations.stages.package_runs.lists_updated among them) run in the host's locale.
    """
    config.ENV = {**config.ENV, **RUN_ENV}
    run = ctx_state.get()
    if run is not None and run.config is not ctx_config.get():
        run.config.ENV = {**run.config.ENV, **RUN_ENV}


class ConnectionLost(OperationError):
    """The SSH connection to the host dropped while a callback was using it."""


def connector_arguments(host) -> dict[str, Any]:
    """The connector arguments pyinfra would give a command of this host now: ``_sudo`` and its
    kin, ``_env`` (with :data:`RUN_ENV`), from ``--sudo`` and the host's data (pyinfra's own
    ``pop_global_arguments``). A callback's ``host.run_shell_command`` gets none of them."""
    arguments, _ = pop_global_arguments(host.state, host, {})
    chosen = {k: v for k, v in arguments.items() if k in CONNECTOR_ARGUMENT_KEYS}
    chosen["_env"] = {**RUN_ENV, **(chosen.get("_env") or {})}
    return chosen


#: What a dropped connection raises: paramiko's and the socket's errors, and the gevent.Timeout
#: of :func:`shell` (a BaseException: no ``except Exception`` on the way, paramiko's included,
#: swallows it, as it can a TimeoutError, which is an OSError).
_DROPPED: Final = (gevent.Timeout, SSHException, OSError, EOFError)


def _lost_or_slow(host, exc: BaseException, timeout: float) -> OperationError:
    if not isinstance(exc, (gevent.Timeout, TimeoutError)):
        return ConnectionLost(str(exc) or type(exc).__name__)
    try:
        with gevent.Timeout(PROBE_TIMEOUT_S):
            alive, _ = host.connector.run_shell_command(StringCommand("true"))
    except _DROPPED:
        alive = False
    if not alive:
        return ConnectionLost(f"no answer for {timeout:.0f} s")
    return OperationError(f"a command did not finish within {timeout:.0f} s")


def shell(host, command: str | StringCommand, *, timeout: float = DEFAULT_TIMEOUT_S,
          **arguments: Any):
    """``host.run_shell_command`` with :func:`connector_arguments` (``arguments`` override them,
    e.g. ``_success_exit_codes``); returns pyinfra's ``(ok, CommandOutput)``.

    Raises ConnectionLost when the connection dropped (SSH's or the socket's errors, or no
    answer within ``timeout`` seconds nor to a ``true`` after it), OperationError when only the
    command was slow."""
    merged = {**connector_arguments(host), **arguments}
    try:
        with gevent.Timeout(timeout):
            ok, out = host.run_shell_command(command, **merged)
    except _DROPPED as exc:
        raise _lost_or_slow(host, exc, timeout) from None
    if not ok and not out.stdout_lines and not out.stderr_lines and _link_closed(host):
        # a link that dropped can also end a command with no word at all: the link watch
        # (operations/runtime/link.py) closed the transport under it, before this call's timeout
        raise ConnectionLost("the connection closed under the command")
    return ok, out


def _link_closed(host) -> bool:
    """Whether the host's SSH transport is gone (paramiko's Transport.is_active); False for a
    connector without one (pyinfra's @local)."""
    connector = getattr(host, "connector", None)
    if connector is None or not hasattr(connector, "client"):
        return False
    client = connector.client
    transport = client.get_transport() if client is not None else None
    return transport is None or not transport.is_active()


def put(host, src: Any, dest: str, *, timeout: float = TRANSFER_TIMEOUT_S) -> None:
    """``host.put_file`` as :func:`shell` runs commands; OperationError when it fails."""
    if not _transfer(host, host.put_file, src, dest, timeout):
        raise OperationError(f"could not send {dest}")


def get(host, src: str, dest: Any, *, timeout: float = TRANSFER_TIMEOUT_S) -> None:
    """``host.get_file`` as :func:`shell` runs commands; OperationError when it fails.

    Where the login reads root's files through sudo, the file is first copied to a temporary
    file of mode 0644, which the login then reads itself: pyinfra's own copy (its SSH
    connector's get_file) makes its temporary file readable with ``chmod +r``, which a root
    umask of 077 (a hardened host) turns into u+r alone, and the login's SFTP read then fails
    with "[Errno 13] Permission denied" (seen on the sandbox's hardened hosts)."""
    arguments = connector_arguments(host)
    if not any(arguments.get(k) for k in ("_sudo", "_su_user", "_doas", "_dzdo")):
        if not _transfer(host, host.get_file, src, dest, timeout, arguments):
            raise OperationError(f"could not fetch {src}")
        return
    ok, out = shell(host, "t=$(mktemp /tmp/gpuhost-get.XXXXXX) && cp " + shlex.quote(src)
                    + ' "$t" && chmod 0644 "$t" && echo "$t"')
    copy = out.stdout_lines[-1].strip() if ok and out.stdout_lines else ""
    if not copy.startswith("/tmp/gpuhost-get."):
        raise OperationError(f"could not fetch {src}: "
                             + " ".join(out.stderr_lines[-2:] or ["its copy failed"]))
    try:
        plain = {k: v for k, v in arguments.items() if not k.startswith(_ELEVATION)}
        if not _transfer(host, host.get_file, copy, dest, timeout, plain):
            raise OperationError(f"could not fetch {src}")
    finally:
        shell(host, "rm -f " + shlex.quote(copy))


#: The connector arguments that read as another user (pyinfra 3.10 ConnectorArguments).
_ELEVATION: Final = ("_sudo", "_use_sudo", "_preserve_sudo", "_su_", "_use_su", "_preserve_su",
                     "_doas", "_dzdo")


def _transfer(host, method: Callable, src: Any, dest: Any, timeout: float,
              arguments: dict[str, Any] | None = None) -> bool:
    try:
        with gevent.Timeout(timeout):
            return method(src, dest, **(connector_arguments(host) if arguments is None
                                        else arguments))
    except _DROPPED as exc:
        raise _lost_or_slow(host, exc, timeout) from None


def callback(during: str, goes_on: str = "") -> Callable:
    """Make a FunctionCommand's function fail its host with one line instead of a traceback:
    "connection to gpu1 lost during <during>: run again[; <goes_on>]" for a lost connection,
    the OperationError's message for any other refusal. ``goes_on`` says what keeps running on
    the host (a detached build the next run adopts)."""

    def wrap(function: Callable) -> Callable:
        @functools.wraps(function)
        def run(state, host, *args: Any, **kwargs: Any) -> bool:
            try:
                result = function(state, host, *args, **kwargs)
            except ConnectionLost as exc:
                tail = f"; {goes_on}" if goes_on else ""
                host.log_styled(f"connection to {host.name} lost during {during} ({exc}): "
                                f"run again{tail}", fg="red", log_func=logger.error)
                close(host)
                return False
            except OperationError as exc:
                host.log_styled(f"{during}: {exc}", fg="red", log_func=logger.error)
                return False
            return result is not False

        return run

    return wrap


#: What a failed operation did, by host: said in place of pyinfra's "executed N commands".
_endings: dict[str, str] = {}


def ending(host, text: str) -> None:
    """End the current operation's failure on ``host`` with ``text`` ("Error: <text>")
    instead of pyinfra's "Error: executed 0 commands" (pyinfra/api/operations.py counts a
    callback as one command, done only when it succeeds: a callback that changed server.env,
    restarted the server twice and rolled the change back read as if it had done nothing)."""
    _endings[host.name] = text
    import pyinfra.api.operations as pyinfra_operations

    if getattr(pyinfra_operations.log_error_or_warning, "gpuhost_endings", False):
        return
    original = pyinfra_operations.log_error_or_warning

    def log_error_or_warning(target, ignore_errors, description="", continue_on_error=False,
                             exception=None):
        said = _endings.pop(getattr(target, "name", None), None)
        if said and description.startswith("executed "):
            description = said
        return original(target, ignore_errors, description, continue_on_error, exception)

    log_error_or_warning.gpuhost_endings = True  # type: ignore[attr-defined]
    pyinfra_operations.log_error_or_warning = log_error_or_warning


def close(host) -> None:
    """Close the host's connection for good: its SSH client too (pyinfra's SSH connector keeps
    the client open at ``disconnect``), so that a connection that stopped answering holds
    nothing, and reconnect attempts leave no half-open connection on the host's sshd."""
    disconnect = getattr(host.connector, "disconnect", None)
    if disconnect is not None:
        disconnect()  # pyinfra's: forgets the SFTP session kept for file transfers
    client = getattr(host.connector, "client", None)
    if client is not None:
        client.close()
    host.connected = False
