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
from pathlib import Path
from typing import Any, Final

import gevent
from paramiko import SSHException
from pyinfra import host, logger
from pyinfra.api import QuoteString, StringCommand
from pyinfra.api.exceptions import OperationError
from pyinfra.connectors.util import extract_control_arguments, make_unix_command_for_host

from operations import REPO_ROOT
from operations.runtime import remote
from operations.plans.plan import is_dry_run, refuse
from operations.plans.settings import PREFIX, Settings

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
    #: What the holder wrote on stderr, once it ended (sudo's or the shell's complaint).
    errors: Any = None


_held: dict[str, _Held] = {}


def _start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (proc(5), /proc/PID/stat field
    22, after the command's parenthesis); None without /proc (macOS) or without the process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_space() -> str | None:
    """Which pids this controller's mean: its boot (/proc/sys/kernel/random/boot_id) and pid
    namespace (/proc/self/ns/pid); None without /proc. Two containers, or two machines, of one
    user@host name have different ones."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


#: What this run is, for the next run to be told: "deploy" (deploy.py) or "bench" (bench.py).
_job = "deploy"


def _holder() -> str:
    """Who takes the lock, as the next run will be told (and its controller can tell whether
    that run is over: pid, pid space and start time), and what the run is (``job``)."""
    me = {"controller": f"{getpass.getuser()}@{socket.gethostname()}",
          "controller_pid": os.getpid(), "job": _job}
    space, start = _pid_space(), _start(os.getpid())
    if space and start is not None:
        me |= {"controller_pids": space, "controller_start": start}
    return json.dumps(me)


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
        return _Held("", channel.sendall, out.readline, channel.close,
                     errors=channel.makefile_stderr("r").read)
    if target.connector.__class__.__name__ == "LocalConnector":
        proc = subprocess.Popen(command, shell=True, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def write(data: bytes) -> None:
            proc.stdin.write(data.decode())
            proc.stdin.flush()

        def close() -> None:
            proc.stdin.close()
            proc.wait()

        return _Held("", write, proc.stdout.readline, close, errors=proc.stderr.read)
    return None


def _holders(holders_json: str) -> list[dict]:
    try:
        holders = json.loads(holders_json)
    except ValueError:
        return []
    if not isinstance(holders, list) or not all(isinstance(h, dict) for h in holders):
        return []
    return holders


def _what(h: dict) -> str:
    if h.get("job") == "bench":
        return "a bench (bench.py)"
    return "a dry run" if h.get("mode") == "shared" else "a deploy"


def _doing(holders_json: str) -> str:
    """"being benched" when every holder is a bench (bench.py), else "being deployed"."""
    holders = _holders(holders_json)
    if holders and all(h.get("job") == "bench" for h in holders):
        return "being benched"
    return "being deployed"


def _describe(holders_json: str) -> str:
    holders = _holders(holders_json)
    if not holders:
        return "another run"
    return "; ".join(
        f"process {h.get('pid', '?')} on the host ({h['process']}), not a gpuhost run"
        if "process" in h and "controller" not in h else
        f"{_what(h)} by "
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


_RUN_KEYS: Final = ("controller", "controller_pid", "controller_pids", "controller_start")


def _over(h: Any, me: dict) -> bool:
    """``h`` was taken by a run of this controller that is over: same user@host and pid space
    (where /proc tells it), and its pid names no process, or one started since (a pid
    reused)."""
    pid = h.get("controller_pid") if isinstance(h, dict) else None
    if (not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0
            or h.get("controller") != me["controller"] or pid == me["controller_pid"]
            or h.get("controller_pids") != me.get("controller_pids")):
        return False
    if "controller_pids" in me:
        return not _alive(pid) or _start(pid) != h.get("controller_start")
    return not _alive(pid)


def gone_runs(holders_json: str) -> list[dict]:
    """The holders of a busy lock whose run is known to be over: every one of them taken by a
    pyinfra process of this controller (user@host, pid space) that no longer lives; [] where
    any holder is another controller's, another container's or a live run's. Such a holder
    stays after a link dropped mid-run (operations/runtime/link.py): its run ended, but the host
    heard nothing of it."""
    try:
        holders = json.loads(holders_json)
    except ValueError:
        return []
    me = json.loads(_holder())
    if not isinstance(holders, list) or not holders or not all(_over(h, me) for h in holders):
        return []
    return [{k: h[k] for k in _RUN_KEYS if k in h} for h in holders]


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
    complaint = "" if line.startswith(("busy ", "error ")) else _complaint(held)
    held.close()
    if line.startswith("busy ") and gone is None and gone_runs(line[len("busy "):]):
        return _take(target, mode, wait, gone_runs(line[len("busy "):]))
    if line.startswith("busy "):
        return (f"{target.name} is {_doing(line[len('busy '):])}: "
                f"{_describe(line[len('busy '):])}. Run again "
                f"when it ends, or let this run wait for it: --data "
                f"{PREFIX}deploy_lock_wait=SECONDS")
    if line.startswith("error "):
        return f"the host cannot hold the deploy lock: {line[len('error '):]}"
    return (f"the deploy lock's holder on the host said {line or 'nothing'!r}"
            f"{complaint} (is python3 there?)")


def _complaint(held: _Held) -> str:
    """The last line the ended holder wrote on stderr ("sudo: a password is required"), if
    it comes within a few seconds: "" where there is none."""
    if held.errors is None:
        return ""
    try:
        with gevent.Timeout(5):
            text = held.errors()  # paramiko's file reads bytes, whatever its mode
        text = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
        lines = [line for line in text.splitlines() if line.strip()]
    except (gevent.Timeout, SSHException, OSError, EOFError, ValueError):
        return ""
    return f", and on stderr {lines[-1].strip()[:300]!r}" if lines else ""


def held(settings: Settings, job: str = "deploy") -> bool:
    """Planning: take this host's deploy lock (shared for --dry); False, with the host refused
    and who holds the lock said, when another run holds it past ``deploy_lock_wait``. ``job``
    ("deploy" or "bench") is what a run refused meanwhile is told this run is."""
    global _job
    _job = job
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
