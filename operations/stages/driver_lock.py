"""NVIDIA's pinning package: the lock NVIDIA documents for a driver branch or version, installed
beside gpuhost's own pin (templates/apt-nvidia-pin.j2) where the repository has one.

gpuhost's pin holds every package of the driver's source packages at the version host data
asks for, in any repository (Debian's archive, a mirror, NVIDIA's); NVIDIA's debian12 and
ubuntu repositories also carry ``nvidia-driver-pinning-<branch>`` and
``nvidia-driver-pinning-<version>`` ("APT driver pinning file for driver branch 580",
apt-cache search), which NVIDIA's driver installation guide has installed before the driver
("Version locking"). With both, an operator's own ``apt install`` on the host is held the way
NVIDIA documents it, and the two agree: they name the same branch or version. Pinning packages
of another branch or version would hold apt elsewhere, so they go in the same transaction.
"""

from __future__ import annotations

import re
from typing import Final

from pyinfra import host
from pyinfra.api import StringCommand, operation
from pyinfra.api.exceptions import OperationValueError
from pyinfra.facts.deb import DebPackages

#: NVIDIA's pinning packages, per branch ("nvidia-driver-pinning-580") or version
#: ("nvidia-driver-pinning-580.95.05").
PINNING_PACKAGES: Final = re.compile(r"nvidia-driver-pinning-[0-9][0-9.]*")
#: The shell glob for the same names (dpkg-query patterns).
PINNING_GLOB: Final = "nvidia-driver-pinning-*"


def pinning_package(driver_branch: str, driver_version: str | None) -> str:
    """NVIDIA's pinning package for host data's driver: per version where one is asked for
    ("nvidia-driver-pinning-580.95.05"), else per branch ("nvidia-driver-pinning-580")."""
    return f"nvidia-driver-pinning-{driver_version or driver_branch}"


def drop_pinning_files(parts: str) -> str:
    """Shell lines that remove, from a copy of preferences.d at ``parts`` (a quoted shell
    word), the files of every installed NVIDIA pinning package, so that a simulation answers
    under gpuhost's pin alone (operations.stages.apt_simulation)."""
    return (
        f"for p in $(dpkg-query -W -f='${{Package}}\\n' '{PINNING_GLOB}' 2>/dev/null); do "
        'dpkg-query -L "$p" 2>/dev/null | grep "^/etc/apt/preferences.d/" | '
        f'while read -r f; do rm -f {parts}/"${{f##*/}}"; done; done; '
    )


@operation()
def nvidia_pinning(package: str, offered: bool | None):
    """Install NVIDIA's pinning package ``package`` where the repository has it, removing the
    other pinning packages in the same transaction; where it has none, remove the others and
    leave the lock to gpuhost's pin.

    + package: the pinning package ("nvidia-driver-pinning-580", see :func:`pinning_package`)
    + offered: whether apt's lists offer it, as read while planning; None where the lists are
      updated in this run first (the answer is then read on the host when it runs)
    """
    if not PINNING_PACKAGES.fullmatch(package):
        raise OperationValueError(f"pinning package name {package!r}")
    installed = sorted(n for n in host.get_fact(DebPackages) if PINNING_PACKAGES.fullmatch(n))
    others = [n for n in installed if n != package]
    if package in installed and not others:
        host.noop(f"apt is held by NVIDIA's {package} too")
        return
    if offered is False and not others:
        host.noop(f"the repository has no {package}: gpuhost's pin holds the driver")
        return
    removals = " ".join(f"{n}-" for n in others)
    purge = " ".join(others)
    yield StringCommand(
        f"if [ -n \"$(apt-cache madison {package} 2>/dev/null)\" ]; then "
        "DEBIAN_FRONTEND=noninteractive apt-get -y -q install --no-install-recommends "
        f"{package} {removals}; "
        + (f"else DEBIAN_FRONTEND=noninteractive apt-get -y -q purge {purge}; "
           if others else "else true; ")
        + "fi"
    )
