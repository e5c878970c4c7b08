"""Each fact read once per host and run, until the host runs something that may change it.

pyinfra 3 keeps no facts: ``Host.get_fact`` runs the fact's command at every call
(``pyinfra/api/facts.py``, ``_get_fact``; pyinfra 3.10), and a deploy reads many facts more
than once: ``dpkg -l`` by each apt operation, a folder's ``stat`` by each file put in it, a fact
while planning and again when its operation executes. Here a fact's value is kept per host,
fact class and arguments; the host's kept values are dropped as soon as the host runs a command
that is not a fact's own (an operation's command, a callback's ``run_shell_command``) or
receives a file (``put_file``): whatever that did, the next reading is the host's own again.
A dry run executes nothing, so it reads what a real run's planning reads.

Each caller gets a copy of the value (pyinfra's own operations may change the dict a fact
returned, ``operations/util/packaging.py``), as a second reading would give it.

Facts a run will read can be announced (``expect``): the first of them that is not kept reads
every announced fact not kept in one command (``operations/runtime/fact_batch.py``), so a host that
changed nothing answers them all at once, and one that changed answers them again at once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from typing import Any

from pyinfra.api import host as host_module
from pyinfra.api.host import Host
from pyinfra.api.state import StateStage

from operations.runtime import fact_batch

#: What one host's cache holds: (fact class, its arguments) -> the value read.
_FACTS = "_gpuhost_facts"
#: The facts announced for one host: key -> (fact class, its arguments by name).
_EXPECTED = "_gpuhost_expected_facts"
#: The facts announced for one host's planning only (``expect_while_planning``), as _EXPECTED.
_EXPECTED_PLANNING = "_gpuhost_expected_while_planning"
#: The announced facts a batch tried since the host's facts were last dropped: one that did
#: not answer there (its command failed) is read alone, not batched again.
_TRIED = "_gpuhost_tried_facts"
#: How deep the host is in reading facts (a short fact reads its parent).
_READING = "_gpuhost_reading_fact"


def _key(value: Any) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _key(v)) for k, v in value.items()))
    hash(value)  # TypeError for a value no key can hold: that reading is not kept
    return value


def _arguments(cls: Any, args: Any, kwargs: Any) -> Hashable:
    """The fact's arguments by name, however they were given (pyinfra merges them so too,
    ``_handle_fact_kwargs``); pyinfra's own ``_``-prefixed arguments apart."""
    given = dict(kwargs or {})
    own = {k: given.pop(k) for k in list(given) if k.startswith("_")}
    try:
        named = fact_batch.named_arguments(cls, args or (), given)
    except TypeError:
        named = {"args": args, **given}
    return _key(named), _key(own)


def _cache_key(cls: Any, args: Any, kwargs: Any, rest: Any) -> Hashable | None:
    try:
        return (cls, _arguments(cls, args, kwargs), _key(rest))
    except TypeError:
        return None


def expect(host: Host, cls: Any, **fact_kwargs: Any) -> None:
    """Announce that ``host`` will read ``cls`` with ``fact_kwargs`` in this run."""
    key = _cache_key(cls, (), fact_kwargs, {})
    if key is not None:
        vars(host).setdefault(_EXPECTED, {})[key] = (cls, fact_kwargs)


def expect_while_planning(host: Host, cls: Any, **fact_kwargs: Any) -> None:
    """Announce that ``host``'s planning will read ``cls`` with ``fact_kwargs``: while
    executing, the fact is no longer read with the others (a value read while planning is
    still served until the host runs a command), so a run that changes the host does not read
    every planning fact again after each change."""
    key = _cache_key(cls, (), fact_kwargs, {})
    if key is not None:
        vars(host).setdefault(_EXPECTED_PLANNING, {})[key] = (cls, fact_kwargs)


def _expected(state: Any, host: Host) -> dict[Hashable, Any]:
    expected = dict(vars(host).get(_EXPECTED, {}))
    if getattr(state, "current_stage", None) != StateStage.Execute:
        expected = {**vars(host).get(_EXPECTED_PLANNING, {}), **expected}
    return expected


def _read_expected(state: Any, host: Host, cls: Any, args: Any, kwargs: Any) -> None:
    """Read every announced fact of ``host`` not kept, in one batch, and keep the answers."""
    kept = vars(host).setdefault(_FACTS, {})
    tried = vars(host).setdefault(_TRIED, set())
    pending = [(key, wanted) for key, wanted in _expected(state, host).items()
               if key not in kept and key not in tried]
    if len(pending) < 2 or not host.connected:
        return
    tried.update(key for key, _ in pending)
    connector_kwargs = fact_batch.connector_arguments(state, host, cls, args, kwargs)
    vars(host)[_READING] = vars(host).get(_READING, 0) + 1
    try:
        values = fact_batch.read(state, host, [wanted for _, wanted in pending],
                                 connector_kwargs)
    finally:
        vars(host)[_READING] -= 1
    for index, value in values.items():
        kept[pending[index][0]] = copy.deepcopy(value)


def read_expected(state: Any, host: Host, cls: Any, args: Any = None,
                  kwargs: Any = None) -> None:
    """Read the announced facts of ``host`` not kept now, in one batch, with the connector
    arguments a reading of ``cls`` would have."""
    _read_expected(state, host, cls, args, kwargs)


def forget(host: Host) -> None:
    """Drop what is kept of ``host``'s facts."""
    vars(host).pop(_FACTS, None)
    vars(host).pop(_TRIED, None)


def drop(host: Host, which: Callable[[Any], bool]) -> None:
    """Drop what is kept of ``host``'s facts of the classes ``which`` is true of; a batch tried
    them, so their next reading is a command of their own, with its own arguments."""
    kept = vars(host).get(_FACTS, {})
    for key in [key for key in kept if which(key[0])]:
        del kept[key]


def install() -> None:
    """Keep facts for this run (idempotent): wraps the ``get_fact`` that ``Host.get_fact``
    calls and the Host methods that run commands and send files."""
    if getattr(host_module, "_gpuhost_fact_cache", False):
        return
    read, run, put = host_module.get_fact, Host.run_shell_command, Host.put_file

    def get_fact(state: Any, host: Host, cls: Any, args: Any = None, kwargs: Any = None,
                 **rest: Any) -> Any:
        key = _cache_key(cls, args, kwargs, rest)
        kept = vars(host).setdefault(_FACTS, {})
        if key is not None and key not in kept and key in _expected(state, host) \
                and key not in vars(host).get(_TRIED, ()):
            _read_expected(state, host, cls, args, kwargs)
        if key is not None and key in kept:
            return copy.deepcopy(kept[key])
        vars(host)[_READING] = vars(host).get(_READING, 0) + 1
        try:
            value = read(state, host, cls, args=args, kwargs=kwargs, **rest)
        finally:
            vars(host)[_READING] -= 1
        if key is not None:
            vars(host).setdefault(_FACTS, {})[key] = copy.deepcopy(value)
        return value

    def run_shell_command(self: Host, *args: Any, **kwargs: Any) -> Any:
        if not vars(self).get(_READING):
            forget(self)
        try:
            return run(self, *args, **kwargs)
        finally:
            if not vars(self).get(_READING):
                forget(self)  # what the command changed shows only once it ended

    def put_file(self: Host, *args: Any, **kwargs: Any) -> Any:
        forget(self)
        try:
            return put(self, *args, **kwargs)
        finally:
            forget(self)

    host_module.get_fact = get_fact
    Host.run_shell_command = run_shell_command  # type: ignore[method-assign]
    Host.put_file = put_file  # type: ignore[method-assign]
    host_module._gpuhost_fact_cache = True  # type: ignore[attr-defined]
