"""What the deploy reads of the SGLang server's units before it changes anything (their state,
journal, drop-ins and the ports' listeners), and what it says of a unit found stale, unverified
or failed."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Final

from pyinfra.api import FactBase
from typing_extensions import override

from operations.stages.p2p import LIB_DIR
from operations.stages.server_unit import GATE_UNIT, OWN_DROPINS, UNIT, VERIFIED_FILE

_LISTENERS_SCRIPT: Final = r"""
import json, os, sys
ports = {int(p) for p in sys.argv[1:]}
inodes = {}
for name in ("tcp", "tcp6"):
    try:
        lines = open("/proc/net/" + name).read().splitlines()[1:]
    except OSError:
        continue
    for line in lines:
        f = line.split()
        port = int(f[1].rsplit(":", 1)[1], 16)
        if f[3] == "0A" and port in ports:
            inodes[f[9]] = port
found = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
        if inode in inodes:
            try:
                cgroup = open(f"/proc/{pid}/cgroup").read().strip().rsplit("/", 1)[-1]
            except OSError:
                cgroup = ""
            found.setdefault(str(inodes[inode]), set()).add(cgroup or f"pid {pid}")
print(json.dumps({p: sorted(u) for p, u in found.items()}))
"""


class PortListeners(FactBase[dict]):
    """Who listens on TCP ports, by systemd unit (the cgroup of the listening process, from
    /proc/net/tcp{,6} and /proc/<pid>/fd):

    .. code:: python

        {"8000": ["sglang-gate.service"], "30000": ["sglang.service"]}
    """

    @override
    def requires_command(self, ports: tuple[int, ...]) -> str:
        return "python3"

    @override
    def command(self, ports: tuple[int, ...]) -> str:
        return f"python3 -c {shlex.quote(_LISTENERS_SCRIPT)} " + " ".join(str(p) for p in ports)

    @override
    def default(self) -> dict:
        return {}

    @override
    def process(self, output) -> dict:
        try:
            return json.loads("\n".join(output))
        except ValueError:
            return {}


class DropIns(FactBase[list[str]]):
    """The file names of the drop-ins in a unit's drop-in folder (``*.conf``, the only ones
    systemd reads, systemd.unit(5)), sorted; empty when the folder does not exist.

    .. code:: python

        ["10-gpuhost-driver-gate.conf", "50-local.conf"]
    """

    default = list

    @override
    def command(self, path: str) -> str:
        return (f"for f in {shlex.quote(path)}/*.conf; do "
                'if [ -e "$f" ] || [ -L "$f" ]; then echo "${f##*/}"; fi; done')

    @override
    def process(self, output) -> list[str]:
        return sorted(line.strip() for line in output if line.strip())


def foreign_dropins(present: Iterable[str], allowed: Iterable[str]) -> tuple[list[str], list[str]]:
    """The drop-ins gpuhost does not own, split into (to remove, allowed by host data)."""
    allowed = set(allowed)
    theirs = [name for name in present if name not in OWN_DROPINS]
    return ([n for n in theirs if n not in allowed], [n for n in theirs if n in allowed])


@dataclass(frozen=True)
class UnitState:
    """A server unit as the deploy reads it before changing anything: ``active`` systemd's
    ActiveState ("active", "activating", "inactive", "failed", ...), ``invocation`` its
    InvocationID (new at every start, systemd's own restarts included), ``need_reload``
    systemd's NeedDaemonReload (the unit file changed since systemd read it),
    ``started_with`` the digest its ExecStartPre wrote for the running process ("" when none)
    and ``now`` the same digest of the files as they are (operations/files/unit_inputs.py;
    "" when that script is not on the host yet), ``changed`` which of those inputs differ from
    what the running process read (unit_inputs.py --changed; empty when that was not recorded),
    ``result`` systemd's Result ("success", "exit-code", "start-limit-hit", ...), ``stopped_at``
    when it last stopped or failed (systemd's InactiveEnterTimestamp, in UTC: seconds since the
    epoch; None when it never did)."""

    active: str = "inactive"
    invocation: str = ""
    need_reload: bool = False
    started_with: str = ""
    now: str = ""
    changed: tuple[str, ...] = ()
    result: str = ""
    stopped_at: float | None = None

    @property
    def running(self) -> bool:
        return self.active in ("active", "activating", "reloading")

    @property
    def stale(self) -> bool:
        """Running with other inputs than the files now: an earlier run changed them and
        stopped (killed, disconnected) before restarting the unit."""
        return self.running and bool(self.now) and self.started_with != self.now


class ServiceState(FactBase[UnitState]):
    """:class:`UnitState` of ``unit`` (``systemctl show``, the digest under /run/``runtime_dir``
    and ``unit_inputs.py`` run on ``inputs``: unit_inputs.py's arguments). Which inputs changed
    is asked only where the digests differ (where they are equal, so are the inputs' parts:
    each python3 start took 0.08 s of a sandbox host's CPU at each no-op run)."""

    @override
    def command(self, unit: str, runtime_dir: str, inputs: list[str]) -> str:
        script = f"{LIB_DIR}/unit_inputs.py"
        argv = " ".join(shlex.quote(a) for a in inputs)
        return (f"TZ=UTC systemctl show -p ActiveState -p InvocationID -p NeedDaemonReload "
                f"-p Result -p InactiveEnterTimestamp {shlex.quote(unit)} 2>/dev/null; "
                f"w=$(cat /run/{runtime_dir}/inputs 2>/dev/null); echo \"started_with=$w\"; "
                f"if [ -f {script} ]; then n=$(python3 {script} {argv} 2>/dev/null); "
                "echo \"now=$n\"; if [ \"$n\" != \"$w\" ]; then "
                f"echo \"changed=$(python3 {script} --changed /run/{runtime_dir}/inputs {argv} "
                "2>/dev/null)\"; fi; else echo now=; fi")

    @override
    def default(self) -> UnitState:
        return UnitState()

    @override
    def process(self, output) -> UnitState:
        values = dict(line.split("=", 1) for line in output if "=" in line)
        return UnitState(
            active=values.get("ActiveState") or "inactive",
            invocation=values.get("InvocationID", ""),
            need_reload=values.get("NeedDaemonReload") == "yes",
            started_with=values.get("started_with", "").strip(),
            now=values.get("now", "").strip(),
            changed=tuple(c for c in values.get("changed", "").strip().split("|") if c),
            result=values.get("Result", ""),
            stopped_at=systemd_time(values.get("InactiveEnterTimestamp", "")),
        )


def systemd_time(text: str) -> float | None:
    """A timestamp as ``systemctl show`` writes it with TZ=UTC ("Thu 2026-12-03 09:48:01
    UTC"), as seconds since the epoch; None for an empty one (never happened) or another
    form."""
    try:
        when = datetime.strptime(text.strip(), "%a %Y-%m-%d %H:%M:%S UTC")
    except ValueError:
        return None
    return when.replace(tzinfo=timezone.utc).timestamp()


#: Lines of a failed unit's journal shown when the deploy starts it again.
JOURNAL_LINES: Final = 15


class UnitJournal(FactBase[list]):
    """The last ``lines`` lines of ``unit``'s journal (``journalctl -u UNIT -n LINES -o
    short-iso``, journalctl(1)), e.g. ``["2026-12-01T14:00:00+0000 gpu1 systemd[1]:
    sglang.service: Start request repeated too quickly."]``."""

    @override
    def command(self, unit: str, lines: int = JOURNAL_LINES) -> str:
        return (f"journalctl -u {shlex.quote(unit)} -n {int(lines)} --no-pager -o short-iso "
                "2>/dev/null || true")

    @override
    def default(self) -> list:
        return []

    @override
    def process(self, output) -> list:
        return [line for line in output if not line.startswith("-- ")]


def stale_message(unit: str, state: UnitState) -> str:
    """What the deploy says of a unit running with other inputs than the files now: which
    inputs differ, as the unit recorded them at its start, not a guess at why."""
    if state.changed:
        what = f"{', '.join(state.changed)} changed since it started"
    elif not state.started_with:
        what = "it recorded no inputs at its start (/run was emptied, or an older gpuhost " \
               "started it)"
    else:
        what = "which of them changed is not recorded (an older gpuhost started it)"
    return f"{unit} runs with other inputs than the files now: {what}: restarting it"


def unverified_message(units: tuple[str, ...], states: tuple[UnitState, ...],
                       recorded: list[str]) -> str:
    """Why the health gate runs for a server that runs and was not restarted: which unit's
    InvocationID differs from the ones VERIFIED_FILE recorded when the gate last passed, or
    that the units gated now are not the ones gated then (a bind switched to or from the
    loopback)."""
    if not recorded:
        why = f"no passed health gate is recorded ({VERIFIED_FILE})"
    elif len(recorded) != len(units):
        then = " and ".join((UNIT, GATE_UNIT)[: len(recorded)])
        why = (f"the health gate last passed for {then}; it is {' and '.join(units)} now "
               "(the bind address changed to or from the loopback)")
    else:
        since = [u for u, st, rec in zip(units, states, recorded) if st.invocation != rec]
        why = (f"{' and '.join(since)} started since the health gate last passed "
               "(its InvocationID differs from the one recorded then)")
    return f"not verified as it runs now: {why}: the health gate runs"


def failed_message(unit: str, state: UnitState, journal: list[str]) -> str:
    """What the deploy says of a unit systemd left failed, before it starts it again: that it
    failed, systemd's Result, and the journal's last lines."""
    lines = "".join(f"\n    {line}" for line in journal) or "\n    (the journal is empty)"
    return (f"{unit} had failed (systemd's Result: {state.result or 'unknown'}): starting it "
            f"again. The last lines of its journal:{lines}")
