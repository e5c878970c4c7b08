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
operations/stages/flash_attn.py), which the earlier build put there, and the host's pip cache serves
the locked wheels it already downloaded. The unit then names the new venv (one restart, as
any venv change); until the health gate passes the old venv stays where it was (a failed
gate leaves the unit's previous text, pointing at it). Once the gate passes, the old folder is
removed and the link takes its place. Only a folder that is a venv and holds nothing a venv
does not (:func:`link_problem`) is removed that way; anything else there is refused while
planning.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Final

from pyinfra import host
from pyinfra.api import FactBase, operation
from pyinfra.api.exceptions import FactProcessError, OperationError
from typing_extensions import override

from operations import REPO_ROOT
from operations.facts.venv_path import VenvHealth, foreign_entries
from operations.plans.lock import Lock, read_lock

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


#: The second folder of a lock digest's venv (``<digest>-b``): where the replacement of a venv
#: that serves, or is the last known good, and does not run is built, beside it (the two take
#: turns; the one that does not serve is the one cleared and built again).
REPLACEMENT_SUFFIX: Final = "-b"
#: The ExecStart line of the server's unit names its venv's python (templates/sglang.service.j2).
_EXEC_START: Final = re.compile(r"^ExecStart=(/\S+)/bin/python\s", re.MULTILINE)

#: The venv chosen for each host's lock by the ML venv stage in this run, by (host, lock venv).
_chosen: dict[tuple[str, str], str] = {}


def slots(lock_venv: str) -> tuple[str, str]:
    """A lock's two venv folders: ``<digest>`` and its replacement ``<digest>-b``."""
    return lock_venv, lock_venv + REPLACEMENT_SUFFIX


def unit_venv(unit_text: str | None) -> str | None:
    """The venv the server's unit names (its ExecStart's python), or None."""
    found = _EXEC_START.search(unit_text or "")
    return found.group(1) if found else None


def recorded_venv(record_text: str | None) -> str | None:
    """The venv of the last known good record's "server" entry
    (operations/stages/last_known_good.py), or None where there is none or it does not parse."""
    try:
        server = json.loads(record_text or "").get("server")
    except (ValueError, AttributeError):
        return None
    venv = server.get("venv") if isinstance(server, dict) else None
    return venv if isinstance(venv, str) else None


@dataclass(frozen=True)
class VenvChoice:
    """The venv the ML venv stage converges for a lock: ``venv``; ``replaces`` the lock's venv
    that serves or is the last known good and is kept as it is (it does not run, differs from
    its lock, or is missing), None where nothing is replaced; ``problem`` where neither folder
    may be built."""

    venv: str
    replaces: str | None = None
    problem: str | None = None


def choose_venv(lock_venv: str, serving: str | None, last_good: str | None,
                states: dict[str, str]) -> VenvChoice:
    """Which of the lock's two folders (:func:`slots`) the ML venv stage converges.

    + lock_venv: ``/opt/gpuhost/venvs/<digest>``
    + serving: the venv the server's unit names now (:func:`unit_venv`), None where none
    + last_good: the last known good's venv (:func:`recorded_venv`), None where none
    + states: each folder's VenvRuns state ("absent", "ok", "broken"), or "drifted" for a
      venv that runs and whose distributions differ from the lock (:func:`kept_drift`)

    The folder the unit names (else the last known good's, else ``<digest>``) is kept where it
    runs and holds its lock. A venv that serves or is the last known good is never cleared,
    installed into nor built again in place: where it does not run, differs from its lock or
    is gone (its files deleted under a server that still runs from them), the other folder is
    built (cleared first where it holds a venv that serves nothing), checked, and the unit then
    names it.
    """
    pair = slots(lock_venv)
    first = serving if serving in pair else last_good if last_good in pair else pair[0]
    other = pair[1] if first == pair[0] else pair[0]
    kept = {serving, last_good}
    if first not in kept or states.get(first) == "ok":
        return VenvChoice(first)
    if other in kept and states.get(other) in ("broken", "drifted"):
        said = (f"both {_said(states[first])}" if states[first] == states[other] else
                f"{_said(states[first])} and {_said(states[other])}")
        return VenvChoice(first, problem=(
            f"the venvs {first} and {other} of the lock {said}, and one serves while the other "
            "is the last known good, so neither is cleared nor installed into: roll back "
            "(gpuhost_rollback=true) or remove the one that does not serve"))
    return VenvChoice(other, replaces=first)


def _said(state: str) -> str:
    return {"broken": "do not run", "drifted": "differ from the lock",
            "absent": "are missing", "ok": "run"}.get(state, state)


def kept_drift(installed: dict[str, str], lock: Lock) -> list[str]:
    """How a venv that serves or is the last known good differs from ``lock``, one line per
    distribution (``sglang 0.5.9 -> 0.5.10 (lock)``, ``foo 1.0 not in the lock``), [] where
    it holds the lock: a locked distribution missing or at another version (flash-attn
    included: a changed one is not installed into the serving venv either), one the lock does
    not name (pip aside, which installs the lock). Versions compare as
    :func:`operations.stages.venv_install.drift` compares them (a local part such as ``+cu128``
    matches its locked base)."""
    lines = []
    for pin in lock.pins:
        have = installed.get(pin.name)
        if have != pin.version and (have or "").split("+")[0] != pin.version:
            lines.append(f"{pin.name} {have or 'missing'} -> {pin.version} (lock)")
    names = {p.name for p in lock.pins} | {"pip"}
    lines += [f"{name} {version} not in the lock" for name, version in sorted(installed.items())
              if name not in names]
    return lines


def recorded_venvs(record_text: str | None) -> list[str]:
    """The venvs the last known good record keeps (its "server" entry's venv and "venvs"), []
    where there is none, it does not parse or has another shape: then no venv is pruned."""
    try:
        server = json.loads(record_text or "").get("server")
    except (ValueError, AttributeError):
        return []
    if not isinstance(server, dict) or not isinstance(server.get("venv"), str):
        return []
    venvs = server.get("venvs", [])
    if not isinstance(venvs, list) or not all(isinstance(v, str) for v in venvs):
        return []
    return [server["venv"], *(v for v in venvs if v != server["venv"])]


#: A venv's folder name under VENVS_DIR: its lock's digest, or its replacement
#: (operations/files/last_known_good.py DIGEST, the same).
VENV_NAME: Final = re.compile(r"[0-9a-f]{%d}(%s)?" % (DIGEST_CHARS, re.escape(REPLACEMENT_SUFFIX)))


class VenvFolders(FactBase[list[str]]):
    """The venvs' folders under ``path`` (VENVS_DIR) named as gpuhost names them (a lock
    digest, or its replacement), not symlinks; [] where there is none.

    .. code:: python

        ["/opt/gpuhost/venvs/5f0c6b0e3c1d2a94", "/opt/gpuhost/venvs/5f0c6b0e3c1d2a94-b"]
    """

    @override
    def command(self, path: str) -> str:
        q = shlex.quote(path)
        return (f"for d in {q}/*; do if [ -d \"$d\" ] && [ ! -L \"$d\" ]; then "
                "echo \"$d\"; fi; done")

    @override
    def default(self) -> list[str]:
        return []  # no output (an empty folder): pyinfra gives the default, not process([])

    @override
    def process(self, output: list[str]) -> list[str]:
        return sorted(line for line in output
                      if VENV_NAME.fullmatch(line.rstrip("/").rsplit("/", 1)[-1]))


def remember(lock_venv: str, venv: str) -> None:
    """Record the venv the ML venv stage converges on this host for ``lock_venv``."""
    _chosen[(getattr(host, "name", None), lock_venv)] = venv


def host_venv(lock_path: Path) -> str:
    """The venv this host's server runs from for the lock at ``lock_path``: the folder the ML
    venv stage chose in this run (:func:`choose_venv`), else :func:`stack_venv`'s."""
    base = stack_venv(lock_path)
    # outside a deploy (a template rendered alone) no host is in context
    return _chosen.get((getattr(host, "name", None), base), base)


def digest_of_venv(venv: str) -> str:
    """The lock digest a venv's folder is named by (``<digest>`` or ``<digest>-b``)."""
    return venv.rsplit("/", 1)[1].removesuffix(REPLACEMENT_SUFFIX)


def link_problem(path: str, health: VenvHealth) -> str | None:
    """Why gpuhost_venv_path (``path``, as :class:`operations.facts.venv_facts.VenvRuns` read it)
    cannot become the link to the serving venv, or None. A symlink is replaced (its target is left
    alone), an empty folder and a venv of an earlier gpuhost are removed first; refused: a file,
    a device or the like, a folder that is not a venv and holds anything, a venv holding what a
    venv does not (:func:`operations.facts.venv_path.foreign_entries`), nothing there with no folder
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
    + health: what was at ``path`` while planning (:class:`operations.facts.venv_facts.VenvRuns`)

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


#: GiB left free beside a new venv (pip's build folders live in /tmp meanwhile; the figures
#: below are estimates where wheel_sizes.py says so).
VENV_HEADROOM_GIB: Final = 1.0
#: Where pip's downloads of a fresh venv wait (operations/stages/locked_wheels.py; removed once the
#: controller has them).
WHEEL_DIR: Final = "/opt/gpuhost/wheels/locked"
#: pip's own cache, which keeps a second copy of what it downloads from the index (pip's docs,
#: "Caching": on by default, ``~/.cache/pip`` on Unix; root's, as the deploy runs pip).
PIP_CACHE: Final = "/root/.cache/pip"
#: The folders a fresh venv's install writes to: the venvs', the wheels', pip's cache.
ROOM_FOLDERS: Final = (VENVS_DIR, WHEEL_DIR, PIP_CACHE)
#: What the lock's files take (operations/files/wheel_sizes.py), sent as ``python3 -c``.
_SIZES_SCRIPT: Final = (REPO_ROOT / "operations" / "files" / "wheel_sizes.py").read_text()


class VenvRoom(FactBase[dict]):
    """The size of the venv at ``venv_path`` (the link's target, or a venv of an earlier gpuhost
    there; ``du -sk``, KiB) and the room on the file system each of ``folders`` is on (or would
    be: the nearest folder above it that exists; ``df -Pk``, POSIX output, KiB; df(1)); the
    first folder's figures also stand alone:

    .. code:: python

        {"serving_kib": 9437184, "free_kib": 52428800, "mount": "/",
         "folders": {"/opt/gpuhost/venvs": {"free_kib": 52428800, "mount": "/"}}}

    ``serving_kib`` is 0 where no venv is there (a fresh host).
    """

    @override
    def command(self, venv_path: str, folders: tuple[str, ...] = (VENVS_DIR,)) -> str:
        q = shlex.quote(venv_path)
        return (f"t=$(readlink -f {q} 2>/dev/null); "
                "if [ -n \"$t\" ] && [ -f \"$t/pyvenv.cfg\" ]; then "
                "echo \"serving_kib $(du -sk \"$t\" 2>/dev/null | cut -f1)\"; "
                "else echo serving_kib 0; fi; "
                f"for f in {' '.join(shlex.quote(f) for f in folders)}; do "
                "d=$f; while [ ! -d \"$d\" ]; do d=${d%/*}; [ -n \"$d\" ] || d=/; done; "
                "df -Pk \"$d\" | tail -n 1 | "
                "awk -v f=\"$f\" '{m = $6; for (i = 7; i <= NF; i++) m = m \" \" $i; "
                "print \"room\\t\" $4 \"\\t\" f \"\\t\" m}'; done")

    @override
    def process(self, output: list[str]) -> dict:
        values = dict(line.split(" ", 1) for line in output if line.startswith("serving_kib "))
        try:
            folders = {}
            for line in output:
                if line.startswith("room\t"):  # tabs: a folder or a mount may hold spaces
                    _, free, folder, mount = line.split("\t", 3)
                    folders[folder] = {"free_kib": int(free), "mount": mount}
            first = next(iter(folders.values()))
            return {"serving_kib": int(values.get("serving_kib") or 0), **first,
                    "folders": folders}
        except (StopIteration, ValueError) as exc:
            raise FactProcessError(f"du and df: cannot read {output[:3]!r}") from exc


class LockSizes(FactBase[dict]):
    """What the lock's files take, read off the package index from the host
    (operations/files/wheel_sizes.py, which says where each figure comes from): name ->
    ``{"file", "download", "installed"}`` in bytes, or ``{"error": "..."}``.

    .. code:: python

        {"torch": {"file": "torch-2.9.1-py3-none-any.whl", "download": 1045,
                   "installed": 2210}}
    """

    #: the index, from the host: through the host's proxy (operations/plans/proxy.py)
    reaches_outside = True

    @override
    def command(self, index_url: str, pins: tuple[str, ...]) -> str:
        return " ".join(["python3", "-c", shlex.quote(_SIZES_SCRIPT), shlex.quote(index_url),
                         *(shlex.quote(p) for p in pins)])

    @override
    def process(self, output: list[str]) -> dict:
        try:
            return json.loads(output[-1])
        except (IndexError, ValueError) as exc:
            raise FactProcessError(f"wheel_sizes.py: cannot read {output[-3:]!r}") from exc


def lock_pins(pins) -> tuple[str, ...]:
    """LockSizes' arguments: ``name==version:<16 hex of each sha256>`` (prefixes, so that a lock
    of a few thousand hashes stays well inside one argument's limit, MAX_ARG_STRLEN 128 KiB)."""
    return tuple(f"{p.name}=={p.version}:" + ",".join(h.removeprefix("sha256:")[:16]
                                                      for h in p.hashes) for p in pins)


def needs(sizes: dict) -> dict[str, int]:
    """KiB each of ROOM_FOLDERS takes for a fresh venv from LockSizes' figures: the venv what its
    files unpack to, the wheels' folder and pip's cache what is downloaded."""
    download = sum(s.get("download", 0) for s in sizes.values()) // 1024
    installed = sum(s.get("installed", 0) for s in sizes.values()) // 1024
    return {VENVS_DIR: installed, WHEEL_DIR: download, PIP_CACHE: download}


def room_problem(room: dict, new_venv: str, sizes: dict | None = None,
                 also: dict | None = None) -> str | None:
    """Why the lock's new venv (``new_venv``, not built yet) does not fit, or None. Beside a
    serving venv it needs about the serving venv's size and VENV_HEADROOM_GIB free; on a fresh
    host (no serving venv) what ``sizes`` (LockSizes) says the lock's files take in each of
    ROOM_FOLDERS, summed per file system, and VENV_HEADROOM_GIB on each. ``also``: what else
    the run writes (``{"mount", "kib", "what"}``: the model's download), counted on the file
    system mounted on its ``mount``."""
    gib = 2**20
    if not room["serving_kib"]:
        return _fresh_room_problem(room, new_venv, needs(sizes or {}), also)
    extra = also["kib"] if also and also["mount"] == room["mount"] else 0
    needed = room["serving_kib"] + extra + int(VENV_HEADROOM_GIB * 2**20)
    if room["free_kib"] >= needed:
        return None
    beside = f", {also['what']} {size_text(extra)}" if extra else ""
    return (f"no room for the new venv {new_venv} beside the serving one: it needs about "
            f"{needed / gib:.1f} GiB (the serving venv's {room['serving_kib'] / gib:.1f} GiB"
            f"{beside} and {VENV_HEADROOM_GIB:g} GiB kept free), and "
            f"{room['free_kib'] / gib:.1f} GiB are "
            f"free on {room['mount']} (df): free space there (venvs of earlier locks that "
            "gpuhost_venvs_kept keeps are removed only once a new one passed the health gate)")


def _fresh_room_problem(room: dict, new_venv: str, need: dict[str, int],
                        also: dict | None) -> str | None:
    by_mount: dict[str, list[str]] = {}
    for folder, where in room.get("folders", {}).items():
        by_mount.setdefault(where["mount"], []).append(folder)
    short = []
    for mount, folders in by_mount.items():
        free = room["folders"][folders[0]]["free_kib"]
        extra = also["kib"] if also and also["mount"] == mount else 0
        total = sum(need.get(f, 0) for f in folders) + extra + int(VENV_HEADROOM_GIB * 2**20)
        if free < total:
            parts = ", ".join(f"{f} {size_text(need.get(f, 0))}" for f in folders)
            parts += f", {also['what']} {size_text(extra)}" if extra else ""
            short.append(f"{', '.join(folders)} on the file system mounted on {mount} (df): "
                         f"{size_text(total)} needed ({parts}, {VENV_HEADROOM_GIB:g} GiB kept "
                         f"free), {size_text(free)} free")
    if not short:
        return None
    return (f"no room for the new venv {new_venv} and the lock's downloads: "
            + "; ".join(short) + " (the lock's file sizes from the controller's wheel cache and "
            "the package index" + (", the model's from the Hub's file listing" if also else "")
            + "): make room there, or mount a larger file system")


def size_text(kib: int) -> str:
    """KiB as a room line says them: MiB below 1 GiB, else GiB, one decimal."""
    return f"{kib / 2**20:.1f} GiB" if kib >= 2**20 else f"{kib / 1024:.1f} MiB"


def stack_changes(serving: dict[str, str], locked: dict[str, str]) -> list[str]:
    """What a new venv changes against the serving one, one line per distribution, by name:
    ``sglang 0.5.9 -> 0.5.10``, ``foo missing -> 1.0``, ``bar 2.0 -> removed``. A serving
    version with a local part matches its locked base (torch 2.9.1+cu128 is the lock's 2.9.1,
    as the lock pins it: locks/cuda12.8.txt); pip itself, which the venv holds beside its lock,
    is left out."""
    lines = []
    for name in sorted(set(serving) | set(locked)):
        have, want = serving.get(name), locked.get(name)
        if name == "pip" and want is None:
            continue
        if want is None:
            lines.append(f"{name} {have} -> removed")
        elif have is None:
            lines.append(f"{name} missing -> {want}")
        elif have != want and have.split("+")[0] != want:
            lines.append(f"{name} {have} -> {want}")
    return lines


#: What a venv's python must import to serve (the locked stack's top-level modules).
SERVING_IMPORTS: Final = ("torch", "sglang", "flashinfer")


@operation(is_idempotent=False)
def venv_checked(venv: str, gpu_count: int, flash_attn: bool):
    """Check a venv the server is about to be pointed at, before any restart: its stack
    imports (SERVING_IMPORTS, flash_attn where locked) and torch sees the GPUs host data says
    (``torch.cuda.device_count()``). Fails the host's run (the server goes on serving from the
    venv it runs from) saying what failed.

    + venv: the venv's folder
    + gpu_count: gpuhost_gpu_count
    + flash_attn: whether the lock has flash-attn
    """
    modules = [*SERVING_IMPORTS, *(["flash_attn"] if flash_attn else [])]
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        f"        sys.exit(f'venv {venv}: import {{name}} failed: {{type(exc).__name__}}: {{exc}}')\n"
        "import torch\n"
        "n = torch.cuda.device_count()\n"
        f"if n != {int(gpu_count)}:\n"
        f"    sys.exit(f'venv {venv}: torch sees {{n}} GPUs, host data says {int(gpu_count)} "
        "(gpuhost_gpu_count)')\n"
        "print(f'venv ok: imports, {n} GPUs')\n")
    yield f"{shlex.quote(venv)}/bin/python -c {shlex.quote(script)}"
