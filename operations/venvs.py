"""Manage the ML venvs side by side: one per lock digest under /opt/gpuhost/venvs, and the link
at gpuhost_venv_path that names the one the server was last verified with.

A new lock gets a venv of its own, built and checked beside the one the server runs from, so
the server keeps serving until the restart; the unit names the digest's venv itself (not the
link), so a running server never imports from a venv it did not start with, and a change of
venv is a change of the unit (one restart). The link at ``gpuhost_venv_path`` (default
/opt/gpuhost/venv) is moved to the new venv only once the health gate has passed: operators,
bench.py and anything else that reads the link always get a venv that served.

Taking over a host converged by an earlier gpuhost, whose real venv sits at gpuhost_venv_path:
a venv is not relocatable (its scripts' shebangs and pyvenv.cfg's ``home``/``command`` name
its folder; CPython's Lib/venv/__init__.py writes both at creation), so it is neither moved nor
renamed. The lock's venv is built beside it under /opt/gpuhost/venvs while the server goes on
serving from the old one; flash-attn is not built again there: the controller's cache holds
the wheel for the same key (flash-attn, torch, CUDA, Python, architectures;
operations/flash_attn.py), which the earlier build put there, and the host's pip cache serves
the locked wheels it already downloaded. The unit then names the new venv (one restart, as
any venv change); until the health gate passes the old venv stays where it was (a failed
gate leaves the unit's previous text, pointing at it). Once the gate passes, the old folder is
removed and the link takes its place. Only a folder that is a venv and holds nothing a venv
does not (:func:`link_problem`) is removed that way; anything else there is refused while
planning.
"""

from __future__ import annotations

import hashlib
import shlex
from functools import cache
from pathlib import Path
from typing import Final

from pyinfra import host
from pyinfra.api import operation
from pyinfra.api.exceptions import OperationError

from operations.lock import Lock, read_lock
from operations.venv_path import VenvHealth, foreign_entries

#: The venvs, one folder per lock digest (settings.GPUHOST_DIRS lists it).
VENVS_DIR: Final = "/opt/gpuhost/venvs"
#: Hex digits of the lock's sha256 in a venv's folder name (64 bits: no two locks of a fleet
#: meet by chance).
DIGEST_CHARS: Final = 16


def lock_digest(lock: Lock) -> str:
    """The lock's digest: sha256 of its pins as pip reads them (name, version, hashes, in file
    order), its first :data:`DIGEST_CHARS` hex digits. Comments and the header do not count:
    a lock regenerated to the same pins keeps its venv."""
    text = "".join(pin.line + "\n" for pin in lock.pins)
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


@cache
def _digest_of(lock_path: Path) -> str:
    return lock_digest(read_lock(lock_path))


def stack_venv(lock_path: Path) -> str:
    """The folder of the venv for the lock at ``lock_path`` on the controller:
    ``/opt/gpuhost/venvs/<digest>``. Raises LockError for a lock that does not parse."""
    return f"{VENVS_DIR}/{_digest_of(lock_path)}"


def link_problem(path: str, health: VenvHealth) -> str | None:
    """Why gpuhost_venv_path (``path``, as :class:`operations.mlenv.VenvRuns` read it) cannot
    become the link to the serving venv, or None. A symlink is replaced (its target is left
    alone), an empty folder and a venv of an earlier gpuhost are removed first; refused: a file,
    a device or the like, a folder that is not a venv and holds anything, a venv holding what a
    venv does not (:func:`operations.venv_path.foreign_entries`), nothing there with no folder
    above."""
    key = f"gpuhost_venv_path = {path!r} is not allowed"
    allowed = ("a missing path, a symlink, an empty folder, or a venv holding only what a venv "
               "does")
    found = health["found"]
    if found == "missing":
        if health["above_found"] != "folder":
            return (f"{key}: {health['above']}, above it, is not a folder; allowed: {allowed} "
                    "under a folder")
        return None
    if found == "link":
        return None
    if found in ("file", "other"):
        return (f"{key}: it is a {'file' if found == 'file' else 'device, fifo or socket'}, and "
                f"gpuhost puts a link to the serving venv there; allowed: {allowed}")
    foreign = foreign_entries(health)
    unlisted = health["entry_count"] - len(health["entries"])
    if not health["is_venv"] and health["entry_count"]:
        foreign = health["entries"]
    if foreign or unlisted > 0:
        return (f"{key}: it is a folder holding what a venv does not "
                f"({', '.join(foreign[:8]) or f'{unlisted} entries not listed'}), and gpuhost "
                f"replaces it with a link to the serving venv under {VENVS_DIR}; allowed: "
                f"{allowed}: move those out, or set gpuhost_venv_path to another path")
    return None


@operation()
def venv_link(path: str, target: str, health: VenvHealth):
    """The symlink at ``path`` (gpuhost_venv_path) to ``target``, the venv that serves.

    + path: gpuhost_venv_path
    + target: the venv's folder under VENVS_DIR
    + health: what was at ``path`` while planning (:class:`operations.mlenv.VenvRuns`)

    The link is replaced atomically (a new link renamed over it, rename(2)); a venv of an
    earlier gpuhost there is removed first (see the module's docstring). Raises OperationError
    where :func:`link_problem` refuses (planning refuses it first).
    """
    problem = link_problem(path, health)
    if problem:
        raise OperationError(f"{problem}: left alone")
    if health["found"] == "link" and health["target"] == target:
        host.noop(f"{path} links to {target}")
        return
    q, t = shlex.quote(path), shlex.quote(target)
    if health["found"] == "folder":
        yield f"rm -rf --one-file-system {q}"
    yield f"ln -sfnT {t} {q}.gpuhost-new && mv -fT {q}.gpuhost-new {q}"
