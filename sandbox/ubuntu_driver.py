"""The driver's packages in NVIDIA's ubuntu2404 repository, for the sandbox's Ubuntu 24.04 hosts
(sandbox/nvidia_repo.py serves them under ubuntu2404/x86_64).

What is real here, and where it was read:

- Names. Up to branch 580 Ubuntu's packages carry the branch (nvidia-dkms-580-open,
  libnvidia-compute-580, nvidia-utils-580: packages.ubuntu.com, source
  nvidia-graphics-drivers-580); from 590 NVIDIA drops it (nvidia-dkms-open, libnvidia-compute;
  cuda-drivers-580 removed): NVIDIA's driver installation guide, "Ubuntu 590 and later packages".
- The module package's relations: nvidia-dkms-580 depends on nvidia-firmware-580-<version>,
  nvidia-kernel-common-580 (>= <version>) and (<= <version>-1), and the same range of
  nvidia-kernel-source-580 (packages.ubuntu.com, nvidia-dkms-580 580.173.02).
- Revisions: "-0ubuntu1" in NVIDIA's ubuntu2404 repository for the 580 era (cuda-compat-13-0
  580.95.05-0ubuntu1, shared/fixtures/h200-1gpu/dpkg-query.txt), "-1ubuntu1" later
  (nvidia-imex 595.71.05-1ubuntu1, NVIDIA/gpu-driver-container#899).
- NVIDIA's pinning packages per branch and per version (nvidia-driver-pinning-580,
  nvidia-driver-pinning-580.105.08; apt-cache search on NVIDIA's repository).

The stand-in's own choices, where no real control data was at hand: the renamed packages of
590 replace the branch-named ones (Conflicts and Replaces on every other name of the same
package), as a rename that keeps the files must; the nvidia-open metapackage depends on the
module, utils and compute packages of its version; 590's source package is named
"nvidia-graphics-drivers" (its branch dropped as from the binary names).
"""

from __future__ import annotations

UNBRANCHED_FROM = 590
#: (base name, description) of the packages each release has, with "{b}" where the branch goes
BASES = ("nvidia-firmware", "nvidia-kernel-common{b}", "nvidia-kernel-source{b}-open",
         "nvidia-dkms{b}-open", "libnvidia-compute{b}", "nvidia-utils{b}")


def revision(version: str) -> str:
    """"580.95.05" gives "580.95.05-0ubuntu1"; 590 and later "-1ubuntu1" (see the docstring)."""
    return f"{version}-{'1' if int(version.split('.')[0]) >= UNBRANCHED_FROM else '0'}ubuntu1"


def names(version: str) -> dict[str, str]:
    """Each base's package name at ``version`` ({"nvidia-dkms{b}-open": "nvidia-dkms-580-open"})."""
    branch = version.split(".")[0]
    b = "" if int(branch) >= UNBRANCHED_FROM else f"-{branch}"
    out = {base: base.format(b=b) for base in BASES}
    out["nvidia-firmware"] = f"nvidia-firmware{b}-{version}"
    return out


def relations(version: str, branches: list[str]) -> dict[str, dict[str, list[str]]]:
    """Depends, Provides, Conflicts and Replaces of each package at ``version``; ``branches``:
    every branch the repository has, whose names the renamed packages replace."""
    v, n = revision(version), names(version)
    others: dict[str, set[str]] = {base: set() for base in BASES if base != "nvidia-firmware"}
    for branch in branches:
        for base, name in names(f"{branch}.0.0").items():
            if base in others and name != n[base]:
                others[base].add(name)
    rel = {name: {"Depends": [], "Conflicts": sorted(others.get(base, ())),
                  "Replaces": sorted(others.get(base, ()))} for base, name in n.items()}
    common, source = n["nvidia-kernel-common{b}"], n["nvidia-kernel-source{b}-open"]
    rel[n["nvidia-dkms{b}-open"]]["Depends"] = [
        n["nvidia-firmware"], f"{common} (>= {version})", f"{common} (<= {v})",
        f"{source} (>= {version})", f"{source} (<= {v})"]
    rel[n["nvidia-utils{b}"]]["Depends"] = [f"{n['libnvidia-compute{b}']} (= {v})", "python3"]
    return rel


def source(version: str) -> str:
    branch = version.split(".")[0]
    return ("nvidia-graphics-drivers" if int(branch) >= UNBRANCHED_FROM
            else f"nvidia-graphics-drivers-{branch}")
