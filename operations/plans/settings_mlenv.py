"""The ML stack's settings: the venv and its lock, flash-attn's build, upgrades, rollback, P2P."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from operations import REPO_ROOT
from operations.plans.settings_rules import (
    _BOOL,
    _PATH,
    _URL,
    _int_between,
    _is_int,
    _one_of,
    _Rule,
    _text,
    setting,
)

P2P_OVERRIDES: Final = ("on", "off")

#: Where a venv must not go: the system's own folders (pip would write into them).
_SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run",
                "/sbin", "/sys", "/usr", "/var/lib/dpkg", "/var/lib/apt", "/var/run", "/var/lock")
#: Folders that hold others' files and are never a venv themselves (the Filesystem Hierarchy
#: Standard 3.0, chapter 5, "/var": its subfolders; every top-level folder is refused by depth,
#: and /home/<user>, a user's home folder, by :func:`_is_venv_path`).
_SHARED_DIRS = ("/var/account", "/var/backups", "/var/cache", "/var/crash", "/var/games",
                "/var/lib", "/var/local", "/var/log", "/var/mail", "/var/opt", "/var/spool",
                "/var/tmp", "/var/www", "/var/yp")


def _is_venv_path(value: Any) -> bool:
    # No ":": python3 -m venv refuses a folder with the PATH separator in it (CPython's
    # Lib/venv/__init__.py, ensure_directories: "Refusing to create a venv in ...").
    return (isinstance(value, str) and bool(re.fullmatch(_PATH, value)) and ":" not in value
            and value.count("/") >= 2 and value not in _SHARED_DIRS
            and not re.fullmatch(r"/home/[^/]+", value)
            and not any(value == d or value.startswith(d + "/") for d in _SYSTEM_DIRS))


#: The folders gpuhost manages on the host (operations/: mlenv.LOCK_DIR, p2p.LIB_DIR,
#: flash_attn.BUILD_DIR and WHEEL_DIR, kernel_cache.KERNEL_CACHE_ROOT, p2p.RECORD and
#: server.VERIFIED_FILE, p2p.ENV_FILE and server.SERVER_ENV_FILE, files/deploy_lock.RUN_DIR;
#: tests/test_venv_path.py checks that every such path in operations/ lies in one of them).
#: The venv lives beside them, never in, on or around one: ``python3 -m venv --clear``
#: empties its folder.
GPUHOST_DIRS: Final[Mapping[str, str]] = {
    "/opt/gpuhost/lib": "gpuhost's shipped scripts",
    "/opt/gpuhost/lock": "the ML stack's lock files",
    "/opt/gpuhost/build": "flash-attn's build folder",
    "/opt/gpuhost/wheels": "flash-attn's built wheels, a fresh venv's locked wheels",
    "/opt/gpuhost/venvs": "the ML venvs, one per lock digest",
    "/var/cache/gpuhost": "the server's kernel caches",
    "/var/lib/gpuhost": "gpuhost's records (the P2P measurement, the verified server)",
    "/var/lib/gpuhost-models": "the model copy user's home (its one key: rrsync -ro)",
    "/etc/gpuhost": "the server's and the P2P decision's environment files",
    "/run/gpuhost": "the deploy lock",
    "/run/gpuhost-model-copy": "the copy key while the host copies from a peer",
    "/opt/gpuhost/router-venv": "the router's venv (gpuhost_router_venv_path's default)",
}


@dataclass(frozen=True)
class MLStackSettings:
    """The ML stack's part of Settings (operations/plans/settings_schema.py)."""
    # The ML venv
    venv_path: str = setting(
        "/opt/gpuhost/venv",
        _Rule(_is_venv_path, "an absolute path (letters, digits and . _ + @ -; no "
              "':', which python3 -m venv refuses; no '.' or '..' part, no trailing "
              "slash), a folder of the venv's "
              "own: at least two levels deep, not a home folder (/home/<user>) nor "
              f"one of {', '.join(_SHARED_DIRS)}, and outside the system's folders "
              f"({', '.join(_SYSTEM_DIRS)})"),
        "the link to the ML venv the server was last verified with; the venvs themselves live in "
        "`/opt/gpuhost/venvs/<lock digest>`, one per lock, and the unit names the lock's venv "
        "itself (docs/upgrades.md). Neither on, inside nor around a folder gpuhost manages or a "
        "file another key names. On the host (refused while planning otherwise) it must be "
        "missing, a symlink (replaced), an empty folder, or a venv of an earlier gpuhost holding "
        "nothing but what a venv has, which is removed once the lock's venv passed the health "
        "gate; a file or a folder holding anything else is named and left alone")
    lock: str = setting(
        "locks/cuda12.8.txt",
        _text(r"[^\s]+\.txt", "a path to a lock file (.txt) in locks/ or absolute"),
        "the ML stack lock (relative to the repository, or absolute); unset, the lock of "
        "`gpuhost_cuda_toolkit`'s stack")
    pip_index_url: str = setting(
        "https://pypi.org/simple", _text(_URL, "an http(s) URL of a PEP 503 simple index"),
        "the package index the lock installs from")
    max_jobs: int | None = setting(
        None, _Rule(lambda v: v is None or (_is_int(v) and v >= 1), "an integer >= 1, or None"),
        "lower flash-attn's MAX_JOBS below the computed bound (never above it)")
    nvcc_threads: int | None = setting(
        None,
        _Rule(
            lambda v: v is None or (_is_int(v) and 1 <= v <= 16), "an integer from 1 to 16, or None"
        ),
        "lower flash-attn's NVCC_THREADS (default 4, or fewer on small hosts)")
    wheel_cache: str = setting(
        "~/.cache/gpuhost/wheels",
        _text(r"(~|/)[^\s'\"]*", "a path on the controller, absolute or under ~"),
        "folder on the controller where a flash-attn wheel built on one host is kept for the "
        "others (same flash-attn, torch, CUDA, Python, architecture), and the locked wheels a "
        "host downloaded, by sha256, for the next fresh venv (rebuilding a host)")
    # Upgrades and rollback (operations/stages/venvs.py, operations/stages/last_known_good.py)
    venvs_kept: int = setting(
        1, _int_between(1, 16),
        "how many venvs stay in `/opt/gpuhost/venvs` once the health gate passed: the one serving "
        "(the last known good) and the ones verified before it, newest first, 1 to 16; the others "
        "are removed then. A new lock's venv is built beside them, so during an upgrade there is "
        "one more, and the disk must hold it (checked before the build)")
    rollback: bool = setting(
        False, _BOOL,
        "`true`: roll the host back to its last known good "
        "(`/var/lib/gpuhost/last-known-good.json`: the unit, its drop-ins, the environment files, "
        "the P2P record, so the venv the unit names), restart the server and verify it; nothing "
        "else of the deploy runs (only the scripts the rollback runs are shipped). Meant for "
        "`--data gpuhost_rollback=true`")
    # P2P
    p2p_override: str | None = setting(
        None, _one_of(P2P_OVERRIDES, optional=True),
        "`\"on\"` or `\"off\"` to override the measured P2P decision")
    p2p_remeasure: bool = setting(
        False, _BOOL,
        "measure P2P again on this run even when the recorded measurement holds (stops and "
        "restarts the server)")
    p2p_check_timeout: int = setting(
        120, _int_between(10, 3600),
        "seconds the P2P check's peer copies, and its NCCL all-reduce (on a node of a group, also "
        "the all-reduce across the nodes), may take before they count as failed (10 to 3600)")

    @property
    def lock_path(self) -> Path:
        path = Path(self.lock)
        return path if path.is_absolute() else REPO_ROOT / path
