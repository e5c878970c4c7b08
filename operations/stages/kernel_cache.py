"""The server's kernel caches (flashinfer's JIT, Triton's, torch's): in one folder the unit sets,
keyed by the versions and the compute capability they were built for, so that a change of any
starts a fresh one; superseded folders are removed."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from pyinfra.api import FactBase
from pyinfra.operations import files
from typing_extensions import override

from operations.plans.lock import Lock, read_lock
from operations.plans.settings import Settings

#: Where the keyed folders live, one per key, owned by the server's user (its unit names the
#: root writable: ReadWritePaths=, operations/stages/server_unit.py SANDBOX).
KERNEL_CACHE_ROOT: Final = "/var/cache/gpuhost/kernels"
CACHE_TOP: Final = KERNEL_CACHE_ROOT.rsplit("/", 1)[0]

#: The environment variables that place each cache, and the subfolder each gets. Read in the
#: packages' own sources:
#:
#: - ``FLASHINFER_WORKSPACE_BASE``: flashinfer-python 0.6.3, flashinfer/jit/env.py: the JIT
#:   cache is ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<archs>`` (cached_ops,
#:   generated sources) and the downloaded cubins ``.../.cache/flashinfer/cubins``; the base
#:   defaults to the user's home.
#: - ``TRITON_CACHE_DIR``: Triton's compiled kernels (triton 3.6.0's triton/knobs.py, ``cache.dir``,
#:   read by triton/runtime/cache.py; else ``$TRITON_HOME/.triton/cache``, the home by
#:   default); torch's torch/_inductor/runtime/cache_dir_utils.py, triton_cache_dir(), reads it
#:   first too.
#: - ``TORCHINDUCTOR_CACHE_DIR``: torch/_inductor/runtime/cache_dir_utils.py, cache_dir();
#:   else ``/tmp/torchinductor_<user>``.
#: - ``TORCH_EXTENSIONS_DIR``: torch/utils/cpp_extension.py, _get_build_directory(); else
#:   ``~/.cache/torch_extensions``.
CACHE_VARIABLES: Final = {
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
}


@dataclass(frozen=True)
class KernelCacheKey:
    """What the cached kernels were built for: the lock's flashinfer-python and torch versions
    ("none" where the lock has no such pin), the CUDA toolkit the JIT compiles with ("12.8")
    and the GPUs' compute capability ("12.0")."""

    flashinfer: str
    torch: str
    cuda: str
    compute_capability: str

    def slug(self) -> str:
        """The folder's name: ``flashinfer0.6.3-torch2.9.1-cuda12.8-sm120``."""
        raw = (f"flashinfer{self.flashinfer}-torch{self.torch}-cuda{self.cuda}"
               f"-sm{self.compute_capability.replace('.', '')}")
        return re.sub(r"[^A-Za-z0-9.+_-]", "_", raw)


def cache_key(settings: Settings, lock: Lock | None = None) -> KernelCacheKey:
    """The key for a host's settings and its lock (read from ``gpuhost_lock`` when not given)."""
    lock = lock or read_lock(settings.lock_path)
    flashinfer, torch = lock.get("flashinfer-python"), lock.get("torch")
    return KernelCacheKey(flashinfer.version if flashinfer else "none",
                          torch.version if torch else "none", settings.cuda_toolkit,
                          settings.compute_capability)


def cache_folder(key: KernelCacheKey) -> str:
    return f"{KERNEL_CACHE_ROOT}/{key.slug()}"


def cache_env(key: KernelCacheKey) -> dict[str, str]:
    """The server's environment for the key's folder: each of :data:`CACHE_VARIABLES` set to
    its subfolder."""
    folder = cache_folder(key)
    return {name: f"{folder}/{sub}" for name, sub in CACHE_VARIABLES.items()}


class KernelCacheFolders(FactBase[list[str]]):
    """The keyed folders under :data:`KERNEL_CACHE_ROOT` (names), [] where there is none.

    .. code:: python

        ["flashinfer0.6.3-torch2.9.1-cuda12.8-sm120"]
    """

    default = list

    @override
    def command(self) -> str:
        return f"find {KERNEL_CACHE_ROOT} -mindepth 1 -maxdepth 1 -type d -printf '%f\\n' " \
               "2>/dev/null || true"

    @override
    def process(self, output: list[str]) -> list[str]:
        return sorted(line.strip() for line in output if line.strip())


def superseded(present: list[str], key: KernelCacheKey) -> list[str]:
    """The keyed folders that are not the key's."""
    return [name for name in present if name != key.slug()]


def kernel_cache(key: KernelCacheKey, owner: str) -> None:
    """Make the key's folder and its subfolders, mode 0700 and owned by ``owner`` (the
    server's user, group of the same name): compiled code the server writes and loads, no
    one else's to read or change. A folder a server run as root filled (an older gpuhost's)
    is handed over whole: pyinfra's ``files.directory`` with ``recursive`` chowns the tree
    where the folder's own owner differs (pyinfra 3.10, operations/files.py), and leaves the
    tree alone where it does not (a second run changes nothing)."""
    # 0755 whatever root's umask (a hardened host's 077 made them 0700 with mkdir -p): the
    # server's user passes through them to its own folder
    files.directory(name="Kernel caches' top folder", path=CACHE_TOP, user="root",
                    group="root", mode="755")
    files.directory(name="Kernel cache folder", path=KERNEL_CACHE_ROOT, user="root",
                    group="root", mode="755")
    folder = cache_folder(key)
    files.directory(name=f"Kernel cache {key.slug()}", path=folder, user=owner, group=owner,
                    mode="700", recursive=True)
    for sub in CACHE_VARIABLES.values():
        files.directory(name=f"Kernel cache {key.slug()}/{sub}", path=f"{folder}/{sub}",
                        user=owner, group=owner, mode="700")


def remove_superseded(key: KernelCacheKey, present: list[str]) -> None:
    """Remove the keyed folders of other keys: kernels built for another flashinfer, torch,
    CUDA or GPU, which a server of this key never reads again."""
    for name in superseded(present, key):
        files.directory(name=f"Remove the superseded kernel cache {name}",
                        path=f"{KERNEL_CACHE_ROOT}/{name}", present=False)
