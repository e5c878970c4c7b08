"""systemd units as operations: enabled, started, restarted or reloaded (never waiting for a
start), a path unit kept watching, and the quoting of their command lines."""

from __future__ import annotations

import re

from pyinfra import host
from pyinfra.api import operation
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus


def systemd_quote(arg: str) -> str:
    """Quote one argument for an ExecStart line (systemd.service(5), "Command lines"):
    specifiers ``%`` and variables ``$`` are doubled, and words with spaces, quotes or
    backslashes are double-quoted with C-style escapes."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and re.fullmatch(r"[A-Za-z0-9_./:=+,@-]+", arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


@operation()
def unit_enabled(unit: str):
    """Enable ``unit`` (started at boot). Apart from :func:`unit_started`, so that a change of
    that one means the unit was started."""
    # of this unit alone: every unit's (``systemctl show '*'``) took 0.24 s of a sandbox host
    if host.get_fact(SystemdEnabled, services=unit).get(unit):
        host.noop(f"{unit} is enabled")
        return
    yield f"systemctl enable {unit}"


@operation()
def unit_started(unit: str):
    """Start ``unit`` without waiting for it (``systemctl start --no-block``: the unit's
    ExecStartPost holds it "activating" until the server answers, which may take the whole
    start timeout; the health gate shows the progress meanwhile). Read when it runs: a unit an
    earlier stage stopped (the P2P check, a driver change) is started here, with the files as
    they are now."""
    if host.get_fact(SystemdStatus, services=unit).get(unit):
        host.noop(f"{unit} is running")
        return
    yield f"systemctl reset-failed {unit} 2>/dev/null || true"
    yield f"systemctl start --no-block {unit}"


@operation(is_idempotent=False)
def unit_reloaded(unit: str):
    """Reload ``unit`` (a gate's graceful reload: its ExecReload=)."""
    yield f"systemctl reload {unit}"


@operation()
def path_restarted(unit: str, changed: bool):
    """A path unit running, restarted where its file ``changed`` (to watch what it names now)."""
    if changed:
        yield f"systemctl restart {unit}"
        return
    if host.get_fact(SystemdStatus, services=unit).get(unit):
        host.noop(f"{unit} is running")
        return
    yield f"systemctl start {unit}"


@operation(is_idempotent=False)
def unit_restarted(unit: str):
    """Restart ``unit`` without waiting for it (see unit_started)."""
    yield f"systemctl reset-failed {unit} 2>/dev/null || true"
    yield f"systemctl restart --no-block {unit}"
