"""Operations that make a venv that runs and install the distributions of its lock into it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from pyinfra import host, logger, state
from pyinfra.api import operation
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.files import File

from operations.facts.venv_facts import VenvPackages, VenvRuns
from operations.facts.venv_path import venv_path_problem
from operations.stages import locked_wheels
from operations.stages.disk import no_space_named
from operations.stages.pip_index import pip_index_args

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
      (operations/stages/locked_wheels.py); None installs from the index alone
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
    what a venv holds is cleared (:func:`operations.facts.venv_path.venv_path_problem`).

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
