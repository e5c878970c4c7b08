"""Read a pinned ML stack: a pip requirements lock with hashes (``uv pip compile
--generate-hashes`` output, see locks/README.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name


class LockError(ValueError):
    """A lock file that is missing or does not parse; names the file and the line."""


@dataclass(frozen=True)
class Pin:
    """One locked distribution: canonical ``name``, exact ``version``, its ``hashes``
    ("sha256:<hex>") and its requirement ``line`` as pip reads it."""

    name: str
    version: str
    hashes: tuple[str, ...]
    line: str


@dataclass(frozen=True)
class Lock:
    """A parsed lock: its path, header comments and pins in file order."""

    path: Path
    header: tuple[str, ...]
    pins: tuple[Pin, ...]

    @property
    def python_version(self) -> str | None:
        """The Python version ("3.12") the lock was resolved for, as its header names it: the
        ``--python-version X.Y`` of the ``uv pip compile`` command that made it (tools/lock.py
        writes that command into the header, "which runs: uv pip compile ... --python-version
        3.12 ..."). None when the header names none."""
        for line in self.header:
            found = re.search(r"--python-version[= ](\d+\.\d+)\b", line)
            if found:
                return found.group(1)
        return None

    def get(self, name: str) -> Pin | None:
        wanted = canonicalize_name(name)
        return next((p for p in self.pins if p.name == wanted), None)

    def versions(self) -> dict[str, str]:
        return {p.name: p.version for p in self.pins}

    def requirements(self, exclude: tuple[str, ...] = ()) -> str:
        """The lock as a requirements file for ``pip install --require-hashes``, without the
        named distributions."""
        skip = {canonicalize_name(n) for n in exclude}
        return "".join(p.line + "\n" for p in self.pins if p.name not in skip)


def read_lock(path: Path) -> Lock:
    """Parse a lock file.

    Every requirement must be pinned with ``==`` and carry at least one ``--hash``.
    Raises :class:`LockError` naming the file and the first bad line.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LockError(f"lock {path}: cannot read it: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise LockError(f"lock {path}: not UTF-8 text (byte {exc.start})") from exc
    header: list[str] = []
    logical: list[tuple[int, str]] = []
    buffer, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            if line.startswith("#") and not logical:
                header.append(line)
            continue
        if not buffer:
            start = number
        line = re.sub(r"\s+#.*$", "", line)
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        logical.append((start, buffer + line))
        buffer = ""
    if buffer:
        logical.append((start, buffer))

    pins = []
    for number, entry in logical:
        parts = entry.split()
        hashes = tuple(p.split("=", 1)[1] for p in parts if p.startswith("--hash="))
        spec = " ".join(p for p in parts if not p.startswith("--hash="))
        try:
            req = Requirement(spec)
        except InvalidRequirement as exc:
            raise LockError(f"lock {path} line {number}: {spec!r} is not a requirement") from exc
        versions = [s.version for s in req.specifier if s.operator in ("==", "===")]
        if len(versions) != 1 or len(req.specifier) != 1:
            raise LockError(f"lock {path} line {number}: {spec!r} is not pinned with ==")
        if not hashes:
            raise LockError(f"lock {path} line {number}: {req.name} has no --hash")
        line = " ".join([spec, *(f"--hash={h}" for h in hashes)])
        pins.append(Pin(canonicalize_name(req.name), versions[0], hashes, line))
    if not pins:
        raise LockError(f"lock {path}: no requirements in it")
    return Lock(path, tuple(header), tuple(pins))
