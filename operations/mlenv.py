"""Manage the ML venv: the locked stack (torch, sglang, flashinfer) and flash-attn built from
source with a capped build parallelism."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from io import StringIO
from typing import Final

from packaging.version import Version
from pyinfra import host, logger, state
from pyinfra.api import FactBase, deploy, operation
from pyinfra.api.exceptions import FactProcessError, OperationError, PyinfraError
from pyinfra.facts.files import File
from pyinfra.operations import apt, files
from typing_extensions import override

from operations import REPO_ROOT, locked_wheels, proxy
from operations.cuda_compat import driver_problem, venv_cuda
from operations.disk import NO_SPACE, no_space_named
from operations.folders import top_folders
from operations.flash_attn import STAMP_NAME, BuildPlan, built_wheel, read_stamp, stale_reasons
from operations.gpu import NvidiaDriver
from operations.host import FileText, HostResources
from operations.last_known_good import RECORD as LAST_GOOD_RECORD
from operations.lock import Lock, read_lock
from operations.p2p import LIB_DIR
from operations.pip_index import pip_index_args
from operations.plan import fact, is_dry_run, refuse
from operations.settings import Settings
from operations.venv_path import MAX_ENTRIES, VenvHealth, venv_path_problem
from operations.venvs import (VENVS_DIR, choose_venv, kept_drift, link_problem, recorded_venv,
                              remember, slots, stack_changes, stack_venv, unit_venv,
                              venv_checked)

#: Memory one nvcc thread takes while compiling flash-attn's kernels, in GiB (flash-attn's
#: README: "ninja ... without ... enough RAM ... MAX_JOBS"; about 5 GiB per thread is what the
#: reference lab measured when MAX_JOBS=128 ran it out of memory).
GIB_PER_NVCC_THREAD: Final = 5.0
#: Memory left for sshd and the rest of the host during the build, in GiB.
BUILD_HEADROOM_GIB: Final = 4.0
#: flash-attn's own default for NVCC_THREADS (its setup.py).
DEFAULT_NVCC_THREADS: Final = 4

FLASH_ATTN: Final = "flash-attn"
LOCK_DIR: Final = "/opt/gpuhost/lock"
#: The server's unit (operations/server_unit.py UNIT_PATH; server.py imports this module):
#: the venv it names, and the last known good record's, are never cleared.
SERVER_UNIT_PATH: Final = "/etc/systemd/system/sglang.service"
#: Debian/Ubuntu packages a venv and a CUDA extension build need.
BUILD_PACKAGES: Final = ("python3-venv", "python3-dev", "build-essential")


class BuildError(PyinfraError):
    """Build settings the host cannot bear."""


@dataclass(frozen=True)
class BuildParallelism:
    """MAX_JOBS (parallel compiler jobs) and NVCC_THREADS (threads inside each nvcc) for
    flash-attn's build, with the safe bound they were checked against (threads in all)."""

    max_jobs: int
    nvcc_threads: int
    thread_bound: int


def build_parallelism(
    cores: int,
    mem_available_gib: float,
    max_jobs: int | None = None,
    nvcc_threads: int | None = None,
) -> BuildParallelism:
    """Choose MAX_JOBS and NVCC_THREADS from the host's cores and available memory (GiB).

    The bound: ``floor((mem_available_gib - 4 GiB headroom) / 5 GiB)`` nvcc threads in all,
    at least 1. NVCC_THREADS defaults to flash-attn's 4 (fewer if the bound is lower);
    MAX_JOBS to what the bound leaves, at most one job per core. Requested values may lower
    these, never raise them past the bound: :class:`BuildError` names the value and the bound.
    """
    bound = max(1, int((mem_available_gib - BUILD_HEADROOM_GIB) // GIB_PER_NVCC_THREAD))
    if nvcc_threads is not None and nvcc_threads > bound:
        raise BuildError(
            f"gpuhost_nvcc_threads = {nvcc_threads} exceeds the safe bound of "
            f"{bound} nvcc threads for {mem_available_gib:.1f} GiB available "
            f"({GIB_PER_NVCC_THREAD:g} GiB each, {BUILD_HEADROOM_GIB:g} GiB kept)"
        )
    threads = nvcc_threads or min(DEFAULT_NVCC_THREADS, bound)
    jobs_bound = max(1, min(cores, bound // threads))
    if max_jobs is not None and max_jobs > jobs_bound:
        raise BuildError(
            f"gpuhost_max_jobs = {max_jobs} exceeds the safe bound of "
            f"{jobs_bound} for {cores} cores and {mem_available_gib:.1f} GiB available at "
            f"NVCC_THREADS={threads} ({GIB_PER_NVCC_THREAD:g} GiB per nvcc thread)"
        )
    return BuildParallelism(max_jobs or jobs_bound, threads, bound)


#: What the venv's python must print: a truncated or empty file "runs" as an empty shell
#: script, with exit status 0 and no output (a shell runs a file execve(2) refuses with ENOEXEC
#: as a script of its own: POSIX, XCU 2.9.1.1 "Command Search and Execution").
_PYTHON_OK: Final = "gpuhost-venv-python-ok"
#: Run by the venv's python: "pip intact" where every file pip's RECORD lists with a hash is
#: there with that sha256 (the wheel format, PEP 376/PEP 627: ``path,sha256=<urlsafe base64,
#: no padding>,size``; bytecode under ``__pycache__`` aside, python rewrites it). A disk that
#: filled while pip was written leaves a file short or missing; where all are whole, ``pip
#: --version`` would run (starting it took 0.55 s of a sandbox host's CPU at each no-op run,
#: docs/development.md), and where any is not, ``pip --version`` is run to say why.
_PIP_INTACT: Final = (
    "import base64, hashlib, importlib.metadata as m\n"
    "try:\n"
    "    files = m.distribution('pip').files\n"
    "except m.PackageNotFoundError:\n"
    "    files = None\n"
    "whole = bool(files)\n"
    "for f in files or ():\n"
    "    if f.hash is None or '__pycache__' in f.parts:\n"
    "        continue\n"
    "    try:\n"
    "        data = f.locate().read_bytes()\n"
    "    except OSError:\n"
    "        whole = False\n"
    "        break\n"
    "    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()\n"
    "    if f.hash.mode != 'sha256' or digest != f.hash.value:\n"
    "        whole = False\n"
    "        break\n"
    "print('pip intact' if whole else 'pip not whole')\n"
)


class VenvRuns(FactBase[VenvHealth]):
    """What is at the venv's path (a folder and its entries, a file, a symlink, nothing and
    what is above it) and whether the venv's python and its pip run (a full disk while the venv
    was created or installed into can leave either half-written); see
    :class:`operations.venv_path.VenvHealth`:

    .. code:: python

        {"found": "folder", "target": "", "target_found": "", "above": "",
         "above_found": "", "entries": ["bin", "include", "lib", "lib64", "pyvenv.cfg"],
         "entry_count": 5, "is_venv": True, "state": "broken",
         "why": "bin/python printed nothing (exit 0)"}
    """

    @override
    def command(self, venv: str) -> str:
        return self._shell(venv, runs=True)

    @staticmethod
    def _shell(venv: str, runs: bool) -> str:
        q = shlex.quote(venv)
        last = "printf '%s\\n' \"$out\" | tail -n 1 | cut -c1-300"
        kind = ("k() { if [ -d \"$1\" ]; then echo folder; elif [ -f \"$1\" ]; then echo file; "
                "elif [ -e \"$1\" ]; then echo other; elif [ -L \"$1\" ]; then echo link; "
                "else echo missing; fi; }; ")
        return (
            f"v={q}; p=\"$v/bin/python\"; {kind}"
            "if [ -L \"$v\" ]; then echo found link; echo \"target $(readlink \"$v\")\"; "
            "echo \"target-found $(k \"$v\")\"; else echo \"found $(k \"$v\")\"; fi; "
            "if [ ! -e \"$v\" ] && [ ! -L \"$v\" ]; then a=$v; while :; do a=${a%/*}; "
            "[ -n \"$a\" ] || a=/; if [ -e \"$a\" ] || [ -L \"$a\" ]; then break; fi; done; "
            "echo \"above $a\"; echo \"above-found $(k \"$a\")\"; fi; "
            "if [ ! -d \"$v\" ]; then echo state absent; exit 0; fi; "
            "echo \"entries $(LC_ALL=C ls -1Aq \"$v\" | wc -l)\"; "
            f"LC_ALL=C ls -1Aq \"$v\" | head -n {MAX_ENTRIES} | sed 's/^/entry /'; "
            "if [ -f \"$v/pyvenv.cfg\" ]; then echo venv yes; else echo venv no; fi; "
            + ("" if runs else "echo state unchecked; exit 0; ") +
            "if [ ! -e \"$p\" ] && [ ! -L \"$p\" ]; then "
            "if [ -f \"$v/pyvenv.cfg\" ]; then echo state broken; echo 'why it has no bin/python'; "
            "else echo state absent; fi; exit 0; fi; "
            f"out=$(\"$p\" -c 'print(\"{_PYTHON_OK}\")' 2>&1 </dev/null); rc=$?; "
            f"if [ \"$out\" != {_PYTHON_OK} ]; then echo state broken; "
            "if [ -z \"$out\" ]; then echo \"why bin/python printed nothing (exit $rc)\"; "
            f"else echo \"why bin/python exited $rc: $({last})\"; fi; exit 0; fi; "
            f"out=$(\"$p\" -I -c {shlex.quote(_PIP_INTACT)} 2>&1 </dev/null); "
            "if [ \"$out\" = 'pip intact' ]; then echo state ok; exit 0; fi; "
            "out=$(\"$p\" -m pip --version --disable-pip-version-check 2>&1 </dev/null); rc=$?; "
            "if [ $rc -eq 0 ] && printf '%s\\n' \"$out\" | grep -q '^pip '; then echo state ok; "
            f"else echo state broken; echo \"why pip exited $rc: $({last})\"; fi"
        )

    @override
    def process(self, output: list[str]) -> VenvHealth:
        keys = {"found": "found", "target": "target", "target-found": "target_found",
                "above": "above", "above-found": "above_found", "state": "state", "why": "why"}
        text = dict.fromkeys(keys.values(), "")
        entries: list[str] = []
        count, is_venv = 0, False
        for line in output:
            key, _, value = line.rstrip("\n").partition(" ")
            if key == "entry":
                entries.append(value)
            elif key == "entries" and value.strip().isdigit():
                count = int(value)
            elif key == "venv":
                is_venv = value.strip() == "yes"
            elif key in keys:
                text[keys[key]] = value if key == "target" else value.strip()
        if (text["found"] not in ("missing", "folder", "file", "link", "other")
                or text["state"] not in ("absent", "ok", "broken", "unchecked")):
            raise FactProcessError(f"venv check: cannot read {output[:3]!r}")
        return VenvHealth(found=text["found"], target=text["target"],
                          target_found=text["target_found"], above=text["above"],
                          above_found=text["above_found"], entries=entries, entry_count=count,
                          is_venv=is_venv, state=text["state"], why=text["why"])


#: Run by the venv's python (``-I``: its own site-packages alone, neither PYTHONPATH nor a user
#: site): what ``pip list --format=json`` prints, without starting pip. pip 26.3's importlib
#: backend (``pip/_internal/metadata/importlib/_envs.py``, ``_DistributionFinder``) walks
#: sys.path in order, skips a location that is a wheel file and a distribution without a name
#: (BadMetadata), keeps the first of each canonical name; ``pip list`` then leaves out
#: ``stdlib_pkgs`` (``metadata/base.py``: python, wsgiref, argparse). Legacy ``.egg-link``
#: editables (setuptools' ``develop``) are not followed: gpuhost installs none.
_LIST_DISTRIBUTIONS: Final = (
    "import importlib.metadata as m, json, os, re, sys\n"
    "seen, out = set(), []\n"
    "for location in sys.path:\n"
    "    if location.endswith('.whl') and os.path.isfile(location):\n"
    "        continue\n"
    "    for d in m.distributions(path=[location]):\n"
    "        name = d.metadata['Name']\n"
    "        key = re.sub(r'[-_.]+', '-', name).lower() if isinstance(name, str) else ''\n"
    "        if not key or key in seen:\n"
    "            continue\n"
    "        seen.add(key)\n"
    "        if key not in ('python', 'wsgiref', 'argparse'):\n"
    "            out.append({'name': name, 'version': d.metadata['Version'] or ''})\n"
    "print(json.dumps(out))\n"
)


class VenvPackages(FactBase[dict[str, str]]):
    """Distributions installed in a venv, by canonical name, as ``pip list --format=json``
    gives them (read by the venv's own python from the distributions' metadata: starting pip
    took 0.67 s of a sandbox host's CPU at each no-op run, docs/development.md).

    .. code:: python

        {"torch": "2.9.1+cu128", "sglang": "0.5.9"}

    pyinfra's PipPackages drops versions with a local part such as ``+cu128``; this does not.
    A version is normalised as pip prints it (``str(Version(...))``, the raw string where it
    does not parse: pip's ``format_for_json``). Empty where the venv does not exist yet. Read
    only where VenvRuns says its pip runs.
    """

    default = dict

    @override
    def requires_command(self, venv: str) -> str:
        return f"{venv}/bin/python"

    @override
    def command(self, venv: str) -> str:
        return (f"{shlex.quote(venv)}/bin/python -I -c {shlex.quote(_LIST_DISTRIBUTIONS)} "
                "2>/dev/null")

    @override
    def process(self, output: list[str]) -> dict[str, str]:
        from packaging.utils import canonicalize_name
        from packaging.version import InvalidVersion

        def printed(version: str) -> str:
            try:
                return str(Version(version))
            except InvalidVersion:
                return version

        try:
            listed = json.loads("\n".join(output))
            return {canonicalize_name(d["name"]): printed(d["version"]) for d in listed}
        except (ValueError, KeyError, TypeError) as exc:
            raise FactProcessError(f"venv distributions: cannot read {output[:3]!r}") from exc


class VenvAt(VenvRuns):
    """What is at a venv's path, as :class:`VenvRuns` reads it, its python and pip not started
    (state "unchecked" where a folder is there): for the link at gpuhost_venv_path, which points
    at a venv whose own reading starts them (pip alone took 0.55 s of a sandbox host's CPU at
    each no-op run, docs/development.md)."""

    @override
    def command(self, venv: str) -> str:
        return self._shell(venv, runs=False)


def drift(installed: dict[str, str], wanted: dict[str, str]) -> dict[str, tuple[str | None, str]]:
    """Locked distributions whose installed version differs: name -> (installed, locked).
    Local version parts are compared too (torch 2.9.1+cu128 is not 2.9.1+cu130)."""
    out = {}
    for name, version in wanted.items():
        have = installed.get(name)
        if have != version and (have or "").split("+")[0] != version:
            out[name] = (have, version)
    return out


#: What a venv holds before anything is installed into it: ensurepip's bundled distributions
#: (CPython 3.11's Lib/ensurepip/__init__.py ``_PROJECTS``: setuptools and pip; 3.12 bundles
#: pip alone).
ENSUREPIP: Final = frozenset({"pip", "setuptools"})
#: Distributions a venv may hold beyond its lock: pip itself, which ``python -m venv`` puts
#: there and which installs the lock.
UNLOCKED_ALLOWED: Final = frozenset({"pip"})


def unlocked(installed: dict[str, str], locked: Iterable[str]) -> dict[str, str]:
    """Installed distributions the lock does not name (pip aside): name -> installed version."""
    known = set(locked) | UNLOCKED_ALLOWED
    return {name: version for name, version in sorted(installed.items()) if name not in known}


def describe_drift(changed: dict[str, tuple[str | None, str]], extra: dict[str, str]) -> str:
    """One line per difference, for the deploy's output: ``torch 2.9.0 -> 2.9.1 (lock)``,
    ``sgl-kernel missing -> 0.3.21 (lock)``, ``foo 1.0 not in the lock: removed``."""
    lines = [f"{name} {have or 'missing'} -> {version} (lock)"
             for name, (have, version) in sorted(changed.items())]
    lines += [f"{name} {version} not in the lock: removed" for name, version in extra.items()]
    return "\n".join(lines)


@operation()
def locked_packages(venv: str, requirements: str, wanted: dict[str, str], index_url: str,
                    env: dict[str, str] | None = None, build_isolation: bool = True,
                    remove_unlocked: Iterable[str] | None = None, recreated: bool = False,
                    wheel_cache: str | None = None, requirements_text: str = ""):
    """Install a venv's distributions from a lock file on the host, only those that drifted.

    + venv: the venv's path
    + requirements: path on the host of a requirements file with hashes
    + wanted: canonical name -> locked version, to compare with what is installed
    + index_url: the PEP 503 index to install from
    + env: environment for the install (a build's MAX_JOBS, CUDA_HOME, PATH prefix)
    + build_isolation: False to build sdists against the venv's own torch
    + remove_unlocked: every name the lock holds (``wanted`` and the rest); installed
      distributions outside it, pip aside, are uninstalled. None leaves them alone.
    + recreated: the venv does not run and an earlier operation recreates it: while planning
      it counts as empty (its pip cannot list anything yet)
    + wheel_cache: ``gpuhost_wheel_cache``: a fresh venv (nothing but :data:`ENSUREPIP`)
      takes the locked files the controller caches by sha256 and fills that cache for the fleet
      (operations/locked_wheels.py); None installs from the index alone
    + requirements_text: the requirements file's content (its hashes key the cache)

    pip runs through no_space.py: a full disk is said in one line (:func:`no_space_named`).

    What differs is printed per host before anything runs (in ``--dry`` too): each drifted
    distribution with its installed and locked version, each unlocked one.
    """
    installed = ({} if recreated and not state.is_executing
                 else host.get_fact(VenvPackages, venv=venv))
    changes = drift(installed, wanted)
    extra = unlocked(installed, remove_unlocked) if remove_unlocked is not None else {}
    if not changes and not extra:
        host.noop(f"{', '.join(sorted(wanted))} at the locked versions")
        return
    if installed:
        logger.warning(f"{host.print_prefix}venv {venv} differs from its lock "
                       f"({len(changes)} to install, {len(extra)} to remove):\n    "
                       + describe_drift(changes, extra).replace("\n", "\n    "))
    if extra:
        yield no_space_named(f"pip uninstall in {venv}", venv, [
            f"{venv}/bin/python", "-m", "pip", "uninstall", "--yes",
            "--disable-pip-version-check", *extra])
    if not changes:
        return
    if wheel_cache and set(installed) <= ENSUREPIP and not env:
        yield from locked_wheels.fresh_install(
            venv, requirements, requirements_text, index_url, wheel_cache,
            [] if build_isolation else ["--no-build-isolation"])
        return
    command = []
    if env:
        command += ["env", *(f"{k}={v}" for k, v in env.items())]
    command += [f"{venv}/bin/python", "-m", "pip", "install", "--no-deps", "--require-hashes",
                "--disable-pip-version-check", *pip_index_args(index_url)]
    if not build_isolation:
        command.append("--no-build-isolation")
    command += ["-r", requirements]
    yield no_space_named(f"pip install into {venv}", venv, command)


@operation()
def venv_that_runs(path: str, python: str = "python3", clear: bool = False):
    """A venv at ``path`` whose python and pip run: created where there is none (or where
    its bin/activate is missing, as pyinfra's pip.venv does), cleared and created again
    (``python -m venv --clear``) where its python or pip does not run (half-written by a full
    disk, a python upgraded away under it). Only a folder with a pyvenv.cfg and nothing but
    what a venv holds is cleared (:func:`operations.venv_path.venv_path_problem`).

    + path: the venv's folder
    + python: the interpreter that creates it
    + clear: clear and create it again even where it runs (a venv that serves nothing, left
      half-installed: the ML venv stage decides it while planning)

    The creation runs through no_space.py: a full disk is said in one line. Raises
    OperationError where no venv may be made or cleared there (planning refuses it first).
    """
    health = host.get_fact(VenvRuns, venv=path)
    problem = venv_path_problem(path, {**health, "state": "broken"} if clear and
                                health["state"] == "ok" else health)
    if problem:
        raise OperationError(f"{problem}: left alone")
    command = [python, "-m", "venv", "--without-pip"]
    if health["state"] == "broken" or clear and health["state"] == "ok":
        command.append("--clear")
    elif health["state"] == "ok" and host.get_fact(File, path=f"{path}/bin/activate"):
        host.noop(f"venv {path} runs")
        return
    yield no_space_named(f"creating the venv {path}", path, [*command, path])
    # pip apart: venv runs ensurepip through subprocess.check_output with stderr=STDOUT
    # (CPython's Lib/venv/__init__.py, _setup_pip) and says only "returned non-zero exit
    # status 1"; run on its own, ensurepip's error (ENOSPC) is seen
    yield no_space_named(f"installing pip into the venv {path}", path,
                         [f"{path}/bin/python", "-m", "ensurepip", "--upgrade", "--default-pip"])


class VenvPython(FactBase[str | None]):
    """The venv's Python as major.minor ("3.12"): the venv's own where it exists, else the
    ``python3`` that would create it; None where neither exists.

    .. code:: python

        "3.12"
    """

    @override
    def command(self, venv: str) -> str:
        return self._shell(venv, runs=True)

    @staticmethod
    def _shell(venv: str, runs: bool) -> str:
        q = shlex.quote(venv)
        version = "import sys; print('%d.%d' % sys.version_info[:2])"
        # a venv's python that does not run (see VenvRuns) is recreated from python3
        return (f"if [ -x {q}/bin/python ] && v=$({q}/bin/python -c \"{version}\" 2>/dev/null) "
                "&& [ -n \"$v\" ]; then echo \"$v\"; "
                f"elif command -v python3 >/dev/null; then python3 -c \"{version}\"; fi")

    @override
    def process(self, output: list[str]) -> str | None:
        return output[-1].strip() if output and output[-1].strip() else None


class VenvTorchCuda(FactBase[str | None]):
    """``torch.version.cuda`` in the venv ("12.8"); None where the venv, torch or a CUDA build
    of torch is missing.

    .. code:: python

        "12.8"
    """

    @override
    def command(self, venv: str) -> str:
        return self._shell(venv, runs=True)

    @staticmethod
    def _shell(venv: str, runs: bool) -> str:
        q = shlex.quote(venv)
        return (f"if [ -x {q}/bin/python ]; then {q}/bin/python -c "
                "\"import torch; print(torch.version.cuda)\" 2>/dev/null || true; fi")

    @override
    def process(self, output: list[str]) -> str | None:
        value = output[-1].strip() if output else ""
        return value if re.fullmatch(r"\d+\.\d+", value) else None


def build_memory_max(mem_available_gib: float) -> int:
    """The build unit's MemoryMax in bytes: the host's available memory (GiB) less the headroom
    kept for sshd and the rest of the host, at least 1 GiB."""
    return int(max(1.0, mem_available_gib - BUILD_HEADROOM_GIB) * 2**30)


def check_driver_for_venv(settings: Settings, lock: Lock, installed: Mapping[str, str],
                          venv: str) -> None:
    """Refuse the ML venv stage when the CUDA the venv needs (the newest of torch.version.cuda
    in the venv, its CUDA wheels and the lock's) is newer than the host's driver supports: the installed driver as nvidia-smi reports it,
    else the driver this deploy installs (gpuhost_driver_version or gpuhost_driver_branch)."""
    torch_cuda = fact(VenvTorchCuda, venv=venv)
    found = [c for c in (venv_cuda(installed), venv_cuda(lock.versions())) if c]
    if torch_cuda:
        found.append((torch_cuda, f"torch.version.cuda in {venv}"))
    if not found:
        return
    needed = max(found, key=lambda c: Version(c[0]))
    state = fact(NvidiaDriver)
    driver = (state.driver_version if state.status == "ok" and state.driver_version
              else settings.driver_version or settings.driver_branch)
    problem = driver_problem(*needed, driver)
    if problem:
        refuse("ML venv", problem)


def python_problem(lock: Lock, lock_name: str, python: str | None, venv: str,
                   venv_exists: bool) -> str | None:
    """Why the venv cannot hold the lock: its interpreter (``python``, major.minor: the venv's
    own where it exists, else the host's python3 that makes it) is not the Python the lock was
    resolved for (:attr:`Lock.python_version`, its header's ``--python-version``). The locked
    wheels are built for that Python (locks/cuda12.8.txt: cp312 wheels, and airportsdata
    20261103, which declares Requires-Python >=3.12), so pip cannot install them with another.
    None when they match, or when either is unknown."""
    wanted = lock.python_version
    if wanted is None or python is None or python == wanted:
        return None
    if venv_exists:
        where = (f"the venv {venv} was made with Python {python}: remove it (rm -rf {venv}) "
                 f"for a python3 {wanted} to make it again")
    else:
        where = f"the host's python3, which would make the venv {venv}, is Python {python}"
    return (f"the lock {lock_name} is resolved for Python {wanted} (its header's "
            f"--python-version), and {where}; pip cannot install that lock with it. Deploy to "
            f"a host whose python3 is {wanted} (Ubuntu 24.04's is 3.12), or set "
            f"gpuhost_lock to a lock resolved for Python {python} (a locks/<stack>.in with "
            f"'#: python-version = {python}', then python tools/lock.py <stack>)")


def _say_stack_changes(settings: Settings, lock: Lock, venv: str) -> None:
    """Print (in --dry too) which distributions the lock's new venv changes against the venv
    the server was last verified with (the link at gpuhost_venv_path), from what to what."""
    serving = fact(VenvRuns, venv=settings.venv_path)
    if serving["state"] != "ok":
        return
    where = serving["target"] or settings.venv_path
    changes = stack_changes(fact(VenvPackages, venv=settings.venv_path), lock.versions())
    said = ("\n    ".join(changes) if changes
            else "none (the same versions under another lock digest)")
    logger.warning(f"{host.print_prefix}ML venv: the lock {settings.lock} gets a venv of its "
                   f"own, {venv}, built beside the serving {where}; distributions that change:"
                   f"\n    {said}")


@deploy("ML venv")
def mlenv(settings: Settings):
    """Converge the lock's own venv (``/opt/gpuhost/venvs/<lock digest>``, beside the one the
    server runs from: operations/venvs.py; the link at ``gpuhost_venv_path`` is the server
    stage's, moved once the new venv served) to the lock ``gpuhost_lock`` (distributions
    the lock does not name are removed, pip aside), then install flash-attn: the wheel cached on
    the controller for (flash-attn, torch, CUDA, Python, architectures), or else a build from
    source on the host, detached under systemd-run with MAX_JOBS capped by memory, whose wheel
    is cached for the rest of the fleet (operations/flash_attn.py). A stamp in the venv records
    what flash-attn was built against; a change of any of these rebuilds it.

    + settings: the host's validated settings

    A venv that serves or is the last known good is never installed into: where it does not
    run, differs from its lock (changed by hand) or is gone, the lock's other folder is built
    beside it and checked, and the unit then names it (:func:`operations.venvs.choose_venv`).
    A venv that serves nothing and does not run (half-written by a full disk, say), or was
    left half-installed (a run cut off in pip), is said so, cleared and built again from
    empty; refused while planning (nothing of the stage planned): a file, a symlink or a
    non-empty folder without pyvenv.cfg there, and a venv to recreate that holds anything a
    venv does not (:func:`operations.venv_path.venv_path_problem`). The venv's
    creation and pip run through no_space.py: a full disk ends the host's run with one line.

    Returns the operations whose change means the server must restart. Raises LockError for
    a lock that does not parse, BuildError for a MAX_JOBS or NVCC_THREADS above the host's
    safe bound (both before any change). Refuses the stage (operations/plan.refuse) when the
    CUDA the venv needs is newer than the installed (or planned) driver supports, and when
    the venv's Python is not the one the lock was resolved for (:func:`python_problem`).
    """
    lock: Lock = read_lock(settings.lock_path)
    resources = fact(HostResources)
    try:
        parallel = build_parallelism(resources.cores, resources.mem_available_gib,
                                     settings.max_jobs, settings.nvcc_threads)
    except BuildError as exc:
        raise BuildError(f"host {host.name}: {exc}") from None
    lock_venv = stack_venv(settings.lock_path)
    pair = slots(lock_venv)
    healths = {path: fact(VenvRuns, venv=path) for path in pair}
    serving = unit_venv(fact(FileText, path=SERVER_UNIT_PATH))
    last_good = recorded_venv(fact(FileText, path=LAST_GOOD_RECORD))
    states = {path: h["state"] for path, h in healths.items()}
    differs: dict[str, list[str]] = {}
    for path in pair:
        # a venv that serves or is the last known good is never installed into: one changed
        # by hand gets a replacement beside it, as one that does not run
        if path in (serving, last_good) and states[path] == "ok":
            differs[path] = kept_drift(fact(VenvPackages, venv=path), lock)
            if differs[path]:
                states[path] = "drifted"
    choice = choose_venv(lock_venv, serving, last_good, states)
    if choice.problem:
        refuse("ML venv", choice.problem)
        return []
    venv = choice.venv
    remember(lock_venv, venv)
    health = healths[venv]
    if choice.replaces:
        replaced = choice.replaces
        lines = "\n    ".join(differs.get(replaced, []))
        why = {"broken": f"does not run ({healths[replaced]['why']})",
               "drifted": f"differs from its lock:\n    {lines}",
               }.get(states[replaced], "is missing (its files deleted under the server)")
        kept_as_is = "" if states[replaced] == "absent" else " kept as it is;"
        logger.warning(f"{host.print_prefix}venv at {replaced} {why}\n"
                       f"  and it serves or is the last known good:{kept_as_is} a replacement "
                       + ("will be built" if is_dry_run() else "is built")
                       + f" beside it, at {venv}, and the server moved to it once it passes "
                       "its checks")
    problem = (venv_path_problem(venv, health)
               or link_problem(settings.venv_path,
                               fact(VenvAt, venv=settings.venv_path)))
    if problem:
        # nothing of the stage is planned: its operations would make or fill that venv
        refuse("ML venv", problem)
        return []
    if health["found"] == "missing" or choice.replaces:
        problem = locked_wheels.room_problem(fact, settings, lock, venv)
        if problem:
            refuse("ML venv", problem)
            return []
        _say_stack_changes(settings, lock, venv)
    recreated = health["state"] == "broken"
    if recreated:
        logger.warning(f"{host.print_prefix}venv at {venv} does not run ({health['why']}): "
                       + ("it will be recreated" if is_dry_run() else "recreated"))
    elif health["state"] == "ok" and venv not in (serving, last_good):
        # a venv that serves nothing and was left half-installed (a run cut off in pip, which
        # leaves its temporary files in the distributions it was writing) is built again from
        # empty, never repaired: a venv holds only what one install from its lock put there
        left = fact(VenvPackages, venv=venv)
        stack = {p.name: p.version for p in lock.pins if p.name != FLASH_ATTN}
        if set(left) - ENSUREPIP and (drift(left, stack)
                                      or unlocked(left, [p.name for p in lock.pins])):
            problem = venv_path_problem(venv, {
                **health, "state": "broken", "why": "it serves nothing and differs from its lock"})
            if problem:
                refuse("ML venv", problem)
                return []
            recreated = True
            logger.warning(f"{host.print_prefix}venv at {venv} serves nothing and differs from "
                           "its lock (an install cut off, or changed by hand): "
                           + ("it will be cleared and built again" if is_dry_run()
                              else "cleared and built again"))
    installed = {} if recreated else fact(VenvPackages, venv=venv)
    check_driver_for_venv(settings, lock, installed, venv)
    problem = python_problem(lock, settings.lock, fact(VenvPython, venv=venv), venv,
                             venv_exists=bool(installed))
    if problem:
        refuse("ML venv", problem)

    apt.packages(name="Python venv and build tools", packages=list(BUILD_PACKAGES),
                 no_recommends=True)
    top_folders()
    files.directory(name="Lock folder", path=LOCK_DIR, mode="755")
    files.directory(name="Venvs folder", path=VENVS_DIR, mode="755")
    files.directory(name="gpuhost library folder", path=LIB_DIR, mode="755")
    files.put(name="Ship no_space.py", src=str(REPO_ROOT / "operations/files/no_space.py"),
              dest=NO_SPACE, mode="644", create_remote_dir=False)
    files.put(name=f"Lock {lock.path.name}", src=StringIO(lock.requirements((FLASH_ATTN,))),
              dest=f"{LOCK_DIR}/stack.txt", mode="644", create_remote_dir=False)
    venv_that_runs(name=f"venv {venv}", path=venv, python="python3", clear=recreated)
    stack = locked_packages(
        name="Locked ML stack",
        venv=venv,
        requirements=f"{LOCK_DIR}/stack.txt",
        wanted={p.name: p.version for p in lock.pins if p.name != FLASH_ATTN},
        index_url=settings.pip_index_url,
        remove_unlocked=[p.name for p in lock.pins],
        recreated=recreated,
        wheel_cache=settings.wheel_cache,
        requirements_text=lock.requirements((FLASH_ATTN,)),
    )
    flash = lock.get(FLASH_ATTN)
    if flash is None:
        venv_checked(name=f"Check {venv}", venv=venv, gpu_count=settings.gpu_count,
                     flash_attn=False, _if=lambda: bool(choice.replaces) or stack.did_change())
        return [stack]
    files.put(name="Lock flash-attn", src=StringIO(flash.line + "\n"),
              dest=f"{LOCK_DIR}/flash-attn.txt", mode="644", create_remote_dir=False)
    torch = lock.get("torch")
    stamp_text = fact(FileText, path=f"{venv}/{STAMP_NAME}")
    reasons = stale_reasons(
        read_stamp(stamp_text), installed.get(FLASH_ATTN), flash_attn=flash.version,
        torch_locked=torch.version if torch else "", torch_installed=installed.get("torch"),
        cuda=settings.cuda_toolkit, python=fact(VenvPython, venv=venv),
        archs=settings.cuda_arch)
    built = built_wheel(
        name=(f"flash-attn {flash.version}: the fleet's cached wheel, or a build "
              f"(MAX_JOBS={parallel.max_jobs}, NVCC_THREADS={parallel.nvcc_threads}, "
              f"arch {settings.cuda_arch})"),
        plan=BuildPlan(
            venv=venv, requirements=f"{LOCK_DIR}/flash-attn.txt",
            index_url=settings.pip_index_url, flash_attn=flash.version,
            archs=settings.cuda_arch, compute_capability=settings.compute_capability,
            cuda_home=settings.cuda_home,
            max_jobs=parallel.max_jobs, nvcc_threads=parallel.nvcc_threads,
            memory_max_bytes=build_memory_max(resources.mem_available_gib),
            cache_root=settings.wheel_cache, download_env=proxy.download_env()),
        reasons=reasons,
    )
    # a replacement is checked before the unit names it, even where it was built earlier
    venv_checked(name=f"Check {venv}: imports, torch sees {settings.gpu_count} GPUs",
                 venv=venv, gpu_count=settings.gpu_count, flash_attn=True,
                 _if=lambda: bool(choice.replaces) or stack.did_change() or built.did_change())
    return [stack, built]
