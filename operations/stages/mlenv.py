"""Manage the ML venv: the locked stack (torch, sglang, flashinfer) and flash-attn built from
source with a capped build parallelism."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from io import StringIO
from typing import Final

from packaging.version import Version
from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.operations import apt, files

from operations import REPO_ROOT
from operations.facts.gpu import NvidiaDriver
from operations.facts.host import FileText, HostResources
from operations.facts.venv_facts import VenvAt, VenvPackages, VenvPython, VenvRuns, VenvTorchCuda
from operations.facts.venv_path import VenvHealth, venv_path_problem
from operations.plans import proxy
from operations.plans.cuda_compat import driver_problem, venv_cuda
from operations.plans.lock import Lock, read_lock
from operations.plans.plan import fact, is_dry_run, refuse
from operations.plans.settings import Settings
from operations.stages import locked_wheels
from operations.stages.disk import NO_SPACE
from operations.stages.flash_attn import (
    STAMP_NAME,
    BuildPlan,
    built_wheel,
    read_stamp,
    stale_reasons,
)
from operations.stages.folders import top_folders
from operations.stages.last_known_good import RECORD as LAST_GOOD_RECORD
from operations.stages.p2p import LIB_DIR
from operations.stages.venv_install import (
    ENSUREPIP,
    drift,
    locked_packages,
    unlocked,
    venv_that_runs,
)
from operations.stages.venvs import (
    VENVS_DIR,
    VenvChoice,
    choose_venv,
    kept_drift,
    link_problem,
    recorded_venv,
    remember,
    slots,
    stack_changes,
    stack_venv,
    unit_venv,
    venv_checked,
)

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
#: The server's unit (operations/stages/server_unit.py UNIT_PATH; server.py imports this module):
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
    server runs from: operations/stages/venvs.py; the link at ``gpuhost_venv_path`` is the server
    stage's, moved once the new venv served) to the lock ``gpuhost_lock`` (distributions
    the lock does not name are removed, pip aside), then install flash-attn: the wheel cached on
    the controller for (flash-attn, torch, CUDA, Python, architectures), or else a build from
    source on the host, detached under systemd-run with MAX_JOBS capped by memory, whose wheel
    is cached for the rest of the fleet (operations/stages/flash_attn.py). A stamp in the venv
    records what flash-attn was built against; a change of any of these rebuilds it.

    + settings: the host's validated settings

    A venv that serves or is the last known good is never installed into: where it does not
    run, differs from its lock (changed by hand) or is gone, the lock's other folder is built
    beside it and checked, and the unit then names it (:func:`operations.stages.venvs.choose_venv`).
    A venv that serves nothing and does not run (half-written by a full disk, say), or was
    left half-installed (a run cut off in pip), is said so, cleared and built again from
    empty; refused while planning (nothing of the stage planned): a file, a symlink or a
    non-empty folder without pyvenv.cfg there, and a venv to recreate that holds anything a
    venv does not (:func:`operations.facts.venv_path.venv_path_problem`). The venv's
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
    chosen = _chosen_venv(settings, lock)
    if chosen is None or _refused_here(settings, lock, chosen):
        return []
    venv = chosen.venv
    recreated = _recreated(lock, chosen)
    if recreated is None:
        return []
    installed = {} if recreated else fact(VenvPackages, venv=venv)
    check_driver_for_venv(settings, lock, installed, venv)
    problem = python_problem(lock, settings.lock, fact(VenvPython, venv=venv), venv,
                             venv_exists=bool(installed))
    if problem:
        refuse("ML venv", problem)

    _folders_and_lock(lock)
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
    choice = chosen.choice
    if lock.get(FLASH_ATTN) is None:
        venv_checked(name=f"Check {venv}", venv=venv, gpu_count=settings.gpu_count,
                     flash_attn=False, _if=lambda: bool(choice.replaces) or stack.did_change())
        return [stack]
    built = _flash_attn(settings, lock, venv, installed, parallel, resources.mem_available_gib)
    # a replacement is checked before the unit names it, even where it was built earlier
    venv_checked(name=f"Check {venv}: imports, torch sees {settings.gpu_count} GPUs",
                 venv=venv, gpu_count=settings.gpu_count, flash_attn=True,
                 _if=lambda: bool(choice.replaces) or stack.did_change() or built.did_change())
    return [stack, built]


@dataclass(frozen=True)
class _Chosen:
    """The venv the stage converges (:func:`operations.stages.venvs.choose_venv`'s ``choice``) and
    what planning read of it: ``health`` (:class:`VenvRuns`), the venvs the unit names
    (``serving``) and the last known good record names (``last_good``)."""

    choice: VenvChoice
    health: VenvHealth
    serving: str | None
    last_good: str | None

    @property
    def venv(self) -> str:
        return self.choice.venv


def _chosen_venv(settings: Settings, lock: Lock) -> _Chosen | None:
    """Choose the lock's folder to converge: never one that serves or is the last known good
    and does not run, differs from its lock or is gone (then the other, said in a warning);
    refuse and return None where none may be."""
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
        return None
    remember(lock_venv, choice.venv)
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
                       + f" beside it, at {choice.venv}, and the server moved to it once it "
                       "passes its checks")
    return _Chosen(choice, healths[choice.venv], serving, last_good)


def _refused_here(settings: Settings, lock: Lock, chosen: _Chosen) -> bool:
    """Refuse (and say True) where no venv may be made at the chosen path or the link's, or a
    new venv has no room; say the stack's changes where a new venv is built."""
    venv, health = chosen.venv, chosen.health
    problem = (venv_path_problem(venv, health)
               or link_problem(settings.venv_path,
                               fact(VenvAt, venv=settings.venv_path)))
    if problem:
        # nothing of the stage is planned: its operations would make or fill that venv
        refuse("ML venv", problem)
        return True
    if health["found"] == "missing" or chosen.choice.replaces:
        problem = locked_wheels.room_problem(fact, settings, lock, venv)
        if problem:
            refuse("ML venv", problem)
            return True
        _say_stack_changes(settings, lock, venv)
    return False


def _recreated(lock: Lock, chosen: _Chosen) -> bool | None:
    """Whether the venv is cleared and made again: it does not run, or it serves nothing and
    was left half-installed; None where it may not be cleared (refused)."""
    venv, health = chosen.venv, chosen.health
    if health["state"] == "broken":
        logger.warning(f"{host.print_prefix}venv at {venv} does not run ({health['why']}): "
                       + ("it will be recreated" if is_dry_run() else "recreated"))
        return True
    if health["state"] != "ok" or venv in (chosen.serving, chosen.last_good):
        return False
    # a venv that serves nothing and was left half-installed (a run cut off in pip, which
    # leaves its temporary files in the distributions it was writing) is built again from
    # empty, never repaired: a venv holds only what one install from its lock put there
    left = fact(VenvPackages, venv=venv)
    stack = {p.name: p.version for p in lock.pins if p.name != FLASH_ATTN}
    if not (set(left) - ENSUREPIP and (drift(left, stack)
                                       or unlocked(left, [p.name for p in lock.pins]))):
        return False
    problem = venv_path_problem(venv, {
        **health, "state": "broken", "why": "it serves nothing and differs from its lock"})
    if problem:
        refuse("ML venv", problem)
        return None
    logger.warning(f"{host.print_prefix}venv at {venv} serves nothing and differs from "
                   "its lock (an install cut off, or changed by hand): "
                   + ("it will be cleared and built again" if is_dry_run()
                      else "cleared and built again"))
    return True


def _folders_and_lock(lock: Lock) -> None:
    """The build packages, gpuhost's folders, no_space.py and the stack's lock file."""
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


def _flash_attn(settings: Settings, lock: Lock, venv: str, installed: Mapping[str, str],
                parallel: BuildParallelism, mem_available_gib: float):
    """flash-attn's lock file and its wheel: the fleet's cached one, or a build where the
    venv's stamp is stale (:func:`operations.stages.flash_attn.stale_reasons`); the build's
    operation."""
    flash = lock.get(FLASH_ATTN)
    files.put(name="Lock flash-attn", src=StringIO(flash.line + "\n"),
              dest=f"{LOCK_DIR}/flash-attn.txt", mode="644", create_remote_dir=False)
    torch = lock.get("torch")
    stamp_text = fact(FileText, path=f"{venv}/{STAMP_NAME}")
    reasons = stale_reasons(
        read_stamp(stamp_text), installed.get(FLASH_ATTN), flash_attn=flash.version,
        torch_locked=torch.version if torch else "", torch_installed=installed.get("torch"),
        cuda=settings.cuda_toolkit, python=fact(VenvPython, venv=venv),
        archs=settings.cuda_arch)
    return built_wheel(
        name=(f"flash-attn {flash.version}: the fleet's cached wheel, or a build "
              f"(MAX_JOBS={parallel.max_jobs}, NVCC_THREADS={parallel.nvcc_threads}, "
              f"arch {settings.cuda_arch})"),
        plan=BuildPlan(
            venv=venv, requirements=f"{LOCK_DIR}/flash-attn.txt",
            index_url=settings.pip_index_url, flash_attn=flash.version,
            archs=settings.cuda_arch, compute_capability=settings.compute_capability,
            cuda_home=settings.cuda_home,
            max_jobs=parallel.max_jobs, nvcc_threads=parallel.nvcc_threads,
            memory_max_bytes=build_memory_max(mem_available_gib),
            cache_root=settings.wheel_cache, download_env=proxy.download_env()),
        reasons=reasons,
    )
