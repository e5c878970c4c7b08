"""NVIDIA's driver and toolkit package names and versions, per distribution, flavour and branch."""

from __future__ import annotations

import re
from typing import Final

from operations.plans.settings import Settings

#: The packages of each driver flavour in NVIDIA's repository, per distribution family, and
#: the one that carries the kernel module (its version is the installed driver's). Debian's
#: follow Debian's packaging, which NVIDIA's debian12 repository ships (nvidia-kernel-open-dkms
#: 580.95.05-1; sandbox/data/nvidia-graphics-drivers.json): its nvidia-driver only recommends
#: nvidia-smi, and the install leaves recommends out, so the compute packages are named.
#: Ubuntu's follow Ubuntu's naming, which NVIDIA's ubuntu2404 and ubuntu2204 repositories share
#: (nvidia-dkms-580-open 580.95.05-0ubuntu1, packages.ubuntu.com; nvidia-smi is in
#: nvidia-utils-580); from branch 590 NVIDIA drops the branch from those names (nvidia-dkms-open,
#: libnvidia-compute: NVIDIA's driver installation guide, "Ubuntu 590 and later packages"):
#: "{-branch}" is "-580" up to branch 580 and nothing from 590 (:func:`driver_package_names`).
DRIVER_PACKAGES: Final = {
    ("debian", "open"): (("nvidia-open", "nvidia-smi", "libcuda1"), "nvidia-kernel-open-dkms"),
    ("debian", "proprietary"): (("nvidia-driver", "nvidia-smi", "libcuda1"),
                                "nvidia-kernel-dkms"),
    ("ubuntu", "open"): (("nvidia-open", "nvidia-utils{-branch}", "libnvidia-compute{-branch}"),
                         "nvidia-dkms{-branch}-open"),
    ("ubuntu", "proprietary"): (("nvidia-driver{-branch}", "nvidia-utils{-branch}",
                                 "libnvidia-compute{-branch}"), "nvidia-dkms{-branch}"),
}
#: The first branch whose Ubuntu packages carry no branch in their names (see above).
UNBRANCHED_NAMES_FROM: Final = 590
#: Any installed kernel-module package of a flavour, whatever its branch.
MODULE_PACKAGE_NAMES: Final = {
    "open": re.compile(r"nvidia-kernel-open-dkms|nvidia-dkms(-\d+)?-open"),
    "proprietary": re.compile(r"nvidia-kernel-dkms|nvidia-dkms(-\d+)?"),
}
def driver_package_names(folder: str, flavour: str, branch: str) -> tuple[list[str], str]:
    """The driver packages to install and the kernel-module package, for a repository folder
    ("ubuntu2404/x86_64"), a flavour ("open") and a branch ("580")."""
    family = "ubuntu" if folder.startswith("ubuntu") else "debian"
    packages, module = DRIVER_PACKAGES[(family, flavour)]
    suffix = "" if int(branch) >= UNBRANCHED_NAMES_FROM else f"-{branch}"
    return ([p.replace("{-branch}", suffix) for p in packages],
            module.replace("{-branch}", suffix))


def driver_version_glob(settings: Settings) -> str:
    """The apt version pattern of the wanted driver: "580.95.05-*" for an exact version,
    "580.*" for the newest of a branch."""
    if settings.driver_version:
        return f"{settings.driver_version}-*"
    return f"{settings.driver_branch}.*"


def toolkit_package(cuda: str) -> str:
    """NVIDIA's package name of a CUDA toolkit: "12.8" gives "cuda-toolkit-12-8"."""
    return "cuda-toolkit-" + cuda.replace(".", "-")


def renamed_packages(folder: str, flavour: str, installed: tuple[str, ...],
                     debs: dict[str, list[str]], wanted: list[str]) -> list[str]:
    """The installed driver packages that a change to ``wanted`` replaces under other names:
    those of the installed branch (read from the kernel-module package's ``installed``
    versions) that ``wanted`` does not name, on Ubuntu across 590's rename ("nvidia-utils-580"
    when "nvidia-utils" comes); none where the names stay."""
    gone: list[str] = []
    for version in installed:
        branch = upstream(version).split(".")[0]
        if not branch.isdigit():
            continue
        old, old_module = driver_package_names(folder, flavour, branch)
        gone += [n for n in (*old, old_module) if n in debs and n not in wanted and n not in gone]
    return gone


def installed_module_package(flavour: str, debs: dict[str, list[str]],
                             module_package: str) -> str:
    """The kernel-module package installed now: ``module_package`` where it is, else the
    installed one of another name (on Ubuntu, a branch before 590's rename:
    "nvidia-dkms-580-open" when "nvidia-dkms-open" comes); ``module_package`` when none is.
    What a rollback checks the loaded driver against, once it has reinstalled that one."""
    if module_package in debs:
        return module_package
    return next((name for name in sorted(debs)
                 if MODULE_PACKAGE_NAMES[flavour].fullmatch(name)), module_package)


def upstream(version: str) -> str:
    """A Debian package version without epoch and revision: "580.95.05-1" gives "580.95.05"."""
    return version.split(":", 1)[-1].rsplit("-", 1)[0]
