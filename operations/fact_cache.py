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
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Hashable
from typing import Any

from pyinfra.api import host as host_module
from pyinfra.api.host import Host

#: What one host's cache holds: (fact class, its arguments) -> the value read.
_FACTS = "_gpuhost_facts"
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
        named = inspect.getcallargs(cls().command, *(args or ()), **given)
    except TypeError:
        named = {"args": args, **given}
    named.pop("self", None)
    return _key(named), _key(own)


def forget(host: Host) -> None:
    """Drop what is kept of ``host``'s facts."""
    vars(host).pop(_FACTS, None)


def install() -> None:
    """Keep facts for this run (idempotent): wraps the ``get_fact`` that ``Host.get_fact``
    calls and the Host methods that run commands and send files."""
    if getattr(host_module, "_gpuhost_fact_cache", False):
        return
    read, run, put = host_module.get_fact, Host.run_shell_command, Host.put_file

    def get_fact(state: Any, host: Host, cls: Any, args: Any = None, kwargs: Any = None,
                 **rest: Any) -> Any:
        try:
            key: Hashable | None = (cls, _arguments(cls, args, kwargs), _key(rest))
        except TypeError:
            key = None
        kept = vars(host).setdefault(_FACTS, {})
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
