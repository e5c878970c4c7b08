"""Planning: the host's facts as the stages read them, and refusals (a stage that must not run
on a host says why, the rest of the plan is still shown, and a real run stops before any
change)."""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any, Final, TypeVar

from pyinfra import host, logger, state
from pyinfra.api import FactBase
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.state import StateStage

T = TypeVar("T")

_refusals: dict[str, list[str]] = defaultdict(list)


class PlanError(PyinfraError):
    """A host whose state forbids the planned change; the message says what to do."""


def _key(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _key(v)) for k, v in value.items()))
    return value


def fact(cls: type[FactBase[T]], **kwargs: Any) -> T:
    """``host.get_fact(cls, **kwargs)``, read once per host and arguments while planning.

    pyinfra 3 runs a fact's command at every ``get_fact`` call; the stages read several facts
    more than once (the driver's state in four of them), and each read is a round trip to the
    host. While the deploy file is planned nothing has changed on the host yet, so one reading
    serves every stage. During execution (an operation's body) this is plain ``get_fact``.
    """
    if getattr(state, "current_stage", None) == StateStage.Execute:
        return host.get_fact(cls, **kwargs)
    # On the Host object itself (pyinfra's ``host`` is a proxy to the current one).
    cache = vars(host._get_module()).setdefault("_gpuhost_planned_facts", {})
    key = (cls, _key(kwargs))
    if key not in cache:
        cache[key] = host.get_fact(cls, **kwargs)
    return cache[key]


def fact_of(name: str, cls: type[FactBase[T]], **kwargs: Any) -> T:
    """A fact of inventory host ``name`` while planning, read once: :func:`fact` for the current
    host; another host's reading is kept on that Host, where its own planning finds it. An
    unconnected host is connected first (pyinfra's ``get_fact``), its failure raised."""
    if name == host.name:
        return fact(cls, **kwargs)
    other = state.inventory.get_host(name)
    cache = vars(other).setdefault("_gpuhost_planned_facts", {})
    key = (cls, _key(kwargs))
    if key not in cache:
        cache[key] = other.get_fact(cls, **kwargs)
    return cache[key]


def is_dry_run() -> bool:
    """Whether pyinfra was started with --dry. pyinfra gives deploy code no such flag: its
    command line is the only source."""
    return "--dry" in sys.argv[1:]


def refuse(stage: str, reason: str) -> None:
    """Refuse a stage on the current host: print the reason now (visible in --dry) and stop
    a real run at the end of planning."""
    _refusals[host.name].append(f"{stage}: {reason}")
    logger.warning(f"{host.print_prefix}{stage}: refused: {reason}")


def planned_changes() -> int:
    """How many of the current host's planned operations pyinfra counts as changes (its plan
    table's "Change" and "Conditional Change" columns: ``_maybe_is_change``)."""
    ops = state.ops.get(host._get_module(), {})
    return sum(1 for op in ops.values() if op.operation_meta._maybe_is_change)


#: Said once in --dry, before pyinfra's plan table (pyinfra_cli/prints.py print_meta: an
#: operation whose ``_if`` names earlier operations is counted under "Conditional Change").
COLUMNS_SAID: Final = ('--dry: in the table below, "Change" counts the hosts where an '
                       'operation will change something; "Conditional Change" counts those '
                       'where it runs only if an earlier operation of the run changes '
                       'something (a reload after a changed unit, a restart after a changed '
                       'input, the health gate after a restart): with nothing else changing, '
                       'it does nothing.')
_columns_said: list[bool] = []


def say_plan_columns() -> None:
    """In --dry, once a run: what the plan table's two columns count."""
    if is_dry_run() and not _columns_said:
        _columns_said.append(True)
        logger.info(COLUMNS_SAID)


def stop_if_refused() -> None:
    """Take the host out of the run, with its refusals on screen; in a dry run (which only
    shows them, with the rest of the host's plan) the host only counts as failed, so that
    --dry exits non-zero too. Called at the end of deploy.py, before anything executes; the
    other hosts go on."""
    say_plan_columns()
    refusals = _refusals.get(host.name)
    if not refusals:
        return
    if is_dry_run():
        planned = planned_changes()
        shown = (f"\n  The table below still counts {host.name} under the {planned} "
                 "operation(s) it planned: they are what a run would do once the above is put "
                 "right; none of them happens while it stands." if planned else "")
        logger.error(f"{host.print_prefix}host {host.name}: a real run would change nothing, "
                     "because:\n  - " + "\n  - ".join(refusals) + shown)
        # pyinfra's CLI exits 1 when state.failed_hosts is not empty (_exit in
        # pyinfra_cli/cli.py, pyinfra 3.x); the host stays active, its whole plan shown
        state.failed_hosts.add(host._get_module())
        return
    logger.error(f"{host.print_prefix}host {host.name}: nothing was changed, because:\n  - "
                 + "\n  - ".join(refusals))
    this = host._get_module()
    if state.active_hosts - {this}:
        state.fail_hosts({this})
        return
    # The last host left: pyinfra's fail_hosts would raise "No hosts remaining!" (State.
    # fail_hosts, pyinfra 3.x), shown as an error in this file. Taken out by hand instead, the
    # run executes nothing and pyinfra's CLI exits 1 because failed_hosts is not empty.
    state.failed_hosts.add(this)
    state.active_hosts.discard(this)

