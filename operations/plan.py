"""Refusals found while planning: a stage that must not run on a host says why, the rest of the
plan is still shown, and a real run stops before any change."""

from __future__ import annotations

import sys
from collections import defaultdict

from pyinfra import host, logger, state
from pyinfra.api.exceptions import PyinfraError

_refusals: dict[str, list[str]] = defaultdict(list)


class PlanError(PyinfraError):
    """A host whose state forbids the planned change; the message says what to do."""


def is_dry_run() -> bool:
    """Whether pyinfra was started with --dry. pyinfra gives deploy code no such flag: its
    command line is the only source."""
    return "--dry" in sys.argv[1:]


def refuse(stage: str, reason: str) -> None:
    """Refuse a stage on the current host: print the reason now (visible in --dry) and stop
    a real run at the end of planning."""
    _refusals[host.name].append(f"{stage}: {reason}")
    logger.warning(f"{host.print_prefix}{stage}: refused: {reason}")


def stop_if_refused() -> None:
    """Take the host out of the run, with its refusals on screen, unless this is a dry run
    (which only shows them). Called at the end of deploy.py, before anything executes; the
    other hosts go on, and pyinfra exits non-zero when no host is left."""
    refusals = _refusals.get(host.name)
    if refusals and not is_dry_run():
        logger.error(f"{host.print_prefix}host {host.name}: nothing was changed, because:\n  - "
                     + "\n  - ".join(refusals))
        state.fail_hosts({host})
