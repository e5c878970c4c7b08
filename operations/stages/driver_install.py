"""Operations that install NVIDIA's driver packages at the pinned version and hold them."""

from __future__ import annotations

import fnmatch
import re

from pyinfra import host
from pyinfra.api import StringCommand, operation
from pyinfra.api.exceptions import OperationError, OperationValueError
from pyinfra.facts.deb import DebPackages

from operations.facts.host import HeldPackages
from operations.plans.driver_names import MODULE_PACKAGE_NAMES

@operation()
def held(packages: list[str]):
    """Hold packages (``apt-mark hold``) so that no apt upgrade changes them under a running
    server.

    + packages: package names to hold
    """
    holds = host.get_fact(HeldPackages)
    missing = [p for p in packages if p not in holds]
    if not missing:
        host.noop(f"held: {', '.join(packages)}")
        return
    yield StringCommand("apt-mark", "hold", *missing)


@operation()
def driver_packages(packages: list[str], module_package: str, version_glob: str,
                    allow_change: bool = False, removals: list[str] | None = None):
    """Install NVIDIA's driver packages at the version apt's pin selects (templates/
    apt-nvidia-pin.j2), or change an installed driver to it.

    + packages: the flavour's packages ("nvidia-open")
    + module_package: the package carrying the kernel module ("nvidia-kernel-open-dkms")
    + version_glob: the wanted version as an apt pattern ("580.*", "580.95.05-*")
    + allow_change: allow changing an installed driver of another version (held packages are
      changed too); without it such a change raises OperationError
    + removals: installed packages the change replaces under other names (Ubuntu's
      nvidia-dkms-580-open when nvidia-dkms-open 590 comes, :func:`renamed_packages`), removed
      in the same transaction: apt's resolver does not remove a held package for a Conflicts
      of its own accord ("pkgProblemResolver::Resolve generated breaks, this may be caused by
      held packages", seen on the sandbox's Ubuntu host)

    pyinfra's apt.packages leaves held packages alone, which a driver change must not. apt
    ignores a pin that matches no version and installs the newest instead, so the install is
    refused when apt's lists (``apt-cache madison``) have no version matching ``version_glob``,
    and the host fails unless the installed ``module_package`` then matches it.
    """
    for name in (module_package, *(removals or ())):
        if not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", name):
            raise OperationValueError(f"package name {name!r}")
    if not re.fullmatch(r"[0-9][0-9.]*(-\*|\.\*)", version_glob):
        raise OperationValueError(f"driver version pattern {version_glob!r}")
    debs = host.get_fact(DebPackages)
    installed = sorted(v for name, versions in debs.items()
                       if any(p.fullmatch(name) for p in MODULE_PACKAGE_NAMES.values())
                       for v in versions)
    wanted = [*packages, module_package]
    matches = any(fnmatch.fnmatch(v, version_glob) for v in installed)
    if installed and not matches and not allow_change:
        raise OperationError(
            f"{module_package} {', '.join(installed)} installed, {version_glob} wanted: "
            "a driver change needs gpuhost_allow_driver_change")
    if installed and matches and all(p in debs for p in wanted):
        host.noop(f"driver {', '.join(installed)} installed ({version_glob})")
        return
    args = ["--no-install-recommends"]
    if installed:
        args += ["--allow-downgrades", "--allow-change-held-packages"]
    # version_glob and module_package are checked above: safe unquoted, and the glob must stay
    # unquoted to match in `case`.
    yield StringCommand(
        f"ok=; have=; for v in $(apt-cache madison {module_package} | cut -d'|' -f2); do "
        f"have=\"$have $v\"; case \"$v\" in {version_glob}) ok=1;; esac; done; "
        f"if [ -z \"$ok\" ]; then echo \"NVIDIA's repository has no {module_package} "
        f"{version_glob} (it has:${{have:- none}}): set gpuhost_driver_version to one it has\" "
        ">&2; exit 1; fi"
    )
    gone = [f"{r}-" for r in removals or () if r in debs]
    yield StringCommand(
        "DEBIAN_FRONTEND=noninteractive", "apt-get", "-y",
        "-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold",
        "install", *args, *wanted, *gone,
    )
    yield StringCommand(
        f"p=$(dpkg-query -W -f='${{Version}}' {module_package}); case \"$p\" in "
        f"{version_glob}) ;; *) echo \"{module_package} $p installed, {version_glob} wanted\" "
        ">&2; exit 1;; esac"
    )

