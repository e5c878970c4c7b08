"""The host's settings: its GPUs, the NVIDIA driver and CUDA, the run's lock wait, Secure Boot."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from packaging.version import InvalidVersion, Version

from operations.plans.settings_rules import (
    _BOOL,
    _PATH,
    _PATH_DETAIL,
    _URL,
    _int_between,
    _one_of,
    _Rule,
    _text,
    setting,
)

#: CUDA toolkits this toolkit installs, each with the minimum Linux driver it needs (the
#: "CUDA Toolkit and Corresponding Driver Versions" table of NVIDIA's CUDA release notes,
#: https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/, Table 3, ">= driver" column,
#: Linux x86_64, each release's GA row; every value checked against that table on 2026-11-30).
CUDA_MIN_DRIVER: Final[Mapping[str, str]] = {
    "12.4": "550.54.14",
    "12.6": "560.28.03",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
}

#: CUDA toolkits this toolkit installs (NVIDIA's cuda-toolkit-X-Y in /usr/local/cuda-X.Y), each
#: with its stack's lock, which a host without gpuhost_lock gets (locks/README.md).
CUDA_TOOLKITS: Final = {"12.8": "locks/cuda12.8.txt", "13.0": "locks/cuda13.0.txt"}

#: The CUDA release of PyPI's default Linux x86_64 torch wheels (no local version, no
#: nvidia-cuda-runtime pin in the lock), by torch release (pytorch.org "Previous versions",
#: RELEASE.md's compatibility matrix: the stable CUDA of each release).
TORCH_DEFAULT_CUDA: Final[Mapping[str, str]] = {
    "2.6": "12.4",
    "2.7": "12.6",
    "2.8": "12.8",
    "2.9": "12.8",
}

#: What to do with a driver that no package installed (a runfile, or one mounted from the
#: hypervisor): refuse the run, keep it as it is, or replace it with NVIDIA's packages.
UNPACKAGED_DRIVER: Final = ("refuse", "keep", "replace")

#: Driver branches known to this toolkit (NVIDIA's production and new-feature branches that ship
#: open kernel modules in the CUDA repository for Ubuntu 24.04 and Debian 12).
DRIVER_BRANCHES: Final = ("535", "550", "560", "565", "570", "575", "580", "590")

#: Compute capability from which NVIDIA supports only the open kernel modules (Blackwell, per
#: NVIDIA's driver installation guide, "Recommendation: use the open GPU kernel modules").
OPEN_MODULE_ONLY_FROM: Final = (10, 0)

DRIVER_FLAVOURS: Final = ("open", "proprietary")


def _is_driver_version(value: Any) -> bool:
    if not isinstance(value, str) or not re.fullmatch(r"\d{3}\.\d{2,3}(\.\d{2})?", value):
        return False
    try:
        Version(value)
    except InvalidVersion:
        return False
    return True


@dataclass(frozen=True)
class HostSettings:
    """The host's part of Settings (operations/plans/settings_schema.py)."""
    # The host
    gpu_count: int = setting(
        8, _int_between(1, 64),
        "GPUs the host must have; checked against nvidia-smi when the driver answers")
    compute_capability: str = setting(
        "12.0", _text(r"\d{1,2}\.\d", 'a compute capability such as "9.0" or "12.0"'),
        "the GPUs' compute capability (\"12.0\" is Blackwell SM120); gives the build architecture "
        "(120); checked against nvidia-smi while planning where the driver answers, else before "
        "flash-attn builds")
    # NVIDIA driver and CUDA
    driver_branch: str = setting(
        "580", _one_of(DRIVER_BRANCHES),
        "NVIDIA driver branch: 535, 550, 560, 565, 570, 575, 580 or 590, and at least the minimum "
        "of the CUDA toolkit and of the locked torch's CUDA (`CUDA_MIN_DRIVER` in "
        "`operations/plans/settings.py`: 570 for CUDA 12.8)")
    driver_version: str | None = setting(
        None,
        _Rule(
            lambda v: v is None or _is_driver_version(v),
            'a driver version such as "580.95.05", or None for the newest of the branch',
        ),
        "an exact driver version of the branch, e.g. `\"580.95.05\"`; None takes the branch's "
        "newest")
    driver_flavour: str = setting(
        "open", _one_of(DRIVER_FLAVOURS),
        "`\"open\"` kernel modules, or `\"proprietary\"` (refused on compute capability 10.0 and "
        "newer)")
    allow_driver_change: bool = setting(
        False, _BOOL,
        "allow this run to upgrade or downgrade an installed driver (reboots the host, restarts "
        "the server)")
    unpackaged_driver: str = setting(
        "refuse", _one_of(UNPACKAGED_DRIVER),
        "a driver present that no package installed (runfile, or mounted from the hypervisor): "
        "`\"refuse\"` the run, `\"keep\"` it as it is (checked against the CUDA minimum), or "
        "`\"replace\"` it with NVIDIA's packages")
    cuda_toolkit: str = setting(
        "12.8", _one_of(CUDA_TOOLKITS),
        "the CUDA stack: the toolkit to install (`cuda-toolkit-12-8` in `/usr/local/cuda-12.8`; "
        "`\"13.0\"`: `cuda-toolkit-13-0`, driver branch 580 or newer) and, unless "
        "`gpuhost_lock` is set, its lock (`locks/cuda12.8.txt`, `locks/cuda13.0.txt`); "
        "docs/driver.md")
    cuda_repo_url: str = setting(
        "https://developer.download.nvidia.com/compute/cuda/repos",
        _text(_URL + r"(?<!/)", "an http(s) URL without a trailing slash"),
        "base URL of NVIDIA's CUDA repository (a mirror's, or the sandbox's)")
    cuda_keyring_sha256: str | None = setting(
        None, _text(r"[0-9a-f]{64}", "a sha256 hex digest", optional=True),
        "sha256 the repository's `cuda-archive-keyring.gpg` must have; None checks nothing beyond "
        "HTTPS")
    cuda_repo_adopt: bool = setting(
        False, _BOOL,
        "use an entry of NVIDIA's repository already in the host's apt sources (added by hand, "
        "another `signed-by`) as gpuhost's own and write none; without it such an entry is "
        "refused while planning (docs/driver.md)")
    # The run
    deploy_lock_wait: int = setting(
        0, _int_between(0, 86400),
        "seconds a run waits for another run's deploy lock on the host before it fails (0 to "
        "86400; 0 fails at once, saying who holds it)")
    # Secure Boot: the MOK DKMS signs the driver's kernel module with
    mok_signing_key: str | None = setting(
        None,
        _text(_PATH, "an absolute path on the host of a MOK's private key, "
              f"root-only (mode 0600 or 0400) {_PATH_DETAIL}", optional=True),
        "root-only file (mode 0600/0400) on the host: the private key of an enrolled MOK, with "
        "which DKMS signs the NVIDIA kernel module; needed to build the driver under Secure Boot "
        "(see Secure Boot); set together with `gpuhost_mok_certificate`")
    mok_certificate: str | None = setting(
        None,
        _text(_PATH, "an absolute path on the host of the MOK's DER "
              f"certificate, enrolled {_PATH_DETAIL}", optional=True),
        "file on the host: that key's DER certificate, enrolled as a MOK (`mokutil --test-key` "
        "says \"is already enrolled\")")

    @property
    def cuda_home(self) -> str:
        """The toolkit's prefix, as NVIDIA's cuda-toolkit-X-Y packages install it."""
        return f"/usr/local/cuda-{self.cuda_toolkit}"

    @property
    def cuda_arch(self) -> str:
        """The architecture number nvcc and FLASH_ATTN_CUDA_ARCHS take ("12.0" gives "120")."""
        major, minor = self.compute_capability.split(".")
        return f"{major}{minor}"
