"""One deploy per host at a time: a lock on the host held by the run's own connection.

Planning takes it, before any fact is read (``deploy.py``: the stages run only for a host whose
lock is held); it is let go when the run ends or its connection closes. The host side is
``operations/files/deploy_lock.py``, on an SSH channel of its own: an flock under /run that a
reboot releases too, exclusive for a deploy, shared for ``--dry``. A second run says who holds
it and waits ``gpuhost_deploy_lock_wait`` seconds, or fails at once (the default). A lock held
only by runs of this controller whose pyinfra process has ended (a link that dropped mid-run:
the host heard nothing, and its holder would wait out its 300 s of silence) is taken from them,
and said so.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import subprocess
from dataclasses import dataclass
from typing import Any, Final

import gevent
from paramiko import SSHException
from pyinfra import host, logger
from pyinfra.api import QuoteString, StringCommand
from pyinfra.api.exceptions import OperationError
from pyinfra.connectors.util import extract_control_arguments, make_unix_command_for_host

from operations import REPO_ROOT, remote
from operations.plan import is_dry_run, refuse
from operations.settings import PREFIX, Settings

SCRIPT: Final = REPO_ROOT / "operations" / "files" / "deploy_lock.py"
#: Seconds between the controller's heartbeats (the host lets go after 300 s of silence).
HEARTBEAT_S: Final = 10
#: Seconds the host's answer may take beyond the allowed wait (a slow sudo, a slow link).
ANSWER_SLACK_S: Final = 60


@dataclass
class _Held:
    """One host's lock: the stream to its holder process and the heartbeat greenlet."""

    mode: str
    write: Any
    readline: Any
    close: Any
    beats: Any = None


_held: dict[str, _Held] = {}


def _holder() -> str:
    """Who takes the lock, as the next run will be told."""
    return json.dumps({"controller": f"{getpass.getuser()}@{socket.gethostname()}",
                       "controller_pid": os.getpid()})


def _command(target, mode: str, wait: int, gone: list[dict] | None = None) -> str:
    command = StringCommand("python3", "-c", QuoteString(SCRIPT.read_text()), "--mode", mode,
                            "--wait", str(wait), "--holder", QuoteString(_holder()),
                            *(("--evict", QuoteString(json.dumps(gone))) if gone else ()))
    arguments = remote.connector_arguments(target)
    extract_control_arguments(arguments)  # the connector's own, not the command line's
    return make_unix_command_for_host(target.state, target, command, **arguments).get_raw_value()


def _open(target, command: str) -> _Held | None:
    """Start the holder on the host, on a channel (SSH) or a process (@local) of its own."""
    client = getattr(target.connector, "client", None)
    if client is not None:
        channel = client.get_transport().open_session()
        channel.exec_command(command)
        out = channel.makefile("r")
        return _Held("", channel.sendall, out.readline, channel.close)
    if target.connector.__class__.__name__ == "LocalConnector":
        proc = subprocess.Popen(command, shell=True, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)

        def write(data: bytes) -> None:
            proc.stdin.write(data.decode())
            proc.stdin.flush()

        def close() -> None:
            proc.stdin.close()
            proc.wait()

        return _Held("", write, proc.stdout.readline, close)
    return None


def _describe(holders_json: str) -> str:
    try:
        holders = json.loads(holders_json)
    except ValueError:
        holders = []
    if not holders:
        return "another run"
    return "; ".join(
        f"{'a dry run' if h.get('mode') == 'shared' else 'a deploy'} by "
        f"{h.get('controller', '?')} (pyinfra pid {h.get('controller_pid', '?')}, logged in as "
        f"{h.get('login', '?')}, since {h.get('since', '?')})" for h in holders)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process, alive
        return True
    return True


def gone_runs(holders_json: str) -> list[dict]:
    """The holders of a busy lock whose run is known to be over: every one of them taken by a
    pyinfra process of this controller (user@host) that no longer lives; [] where any holder
    is another controller's or a live run's. Such a holder stays after a link dropped mid-run
    (operations/link.py): its run ended, but the host heard nothing of it."""
    try:
        holders = json.loads(holders_json)
    except ValueError:
        return []
    me = json.loads(_holder())
    if not isinstance(holders, list) or not holders:
        return []
    for h in holders:
        pid = h.get("controller_pid") if isinstance(h, dict) else None
        if (h.get("controller") != me["controller"] or not isinstance(pid, int)
                or pid == me["controller_pid"] or _alive(pid)):
            return []
    return [{"controller": h["controller"], "controller_pid": h["controller_pid"]}
            for h in holders]


def _beat(target, held: _Held) -> None:
    while True:
        gevent.sleep(HEARTBEAT_S)
        try:
            held.write(b"\n")
        except (SSHException, OSError, EOFError, ValueError):
            return


def _take(target, mode: str, wait: int, gone: list[dict] | None = None) -> str | None:
    """Take the lock on ``target``; None when held, else why not. A lock held only by runs of
    this controller that are gone is taken from them (once)."""
    try:
        with gevent.Timeout(wait + ANSWER_SLACK_S):
            held = _open(target, _command(target, mode, wait, gone))
            if held is None:
                logger.warning(f"{target.print_prefix}deploy lock: the {type(target.connector)}"
                               " connector cannot hold one: going on without it")
                return None
            while True:
                line = held.readline().strip().lstrip(".")
                if line.startswith("waiting "):
                    logger.info(f"{target.print_prefix}deploy lock: waiting up to {wait} s for "
                                f"{_describe(line[len('waiting '):])}")
                    continue
                if line.startswith("evicted "):
                    logger.warning(f"{target.print_prefix}deploy lock: held by "
                                   f"{_describe(line[len('evicted '):])}, a run that is over "
                                   "(its pyinfra process is gone; its link dropped before it "
                                   "could let go): taken from it")
                    continue
                break
    except (gevent.Timeout, SSHException, OSError, EOFError) as exc:
        return f"the host did not answer the deploy lock ({exc or type(exc).__name__})"
    if line == "held":
        held.mode = mode
        held.beats = gevent.spawn(_beat, target, held)
        _held[target.name] = held
        return None
    held.close()
    if line.startswith("busy ") and gone is None and gone_runs(line[len("busy "):]):
        return _take(target, mode, wait, gone_runs(line[len("busy "):]))
    if line.startswith("busy "):
        return (f"{target.name} is being deployed: {_describe(line[len('busy '):])}. Run again "
                f"when it ends, or let this run wait for it: --data "
                f"{PREFIX}deploy_lock_wait=SECONDS")
    return f"the deploy lock's holder on the host said {line or 'nothing'!r} (is python3 there?)"


def held(settings: Settings) -> bool:
    """Planning: take this host's deploy lock (shared for --dry); False, with the host refused
    and who holds the lock said, when another run holds it past ``deploy_lock_wait``."""
    if host.name in _held:
        return True
    why = _take(host, "shared" if is_dry_run() else "exclusive", settings.deploy_lock_wait)
    if why:
        refuse("deploy lock", why)
        return False
    return True


def release(target) -> None:
    """Let go of ``target``'s lock (before its connection is closed on purpose: a reboot)."""
    held_ = _held.pop(target.name, None)
    if held_ is None:
        return
    if held_.beats is not None:
        held_.beats.kill()
    try:
        held_.close()
    except (SSHException, OSError, EOFError):
        pass


def take_again(target) -> None:
    """After a reconnect (a reboot released the lock with /run): take it again, at once.
    Raises OperationError when another run took it meanwhile."""
    why = _take(target, "exclusive", 0)
    if why:
        raise OperationError(f"after the reboot: {why}")
