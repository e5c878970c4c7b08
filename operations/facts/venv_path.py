"""What is at the ML venv's path on the host, and whether a venv may be made or cleared there."""

from __future__ import annotations

import re
from typing import Final, TypedDict

#: What ``python3 -m venv`` makes in a venv's folder (CPython's Lib/venv/__init__.py,
#: ensure_directories and create_configuration: bin, include, lib, the lib64 symlink on 64-bit
#: POSIX, pyvenv.cfg; Python 3.13 adds .gitignore unless --without-scm-ignore-files, per its
#: venv documentation), and what pip installs beside them (share: distributions' data files,
#: the scheme's "data" path being the venv's base).
VENV_ENTRIES: Final = frozenset({"bin", "include", "lib", "lib64", "share", "pyvenv.cfg",
                                 ".gitignore"})
#: gpuhost's own files in a venv: flash_attn.STAMP_NAME ("gpuhost-flash-attn.json") and any
#: later stamp of the same shape.
GPUHOST_ENTRY: Final = re.compile(r"gpuhost-[a-z0-9-]+\.json")
#: Entries the fact lists at most; the count is given in full.
MAX_ENTRIES: Final = 50
#: How many foreign entries a refusal names.
NAMED: Final = 8


class VenvHealth(TypedDict):
    """What is at the venv's path and whether a venv there runs.

    + found: "missing", "folder", "file", "link" (a symlink) or "other" (a device, fifo, socket)
    + target, target_found: a symlink's target (readlink) and what it is: "folder", "file",
      "other", or "link" where it is dangling
    + above, above_found: where nothing is there, the nearest path above that exists and what
      it is (the venv is made under it)
    + entries, entry_count: a folder's entries (``ls -A``, sorted, nongraphic characters as
      ``?``; at most :data:`MAX_ENTRIES`) and how many it has in all
    + is_venv: whether pyvenv.cfg is there (only a venv is ever cleared)
    + state: "absent" (no bin/python and no pyvenv.cfg), "ok" (its python answers, and its
      pip's files are whole or ``pip --version`` answers), "broken" (``why`` says what
      failed), or "unchecked" where they were not started (``VenvAt``)
    """

    found: str
    target: str
    target_found: str
    above: str
    above_found: str
    entries: list[str]
    entry_count: int
    is_venv: bool
    state: str
    why: str


def foreign_entries(health: VenvHealth) -> list[str]:
    """The folder's entries a venv does not have (:data:`VENV_ENTRIES`, gpuhost's stamps)."""
    return [e for e in health["entries"]
            if e not in VENV_ENTRIES and not GPUHOST_ENTRY.fullmatch(e)]


def _named(names: list[str], total: int) -> str:
    shown = ", ".join(names[:NAMED])
    more = total - min(len(names), NAMED)
    return shown + (f" and {more} more" if more > 0 else "")


def venv_path_problem(path: str, health: VenvHealth) -> str | None:
    """Why no venv may be made, kept or cleared at ``path`` (gpuhost_venv_path), or None.

    Refused: a file, a dangling symlink, a device or the like there, or above it; a symlink
    whose venv does not run (``python3 -m venv`` makes no venv through a symlink: its
    ensure_directories raises "Unable to create directory", and with --clear only after
    emptying the target); a non-empty folder without pyvenv.cfg (not a venv: pip would
    install into it, --clear would empty it); a venv that does not run and so is to be cleared
    (``--clear`` removes every entry: venv's clear_directory) holding anything a venv does not
    have (:func:`foreign_entries`).
    """
    key = f"gpuhost_venv_path = {path!r} is not allowed"
    allowed = "a missing or empty folder, or a venv (with its pyvenv.cfg)"
    found = health["found"]
    if found == "missing":
        if health["above_found"] != "folder":
            return (f"{key}: {health['above']}, above it, is a {_what(health['above_found'])}, "
                    f"not a folder; allowed: {allowed} under a folder")
        return None
    if found in ("file", "other"):
        return f"{key}: it is a {_what(found)}; allowed: {allowed}"
    if found == "link":
        if health["target_found"] in ("missing", "link"):
            return (f"{key}: it is a symlink to {health['target']}, which does not exist; "
                    f"allowed: {allowed}")
        if health["target_found"] != "folder":
            return (f"{key}: it is a symlink to {health['target']}, a "
                    f"{_what(health['target_found'])}; allowed: {allowed}")
        if health["state"] != "ok":
            return (f"{key}: it is a symlink to {health['target']}, and python3 -m venv makes "
                    "no venv through a symlink (\"Unable to create directory\"); allowed: "
                    f"{allowed}: set it to {health['target']} itself")
    if not health["is_venv"] and health["entry_count"]:
        return (f"{key}: it is a folder that is not empty and has no pyvenv.cfg, so it is no "
                f"venv, and gpuhost would install into it (it holds "
                f"{_named(health['entries'], health['entry_count'])}); allowed: {allowed}: "
                "set it to another folder, or empty this one")
    if health["is_venv"] and health["state"] == "broken":
        foreign = foreign_entries(health)
        unlisted = health["entry_count"] - len(health["entries"])
        if foreign or unlisted > 0:
            return (f"{key}: the venv there does not run ({health['why']}) and would be "
                    f"cleared (python3 -m venv --clear empties the folder), but it holds what "
                    f"a venv does not: {_named(foreign, len(foreign) + max(unlisted, 0))}; "
                    f"allowed: a venv holding only {', '.join(sorted(VENV_ENTRIES))} and "
                    "gpuhost's stamps: move those out, or remove the venv")
    return None


def _what(found: str) -> str:
    return {"file": "file", "other": "device, fifo or socket, not a folder",
            "link": "dangling symlink", "missing": "missing path"}.get(found, found)
