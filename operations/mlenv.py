"""Manage the ML venv: the locked stack (torch, sglang, flashinfer) and flash-attn built from
source with a capped build parallelism."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from io import StringIO
from typing import Final
from urllib.parse import urlsplit

from pyinfra import host
from pyinfra.api import FactBase, StringCommand, deploy, operation
from pyinfra.api.exceptions import FactProcessError, PyinfraError
from pyinfra.operations import apt, files, pip
from typing_extensions import override

from operations.host import HostResources
from operations.lock import Lock, read_lock
from operations.settings import Settings

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


class VenvPackages(FactBase[dict[str, str]]):
    """Distributions installed in a venv, by canonical name (``pip list --format=json``).

    .. code:: python

        {"torch": "2.9.1+cu128", "sglang": "0.5.9"}

    pyinfra's PipPackages drops versions with a local part such as ``+cu128``; this does not.
    Empty where the venv does not exist yet.
    """

    default = dict

    @override
    def requires_command(self, venv: str) -> str:
        return f"{venv}/bin/python"

    @override
    def command(self, venv: str) -> str:
        return (f"{shlex.quote(venv)}/bin/python -m pip list --format=json "
                "--disable-pip-version-check --no-python-version-warning 2>/dev/null")

    @override
    def process(self, output: list[str]) -> dict[str, str]:
        from packaging.utils import canonicalize_name

        try:
            listed = json.loads("\n".join(output))
            return {canonicalize_name(d["name"]): d["version"] for d in listed}
        except (ValueError, KeyError, TypeError) as exc:
            raise FactProcessError(f"pip list: cannot read {output[:3]!r}") from exc


def pip_index_args(index_url: str) -> list[str]:
    """pip's index options. An http index is trusted for transport only: every file is
    checked against the lock's hashes (--require-hashes) whatever the transport."""
    args = ["--index-url", index_url]
    if urlsplit(index_url).scheme == "http":
        args += ["--trusted-host", urlsplit(index_url).hostname or ""]
    return args


def drift(installed: dict[str, str], wanted: dict[str, str]) -> dict[str, tuple[str | None, str]]:
    """Locked distributions whose installed version differs: name -> (installed, locked).
    Local version parts are compared too (torch 2.9.1+cu128 is not 2.9.1+cu130)."""
    out = {}
    for name, version in wanted.items():
        have = installed.get(name)
        if have != version and (have or "").split("+")[0] != version:
            out[name] = (have, version)
    return out


@operation()
def locked_packages(venv: str, requirements: str, wanted: dict[str, str], index_url: str,
                    env: dict[str, str] | None = None, build_isolation: bool = True):
    """Install a venv's distributions from a lock file on the host, only those that drifted.

    + venv: the venv's path
    + requirements: path on the host of a requirements file with hashes
    + wanted: canonical name -> locked version, to compare with what is installed
    + index_url: the PEP 503 index to install from
    + env: environment for the install (a build's MAX_JOBS, CUDA_HOME, PATH prefix)
    + build_isolation: False to build sdists against the venv's own torch
    """
    changes = drift(host.get_fact(VenvPackages, venv=venv), wanted)
    if not changes:
        host.noop(f"{', '.join(sorted(wanted))} at the locked versions")
        return
    command = []
    if env:
        command += ["env", *(f"{k}={shlex.quote(v)}" for k, v in env.items())]
    command += [f"{venv}/bin/python", "-m", "pip", "install", "--no-deps", "--require-hashes",
                "--disable-pip-version-check", *pip_index_args(index_url)]
    if not build_isolation:
        command.append("--no-build-isolation")
    command += ["-r", requirements]
    yield StringCommand(*command)


@deploy("ML venv")
def mlenv(settings: Settings):
    """Converge the venv at ``gpuhost_venv_path`` to the lock ``gpuhost_lock``, then build
    flash-attn from source for the GPUs' compute capability with MAX_JOBS capped by memory.

    + settings: the host's validated settings

    Returns the operations whose change means the server must restart. Raises LockError for
    a lock that does not parse, BuildError for a MAX_JOBS or NVCC_THREADS above the host's
    safe bound (both before any change).
    """
    lock: Lock = read_lock(settings.lock_path)
    resources = host.get_fact(HostResources)
    try:
        parallel = build_parallelism(resources.cores, resources.mem_available_gib,
                                     settings.max_jobs, settings.nvcc_threads)
    except BuildError as exc:
        raise BuildError(f"host {host.name}: {exc}") from None
    venv = settings.venv_path

    apt.packages(name="Python venv and build tools", packages=list(BUILD_PACKAGES),
                 no_recommends=True)
    files.directory(name="Lock folder", path=LOCK_DIR, mode="755")
    files.put(name=f"Lock {lock.path.name}", src=StringIO(lock.requirements((FLASH_ATTN,))),
                      dest=f"{LOCK_DIR}/stack.txt", mode="644")
    pip.venv(name=f"venv {venv}", path=venv, python="python3")
    stack = locked_packages(
        name="Locked ML stack",
        venv=venv,
        requirements=f"{LOCK_DIR}/stack.txt",
        wanted={p.name: p.version for p in lock.pins if p.name != FLASH_ATTN},
        index_url=settings.pip_index_url,
    )
    flash = lock.get(FLASH_ATTN)
    if flash is None:
        return [stack]
    files.put(name="Lock flash-attn", src=StringIO(flash.line + "\n"),
              dest=f"{LOCK_DIR}/flash-attn.txt", mode="644")
    cuda = settings.cuda_home
    built = locked_packages(
        name=(f"flash-attn {flash.version} from source (MAX_JOBS={parallel.max_jobs}, "
              f"NVCC_THREADS={parallel.nvcc_threads}, arch {settings.cuda_arch})"),
        venv=venv,
        requirements=f"{LOCK_DIR}/flash-attn.txt",
        wanted={FLASH_ATTN: flash.version},
        index_url=settings.pip_index_url,
        build_isolation=False,
        env={
            "MAX_JOBS": str(parallel.max_jobs),
            "NVCC_THREADS": str(parallel.nvcc_threads),
            "FLASH_ATTN_CUDA_ARCHS": settings.cuda_arch,
            # Build here: without it flash-attn's setup.py fetches a prebuilt wheel instead.
            "FLASH_ATTENTION_FORCE_BUILD": "TRUE",
            "CUDA_HOME": cuda,
            "PATH": f"{cuda}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        },
    )
    return [stack, built]
