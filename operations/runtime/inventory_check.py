"""Check the pyinfra command line's inventory while pyinfra loads it: a host given twice with
different data, and a ``--limit`` that matches no host.

pyinfra merges every entry of one host name into one host (``Inventory.make_hosts_and_groups``
in pyinfra/api/inventory.py: ``name_to_data[name].update(data)``), so of two entries setting one
key the last silently wins; and a ``--limit`` that matches nothing only logs "No host matches
found" (``_get_inventory_pattern_matches`` in pyinfra_cli/cli.py), runs on no host and exits 0.
Both are seen here, from group_data/all.py, which pyinfra executes while it builds the inventory
(``make_inventory_from_files`` in pyinfra_cli/inventory.py), before it connects to any host.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from operations.runtime.run_exit import end_run

#: Host data keys whose values are not shown in a message (pyinfra's ssh_password and the like).
_SECRET_KEY = re.compile(r"password|secret|token", re.IGNORECASE)


class InventoryError(Exception):
    """An inventory or --limit that would run on other hosts or data than written."""


def command_line(argv: Sequence[str]) -> tuple[str | None, tuple[str, ...]]:
    """The inventory argument and the ``--limit`` patterns of a pyinfra command line, as
    pyinfra's own click command parses it (pyinfra_cli/cli.py), without running anything.
    ``(None, ())`` when ``argv`` is not a pyinfra command line that parses."""
    try:
        from pyinfra_cli.cli import cli
        ctx = cli.make_context("pyinfra", list(argv), resilient_parsing=True)
    except Exception:  # not pyinfra's command line (a test runner, a script)
        return None, ()
    return ctx.params.get("inventory"), tuple(ctx.params.get("limit") or ())


def _show(key: str, value: Any) -> str:
    return f"{key} = <hidden>" if _SECRET_KEY.search(str(key)) else f"{key} = {value!r}"


def duplicate_hosts(groups: Mapping[str, Any], source: str) -> list[str]:
    """One message per host name given more than once in ``groups`` (an inventory file's
    module-level lists: ``[name | (name, data)]`` or ``([...], group data)``) with a key set to
    different values, naming the host, both entries (group and position) and the key.

    + groups: the inventory's groups, as pyinfra reads them from the file
    + source: the inventory file, for messages
    """
    seen: dict[str, list[tuple[str, dict]]] = {}
    for group, members in groups.items():
        if isinstance(members, tuple):
            members = members[0]
        if not isinstance(members, list):
            continue
        for position, entry in enumerate(members, start=1):
            if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], Mapping):
                name, data = entry
            elif isinstance(entry, str):
                name, data = entry, {}
            else:
                continue
            seen.setdefault(str(name), []).append((f"group {group} entry {position}", dict(data)))
    problems = []
    for name, entries in seen.items():
        for i, (where_a, data_a) in enumerate(entries):
            for where_b, data_b in entries[i + 1:]:
                clash = [k for k in data_a if k in data_b and data_a[k] != data_b[k]]
                if clash:
                    key = clash[0]
                    problems.append(
                        f"host {name} is given twice in {source} with different data: "
                        f"{where_a} sets {_show(key, data_a[key])}, {where_b} sets "
                        f"{_show(key, data_b[key])}"
                        + (f" (and {len(clash) - 1} more keys)" if len(clash) > 1 else "")
                        + "; pyinfra would silently take the last: give each host once")
    return problems


def unmatched_limits(limits: Sequence[str], names: Sequence[str],
                     groups: Mapping[str, Sequence[str]]) -> list[str]:
    """The ``--limit`` patterns that match no host, as pyinfra matches them: a group's name,
    else an fnmatch pattern on host names (``_get_inventory_pattern_matches``)."""
    return [p for p in limits
            if not groups.get(p) and not any(fnmatch(n, p) for n in names)]


def check(argv: Sequence[str] | None = None) -> None:
    """Raise SystemExit with every problem of the command line's inventory (a host given twice
    with different data, a --limit matching no host); nothing when there is none, or when
    ``argv`` (default ``sys.argv[1:]``) is not a pyinfra run on an inventory file. Called from
    group_data/all.py while pyinfra loads the inventory: SystemExit leaves pyinfra's loader
    unwrapped (it wraps Exception), so the user sees the message and no traceback, exit 1."""
    inventory_arg, limits = command_line(sys.argv[1:] if argv is None else argv)
    if inventory_arg is None:
        return
    problems: list[str] = []
    path = Path(inventory_arg)
    if path.is_file() and path.suffix == ".py":
        from pyinfra_cli.inventory import _get_groups_from_filename
        problems += duplicate_hosts(_get_groups_from_filename(str(path)), inventory_arg)
    if limits:
        from pyinfra import inventory
        from pyinfra.context import ctx_inventory
        if ctx_inventory.isset():
            names = [h.name for h in inventory]
            groups = {g: [h.name for h in hosts] for g, hosts in inventory.groups.items()}
            for pattern in unmatched_limits(limits, names, groups):
                problems.append(f"--limit {pattern} matches no host of {inventory_arg} (hosts: "
                                f"{', '.join(names) or 'none'}; groups: "
                                f"{', '.join(sorted(groups)) or 'none'}): nothing would run")
    if problems:
        end_run("gpuhost: the inventory is refused, no host was touched:\n  - "
                + "\n  - ".join(problems))
