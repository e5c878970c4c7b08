"""What apt would do for the driver packages: ``apt-get -s`` (a simulation, apt-get(8)), read
with LC_ALL=C, under the pin the nvidia stage writes.

Its lines, as apt 2.6 on Debian 12 prints them (tests/fixtures/apt-get-s/): "Inst libssl3
[3.0.19-1~deb12u2] (3.0.20-1~deb12u2 Debian:12.15/oldstable [amd64])" (the installed version in
brackets, none for a new package), "Remv jq [1.6-2.1+deb12u1]", "Conf ..." and, when apt would
not, "E: ..." lines.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Final

from jinja2 import Template
from pyinfra.api import FactBase
from pyinfra.api.exceptions import OperationError
from typing_extensions import override

from operations import REPO_ROOT
from operations.stages.driver_lock import drop_pinning_files

PIN_FILE: Final = "gpuhost-nvidia-driver"  # in /etc/apt/preferences.d (the nvidia stage's pin)

#: The driver install's apt-get options (operations.stages.driver_install.driver_packages), which
#: the simulation repeats so that it answers for the same transaction.
INSTALL_OPTIONS: Final = ("--no-install-recommends", "--allow-downgrades",
                          "--allow-change-held-packages")


@dataclass(frozen=True)
class PackageChange:
    """One package a transaction changes: its installed version (None: newly installed) and
    the version it gets (None: removed)."""

    package: str
    installed: str | None
    version: str | None

    def describe(self) -> str:
        if self.version is None:
            return f"{self.package} removed (now {self.installed})"
        if self.installed is None:
            return f"{self.package} {self.version} (new)"
        return f"{self.package} {self.version} (now {self.installed})"


@dataclass(frozen=True)
class Simulation:
    """What ``apt-get -s install`` says it would do; ``error``: apt's E: lines when it would not."""

    changes: tuple[PackageChange, ...] = ()
    error: str | None = None

    def version_of(self, package: str) -> str | None:
        return next((c.version for c in self.changes if c.package == package), None)


_INST: Final = re.compile(r"^Inst (\S+) (?:\[([^]\s]+)\] )?\(([^\s)]+)")
_REMV: Final = re.compile(r"^Remv (\S+)(?: \[([^]\s]+)\])?")


def parse_simulation(lines: list[str]) -> Simulation:
    """Parse ``apt-get -s`` output (LC_ALL=C) followed by a ``rc=N`` line (see the module
    docstring for the line formats)."""
    changes: list[PackageChange] = []
    errors: list[str] = []
    rc = 0
    for line in lines:
        if m := _INST.match(line):
            changes.append(PackageChange(m.group(1), m.group(2), m.group(3)))
        elif m := _REMV.match(line):
            changes.append(PackageChange(m.group(1), m.group(2), None))
        elif line.startswith("E: "):
            errors.append(line[3:].strip())
        elif line.startswith("rc="):
            rc = int(line[3:] or 1)
    if rc != 0 or errors:
        return Simulation(tuple(changes), "; ".join(errors) or f"apt-get -s exited {rc}")
    return Simulation(tuple(changes))


def pin_text(version_glob: str) -> str:
    """The nvidia stage's apt pin for ``version_glob`` (templates/apt-nvidia-pin.j2)."""
    return Template((REPO_ROOT / "templates" / "apt-nvidia-pin.j2").read_text()).render(
        version_glob=version_glob)


def simulation_command(packages: list[str], version_glob: str) -> str:
    """``apt-get -s install`` of the driver packages under the pin the run writes: the host's
    own preferences.d, with gpuhost's pin file replaced by the one for ``version_glob`` and
    NVIDIA's pinning packages' files left out (they name the installed branch; the run replaces
    them with the one for ``version_glob``, operations.stages.driver_lock), in a temporary folder
    (apt.conf(5): Dir::Etc::PreferencesParts). Changes nothing on the host."""
    for name in packages:
        if not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", name):
            raise OperationError(f"package name {name!r}")
    names = " ".join(packages)
    return (
        't=$(mktemp -d) || exit 1; mkdir "$t/parts"; '
        'for f in /etc/apt/preferences.d/*; do [ -f "$f" ] && cp -p "$f" "$t/parts/"; done; '
        + drop_pinning_files('"$t/parts"') +
        f"printf '%s\\n' {shlex.quote(pin_text(version_glob))} > \"$t/parts/{PIN_FILE}\"; "
        f'LC_ALL=C apt-get -s -o Dir::Etc::PreferencesParts="$t/parts" install '
        f"{' '.join(INSTALL_OPTIONS)} {names} 2>&1; "
        'echo "rc=$?"; rm -rf "$t"'
    )


class DriverSimulation(FactBase[Simulation]):
    """What apt would install for the driver packages at a version pattern, from the host's
    lists (``apt-get -s``, see :func:`simulation_command`).

    .. code:: python

        Simulation(changes=(PackageChange("nvidia-open", "580.95.05-1", "590.44.01-1"), ...))
    """

    @override
    def command(self, packages: list[str], version_glob: str) -> str:
        return simulation_command(packages, version_glob)

    @override
    def process(self, output: list[str]) -> Simulation:
        return parse_simulation(output)
