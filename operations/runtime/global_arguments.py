"""pyinfra's global arguments listed once per run, not at every operation and fact reading.

pyinfra 3.10's ``all_global_arguments()`` evaluates ``typing.get_type_hints(AllArguments)`` at
each call (``pyinfra/api/arguments.py``): ``pop_global_arguments`` calls it for every operation
and host, ``_handle_fact_kwargs`` (``pyinfra/api/facts.py``) for every fact reading; about 300
calls per host on a converged host's no-op, 0.36 ms each here (0.1 s of controller CPU per
host), and ``FactBase.__init_subclass__`` for every fact class defined (130 as a deploy imports
its modules, about 0.05 s: operations/__init__.py installs this before they are defined).
``AllArguments`` is a fixed class: the list is the same at every call, and
:func:`install` has both modules answer it from one reading (a fresh list each call, as before).
"""

from __future__ import annotations

import importlib
from typing import Any

#: The modules that call it.
_MODULES = ("pyinfra.api.arguments", "pyinfra.api.facts")
#: pyinfra's own, as imported before any install.
pyinfra_own = importlib.import_module("pyinfra.api.arguments").all_global_arguments


def install() -> None:
    """Have pyinfra list its global arguments once (idempotent)."""
    arguments = importlib.import_module("pyinfra.api.arguments")
    if getattr(arguments.all_global_arguments, "_gpuhost_listed", False):
        return
    listed = tuple(pyinfra_own())

    def all_global_arguments() -> list[tuple[str, Any]]:
        return list(listed)

    all_global_arguments._gpuhost_listed = True  # type: ignore[attr-defined]
    for name in _MODULES:
        importlib.import_module(name).all_global_arguments = all_global_arguments
