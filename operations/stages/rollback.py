"""Roll a host back to its last known good on request (``--data gpuhost_rollback=true``), or
finish a rollback that an earlier run began and did not finish (that run then does nothing else
on the host and fails, saying so: its plan was read off the files before they went back; the
next run applies host data)."""

from __future__ import annotations

import json
import shlex
from typing import Final

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, deploy, operation
from pyinfra.operations import files

from operations import REPO_ROOT
from operations.runtime import remote
from operations.facts.host import FileText
from operations.plans.plan import fact, refuse
from operations.plans.settings import PREFIX, Settings
from operations.stages.folders import top_folders
from operations.stages.last_known_good import MARKER, RECORD, SCRIPT
from operations.stages.p2p import LIB_DIR
from operations.stages.server_health import health_gate, mark_verified, settings_gate_argv
from operations.stages.server_unit import GATE_UNIT, UNIT


#: The shipped scripts a rollback runs: the restore, the health gate and what it imports.
ROLLBACK_SCRIPTS: Final = ("last_known_good.py", "health_check.py", "secret_file.py")


def unfinished() -> dict | None:
    """The rollback an earlier run began and did not finish (MARKER: when, why, to what), or
    None."""
    text = fact(FileText, path=MARKER)
    if not text:
        return None
    try:
        found = json.loads(text)
    except ValueError:
        found = None
    return found if isinstance(found, dict) else {"why": "(its record does not parse)"}


@remote.callback("the rollback", "the server goes on starting on the host")
def _roll_back(state, host, argv: list[str], units: list[str], why: str,
               interrupted: bool) -> bool:
    prefix = f"{host.print_prefix}Rollback: "
    ok, out = remote.shell(host, f"python3 {SCRIPT} restore --why {shlex.quote(why)}",
                           _success_exit_codes=[0, 4, 5])
    lines = out.stdout_lines + out.stderr_lines
    last = lines[-1] if lines else ""
    failed = not ok or last.startswith("no last known good")
    for line in lines[:-1] if failed else lines:
        logger.warning(f"{prefix}{line}")
    if failed:
        logger.error(f"{prefix}nothing to roll back to: {last or 'the restore failed'}")
        return False
    active = remote.shell(host, f"systemctl is-active --quiet {UNIT}")[0]
    if last.startswith("rolled back") or not active:
        remote.shell(host, f"systemctl reset-failed {UNIT} 2>/dev/null; "
                     f"systemctl restart --no-block {UNIT}")
    if not health_gate(host, argv):
        logger.error(f"{prefix}the last known good's server failed the health gate (its "
                     "journal above): the host does not serve")
        return False
    mark_verified(host, units)
    remote.shell(host, f"python3 {SCRIPT} finish")
    logger.warning(f"{prefix}the host serves its last known good ({RECORD}), verified by the "
                   "health gate")
    if interrupted:
        # what this run planned was read before the files went back: the next run applies it
        logger.error(f"{prefix}the rollback an earlier run began is finished; host data's "
                     "configuration is not applied in this run: run the deploy again")
        return False
    return True


@operation(is_idempotent=False)
def rolled_back(argv: list[str], units: tuple[str, ...], why: str, interrupted: bool = False):
    """Put the last known good's files back where they differ (operations/files/
    last_known_good.py restore), restart the server where they did or where it does not run,
    and run the health gate on it.

    + argv: the health gate's command line (operations/server.settings_gate_argv)
    + units: the units whose InvocationIDs the verified record gets once the gate passed
    + why: what the rollback record says of why it began
    + interrupted: finishing a rollback an earlier run began: the host's run then fails once it
      serves again (the rest of this run was planned on the files before they went back)
    """
    yield FunctionCommand(_roll_back, (argv, list(units), why, interrupted), {})


@deploy("Rollback")
def rollback(settings: Settings, interrupted: dict | None):
    """Roll the host back to its last known good: asked by host data (gpuhost_rollback), or
    to finish the rollback ``interrupted`` (:func:`unfinished`) before this run goes on.

    + settings: the host's validated settings
    + interrupted: the unfinished rollback's record, or None
    """
    if settings.nodes:
        # gpuhost_rollback on a node is refused with the host data (node_group.check_groups);
        # a rollback begun while this host served alone must not restart one rank alone
        began = (interrupted or {}).get("started_at", "?")
        refuse("Rollback", f"a rollback began at {began} ({(interrupted or {}).get('why', '?')}) "
                           f"and did not finish, and {host.name} is now a node of "
                           f"{', '.join(settings.nodes)}: a rank is never restarted alone; "
                           f"finish the rollback with {host.name} out of the group (leave it "
                           f"out of {PREFIX}nodes and run with --limit {host.name}), then put "
                           "it back")
        return
    if interrupted:
        logger.warning(f"{host.print_prefix}Rollback: a rollback began at "
                       f"{interrupted.get('started_at', '?')} ({interrupted.get('why', '?')}) "
                       "and did not finish: finishing it first")
    why = (interrupted or {}).get("why") or "asked for by host data (gpuhost_rollback = True)"
    # this run's own scripts: nothing else of the deploy runs to ship them (a host never
    # deployed has none; one whose rollback cannot go on needs the one that says so)
    top_folders()
    files.directory(name="gpuhost library folder", path=LIB_DIR, mode="755")
    for script in ROLLBACK_SCRIPTS:
        files.put(name=f"Ship {script}", src=str(REPO_ROOT / "operations/files" / script),
                  dest=f"{LIB_DIR}/{script}", mode="644", create_remote_dir=False)
    gated = (UNIT, GATE_UNIT) if settings.server_is_public else (UNIT,)
    rolled_back(name="Roll back to the last known good", argv=settings_gate_argv(settings),
                units=gated, why=why, interrupted=bool(interrupted) and not settings.rollback)
