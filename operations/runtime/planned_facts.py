"""The facts a host's run read last time, kept on the controller and read in one command at
the start of the next run's planning.

deploy.py's stages read their facts one after the other as they plan (``plan.fact``, the
stages' ``host.get_fact``), each a command of its own: 37 on a converged sandbox host. Which
facts those are (fact class and arguments, never their answers) is written at the end of the
host's planning to ``<cache>/gpuhost/planned-facts/<host>-<digest>.json`` on the controller;
the next run announces them to the fact cache (``fact_cache.expect_while_planning``) at its
first planning reading and reads them all there in one command
(``operations/runtime/fact_batch.py``: each fact's own command and parser). Every decision is still
made from what the host answers in this run; the record only says what to ask at once. A fact the
record lacks is read alone (and recorded for the next run); one the plan no longer reads costs its
share of the one command. The fact cache's rules stand: any command or file sent to the host drops
the kept answers; while planning the recorded facts are then read again together at the next of
them, while executing each alone (a run that changes the host would otherwise read every planning
fact again after each change).

The facts operations read while executing (pyinfra's own, as ``apt-mark showhold`` or the
keyring's sha256) are recorded too (written once, when pyinfra disconnects from the host at
the run's end, not at each such reading), and read in the same command: on a host that changes
nothing no command runs between planning and them, so they are answered from it. Recorded
are readings by gpuhost's planning code (outside an operation's body: pyinfra's
``Host.in_op``, ``api/operation.py``; pyinfra 3.10) and readings in an operation's body while
executing whose connector arguments (sudo, user, shell...) are those of the planning
readings, so the one command reads each fact as a reading of its own would; none with
per-reading pyinfra arguments (``_sudo``...); and only facts whose arguments survive JSON
unchanged (a tuple is recorded as ``{"tuple": [...]}``) and whose class is a fact of a module
this run has imported. A record that is not such a list is ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from pyinfra import logger
from pyinfra.api import FactBase, ShortFactBase
from pyinfra.api import host as host_module
from pyinfra.api.host import Host
from pyinfra.api.state import BaseStateCallback, StateStage
from pyinfra.context import ctx_host

from operations import cache_root
from operations.runtime import fact_batch, fact_cache

#: The record's format: {"format": FORMAT, "facts": [{"fact": "module:Class", "arguments": {}}],
#: "executing": [...]}, the arguments by name, a tuple among them as {"tuple": [...]}.
FORMAT = 1
#: What one host holds in this run: the facts its planning read, in order (class, arguments).
_READ = "_gpuhost_planned_read"
#: The facts its operations read while executing in this run, and in the last (the record's).
_EXECUTED = "_gpuhost_planned_executed"
_PREVIOUS = "_gpuhost_planned_previous"
#: The connector arguments (sudo, user...) of the host's planning readings in this run.
_BASELINE = "_gpuhost_planned_connector_arguments"
#: Whether the host's record was announced in this run.
_ANNOUNCED = "_gpuhost_planned_announced"
#: Whether the host's operations read a fact while executing that its record does not hold yet.
_UNSAVED = "_gpuhost_planned_unsaved"


def record_dir() -> Path | None:
    """Where the records live on the controller (under :func:`operations.cache_root`); None
    where no home is known (no record: the run reads each fact alone)."""
    root = cache_root()
    return None if root is None else root / "planned-facts"


def record_path(host: Host) -> Path | None:
    """One file per host name and address: two labs may name their hosts alike."""
    folder = record_dir()
    if folder is None:
        return None
    address = str(host.data.get("ssh_hostname") or host.name)
    digest = hashlib.sha256(f"{host.name}\0{address}".encode()).hexdigest()[:12]
    return folder / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', host.name)}-{digest}.json"


def _fact_class(name: Any) -> Any:
    """The fact class a record names, from a module this run imported; None otherwise."""
    if not isinstance(name, str) or name.count(":") != 1:
        return None
    module_name, qualname = name.split(":")
    module = sys.modules.get(module_name)
    cls = getattr(module, qualname, None) if module and qualname.isidentifier() else None
    if isinstance(cls, type) and issubclass(cls, FactBase) and not issubclass(cls, ShortFactBase):
        return cls
    return None


def _entries(record: Any, key: str) -> list[dict[str, Any]]:
    """The record's entries under ``key`` that this run can read."""
    entries = record.get(key) if isinstance(record, dict) else None
    if not isinstance(entries, list):
        return []
    valid = []
    for entry in entries:
        cls = _fact_class(entry.get("fact")) if isinstance(entry, dict) else None
        arguments = _decode(entry.get("arguments")) if cls else None
        if cls and isinstance(arguments, dict) and all(isinstance(k, str) for k in arguments):
            named = _named(cls, (), arguments)
            if named is not None and _same(named, arguments):
                valid.append(entry)
    return valid


def load(host: Host) -> list[tuple[Any, dict[str, Any]]]:
    """The facts ``host``'s record names that this run can read (class, arguments): those its
    planning read, then those its operations read while executing."""
    path = record_path(host)
    try:
        # a FIFO or a device there would block the run or never end: only a regular file
        record = json.loads(path.read_text()) if path and path.is_file() else None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            return []
        executing = _entries(record, "executing")
        facts = _entries(record, "facts")
    except (OSError, ValueError, RecursionError):  # nested deeper than Python's stack
        return []
    vars(host)[_PREVIOUS] = executing
    return [(_fact_class(e["fact"]), _decode(e["arguments"])) for e in facts + executing]


def _encode(value: Any) -> Any:
    """JSON for a fact argument: a tuple as {"tuple": [...]} (JSON has only lists)."""
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if "tuple" in value or not all(isinstance(k, str) for k in value):
            raise TypeError("a dict argument JSON cannot hold as it is")
        return {k: _encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"{type(value).__name__} is no JSON")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"tuple"} and isinstance(value["tuple"], list):
            return tuple(_decode(v) for v in value["tuple"])
        return {k: _decode(v) for k, v in value.items()}
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same types throughout (1 and True, a list and a tuple differ)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _named(cls: Any, args: Any, kwargs: Any) -> dict[str, Any] | None:
    """The reading's fact arguments by name, if a record can hold them as they are."""
    try:
        named = fact_batch.named_arguments(cls, args or (), kwargs or {})
    except TypeError:  # another version's record: no such command, no such call
        return None
    try:
        if not _same(_decode(json.loads(json.dumps(_encode(named)))), named):
            return None
    except (TypeError, ValueError):
        return None
    return named


def _entry(cls: Any, args: Any, kwargs: Any) -> dict[str, Any] | None:
    if any(str(k).startswith("_") for k in (kwargs or {})) or issubclass(cls, ShortFactBase) \
            or _fact_class(f"{cls.__module__}:{cls.__qualname__}") is not cls:
        return None
    named = _named(cls, args, kwargs)
    if named is None:
        return None
    return {"fact": f"{cls.__module__}:{cls.__qualname__}", "arguments": _encode(named)}


def _note(host: Host, key: str, entry: dict[str, Any] | None) -> bool:
    read = vars(host).setdefault(key, [])
    if entry is None or entry in read:
        return False
    read.append(entry)
    return True


def _write(host: Host) -> None:
    vars(host).pop(_UNSAVED, None)
    executing = vars(host).get(_EXECUTED) or vars(host).get(_PREVIOUS, [])
    path = record_path(host)
    if path is None:
        return
    out = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False,
                                         suffix=".tmp") as out:
            json.dump({"format": FORMAT, "facts": vars(host).get(_READ, []),
                       "executing": executing}, out, indent=1)
            out.flush()
            os.fsync(out.fileno())  # whole or not at all: never a renamed, empty file
        os.replace(out.name, path)
    except OSError as error:  # only the next run's speed depends on it
        logger.debug(f"could not write {path}: {error}")
        if out is not None:  # a full disk: no half record left beside it
            with contextlib.suppress(OSError):
                os.unlink(out.name)


class _SaveAtDisconnect(BaseStateCallback):
    """Writes a host's record once more when pyinfra disconnects from it (at the end of the
    run, ``pyinfra_cli/cli.py`` ``disconnect_all`` in its ``finally``; before a reboot), if its
    operations read facts the record lacks: once, not at each of those readings."""

    @staticmethod
    def host_disconnect(state, host):
        if vars(host).get(_UNSAVED):
            _write(host)


def save() -> None:
    """Write the current host's record: the facts its planning read in this run (and those
    the last run's operations read while executing, until this run's read theirs); the facts
    its operations read while executing are written when the host is disconnected."""
    target = ctx_host.get()
    _write(target)
    handlers = target.state.callback_handlers
    if not any(isinstance(h, _SaveAtDisconnect) for h in handlers):
        target.state.add_callback_handler(_SaveAtDisconnect())


def install() -> None:
    """Record planning's readings and read the last run's at the first (idempotent); after
    ``fact_cache.install``, whose cache holds the answers."""
    if getattr(host_module, "_gpuhost_planned_facts", False):
        return
    read = host_module.get_fact

    def get_fact(state: Any, host: Host, cls: Any, args: Any = None, kwargs: Any = None,
                 **rest: Any) -> Any:
        planning = state.current_stage != StateStage.Execute and not host.in_op and not rest
        executing = state.current_stage == StateStage.Execute and host.in_op and not rest
        if planning and not vars(host).get(_ANNOUNCED):
            vars(host)[_ANNOUNCED] = True
            vars(host)[_BASELINE] = fact_batch.connector_arguments(state, host, cls, args,
                                                                   kwargs)
            for recorded, arguments in load(host):
                fact_cache.expect_while_planning(host, recorded, **arguments)
            fact_cache.read_expected(state, host, cls, args, kwargs)
        if planning:
            _note(host, _READ, _entry(cls, args, kwargs))
        elif executing and _BASELINE in vars(host) and vars(host)[_BASELINE] == \
                fact_batch.connector_arguments(state, host, cls, args, kwargs):
            if _note(host, _EXECUTED, _entry(cls, args, kwargs)):
                vars(host)[_UNSAVED] = True
        return read(state, host, cls, args=args, kwargs=kwargs, **rest)

    host_module.get_fact = get_fact
    host_module._gpuhost_planned_facts = True  # type: ignore[attr-defined]
