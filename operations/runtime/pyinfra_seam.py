"""What gpuhost replaces of pyinfra's internals, in one table, and the check that the installed
pyinfra still has each of them as gpuhost was written against.

Six modules patch pyinfra at run time (each says why in its own docstring): the fact cache
and the planned facts (``get_fact``, ``Host.run_shell_command``, ``Host.put_file``), the link
watch (``Host.run_shell_command``, ``put_file``, ``get_file``), the call order
(``get_operation_order_from_stack``), the global arguments (``all_global_arguments``) and the
shipped files (the ``files`` operations' reads). Those symbols are pyinfra's, not its public
API, so pyproject pins ``pyinfra>=3.10,<3.11``; a pyinfra outside that pin, or one whose patched
symbol lost a parameter gpuhost passes or reads, is said here in one line naming the symbol,
before any patch is installed and before any host is touched, instead of failing a deploy
half way. Read in pyinfra 3.10.0's source: pyinfra/api/host.py (``get_fact``, ``Host``),
pyinfra/api/operation.py, pyinfra/api/arguments.py, pyinfra/api/facts.py,
pyinfra/operations/files.py.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: pyproject.toml's pin (tests/test_pyinfra_seam.py holds the two the same).
PIN: Final = ">=3.10,<3.11"


@dataclass(frozen=True)
class Patched:
    """One symbol of pyinfra that gpuhost replaces or wraps.

    + module, name: where it lives (``Host.put_file``: an attribute of a class)
    + by: the gpuhost modules that patch it
    + parameters: the parameter names gpuhost's replacement passes on or reads (a ``*args`` or
      ``**kwargs`` of pyinfra's satisfies none of them by name; ``()``: only that it exists)
    """

    module: str
    name: str
    by: str
    parameters: tuple[str, ...] = ()

    @property
    def symbol(self) -> str:
        return f"{self.module}.{self.name}"

    def resolve(self) -> Any:
        """The symbol as pyinfra has it (AttributeError or ImportError where it has none)."""
        found: Any = importlib.import_module(self.module)
        for part in self.name.split("."):
            found = getattr(found, part)
        return found


_FILES_READ = "operations/runtime/shipped_files.py (announces each operation's reads)"

#: Every patch, by symbol.
PATCHED: Final = (
    Patched("pyinfra.api.host", "get_fact",
            "operations/runtime/fact_cache.py, operations/runtime/planned_facts.py",
            ("state", "host", "cls", "args", "kwargs")),
    Patched("pyinfra.api.host", "Host.run_shell_command",
            "operations/runtime/fact_cache.py, operations/runtime/link.py"),
    Patched("pyinfra.api.host", "Host.put_file",
            "operations/runtime/fact_cache.py, operations/runtime/link.py"),
    Patched("pyinfra.api.host", "Host.get_file", "operations/runtime/link.py"),
    Patched("pyinfra.api.operation", "get_operation_order_from_stack",
            "operations/runtime/call_order.py", ("state",)),
    Patched("pyinfra.api.arguments", "all_global_arguments",
            "operations/runtime/global_arguments.py"),
    Patched("pyinfra.api.facts", "all_global_arguments",
            "operations/runtime/global_arguments.py"),
    Patched("pyinfra.operations.files", "put", _FILES_READ, ("src", "dest")),
    Patched("pyinfra.operations.files", "template", _FILES_READ, ("src", "dest")),
    Patched("pyinfra.operations.files", "file", _FILES_READ, ("path", "present")),
    Patched("pyinfra.operations.files", "directory", _FILES_READ, ("path", "present")),
)


def version_problem(installed: str | None) -> str | None:
    """Why pyinfra ``installed`` is not one gpuhost's patches were written against, or None."""
    if installed is None:
        return "pyinfra is not installed"
    try:
        within = SpecifierSet(PIN).contains(Version(installed), prereleases=True)
    except InvalidVersion:
        within = False
    if within:
        return None
    return (f"pyinfra {installed} is installed; gpuhost patches pyinfra's internals as pyinfra "
            f"{PIN} has them (operations/runtime/pyinfra_seam.py lists each): install "
            f"'pyinfra{PIN}' (bin/setup does)")


def symbol_problem(patched: Patched) -> str | None:
    """Why ``patched`` cannot be patched in the installed pyinfra, or None."""
    try:
        found = patched.resolve()
    except (ImportError, AttributeError):
        return f"{patched.symbol} is gone from the installed pyinfra (patched by {patched.by})"
    if not patched.parameters:
        return None
    try:
        names = set(inspect.signature(found).parameters)
    except (TypeError, ValueError):
        return f"{patched.symbol} has no signature to read (patched by {patched.by})"
    missing = [p for p in patched.parameters if p not in names]
    if missing:
        return (f"{patched.symbol} has no parameter {', '.join(missing)} in the installed "
                f"pyinfra (patched by {patched.by}, which passes or reads it)")
    return None


def problems() -> list[str]:
    """Every reason the installed pyinfra does not fit the patches: its version, then each
    symbol's (a version outside the pin is said even where every symbol still fits)."""
    try:
        installed: str | None = version("pyinfra")
    except PackageNotFoundError:
        installed = None
    said = [p for p in [version_problem(installed)] if p]
    return said + [p for p in map(symbol_problem, PATCHED) if p]


#: :func:`problems` as read when the operations package was imported, before its first patch
#: (operations/__init__.py, which ends the run with them, whatever the run file).
SEEN: list[str] = []


def read_before_patching() -> list[str]:
    """Read :func:`problems` into :data:`SEEN` (once: the patches are in place afterwards, and
    a patched symbol is gpuhost's own)."""
    if not getattr(read_before_patching, "_done", False):
        SEEN[:] = problems()
        read_before_patching._done = True  # type: ignore[attr-defined]
    return SEEN
