"""Manage NVIDIA's CUDA apt repository, the driver (open kernel modules) and the CUDA toolkit."""

from __future__ import annotations

import fnmatch
import re
from io import StringIO
from pathlib import Path
from typing import Final

from pyinfra import host, logger
from pyinfra.api import StringCommand, deploy, operation
from pyinfra.api.exceptions import OperationValueError
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.server import Arch, LinuxDistribution, OsVersion
from pyinfra.operations import apt, files, server
from pyinfra.operations.util import any_changed

from operations.gpu import NvidiaDriver
from operations.host import AptListsPresent, HeldPackages, reboot
from operations.plan import PlanError, refuse
from operations import REPO_ROOT
from operations.settings import Settings

#: NVIDIA's repository folder per (os-release ID, VERSION_ID) and per machine architecture
#: (https://developer.download.nvidia.com/compute/cuda/repos/: ubuntu2404/x86_64, .../sbsa).
REPO_DISTROS: Final = {
    ("ubuntu", "24.04"): "ubuntu2404",
    ("ubuntu", "22.04"): "ubuntu2204",
    ("debian", "12"): "debian12",
}
REPO_ARCHES: Final = {"x86_64": "x86_64", "aarch64": "sbsa"}

KEYRING: Final = "/usr/share/keyrings/cuda-archive-keyring.gpg"
#: What fetching the repository's key needs on a minimal image (pyinfra's files.download runs
#: curl or wget on the host).
PREREQUISITES: Final = ("ca-certificates", "curl")

#: The packages of each driver flavour in NVIDIA's repository, and the one that carries the
#: kernel module (its version is the installed driver's).
DRIVER_PACKAGES: Final = {
    "open": (("nvidia-open",), "nvidia-kernel-open-dkms"),
    "proprietary": (("nvidia-driver", "nvidia-kernel-dkms"), "nvidia-kernel-dkms"),
}


def repo_folder(os_id: str, version_id: str, arch: str) -> str:
    """The repository folder for an OS and architecture, for example "ubuntu2404/x86_64".

    Raises PlanError for an OS or architecture NVIDIA's repository does not serve.
    """
    distro = REPO_DISTROS.get((os_id, version_id))
    if distro is None:
        known = ", ".join(f"{i} {v}" for i, v in REPO_DISTROS)
        raise PlanError(f"no NVIDIA CUDA repository for {os_id} {version_id}; "
                        f"supported: {known}")
    if arch not in REPO_ARCHES:
        raise PlanError(f"no NVIDIA CUDA repository for {arch}; "
                        f"supported: {', '.join(REPO_ARCHES)}")
    return f"{distro}/{REPO_ARCHES[arch]}"


def driver_version_glob(settings: Settings) -> str:
    """The apt version pattern of the wanted driver: "580.95.05-*" for an exact version,
    "580.*" for the newest of a branch."""
    if settings.driver_version:
        return f"{settings.driver_version}-*"
    return f"{settings.driver_branch}.*"


def toolkit_package(cuda: str) -> str:
    """NVIDIA's package name of a CUDA toolkit: "12.8" gives "cuda-toolkit-12-8"."""
    return "cuda-toolkit-" + cuda.replace(".", "-")


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


@operation(is_idempotent=False)
def driver_answers(version_glob: str):
    """Check that nvidia-smi answers and the loaded driver matches ``version_glob``
    (an apt-style pattern such as "580.*"). Fails the host otherwise."""
    pattern = version_glob.split("-")[0]
    if not re.fullmatch(r"[0-9.*]+", pattern):
        raise OperationValueError(f"driver version pattern {version_glob!r}: digits, '.', '*'")
    # Unquoted on purpose: the shell's case matches it as a glob; checked above.
    yield StringCommand(
        "v=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1) "
        f"&& case \"$v\" in {pattern}) echo \"driver $v loaded\";; "
        f"*) echo \"loaded driver $v, expected {pattern}\" >&2; exit 1;; esac"
    )


@deploy("NVIDIA driver and CUDA toolkit")
def nvidia(settings: Settings):
    """Converge NVIDIA's repository, the driver branch (open kernel modules by default), the
    CUDA toolkit, package holds, and reboot only when the loaded driver is not the installed
    one.

    + settings: the host's validated settings

    Refuses (operations.plan) an OS without NVIDIA's repository, or an installed driver that
    differs from the wanted one while ``gpuhost_allow_driver_change`` is False.
    """
    distro = host.get_fact(LinuxDistribution)
    meta = distro.get("release_meta", {})
    try:
        folder = repo_folder(meta.get("ID", "").lower(), meta.get("VERSION_ID", ""),
                             host.get_fact(Arch))
    except PlanError as exc:
        refuse("NVIDIA", str(exc))
        return
    repo_url = f"{settings.cuda_repo_url}/{folder}/"
    debs = host.get_fact(DebPackages)
    state = host.get_fact(NvidiaDriver)
    packages, module_package = DRIVER_PACKAGES[settings.driver_flavour]
    installed = sorted(debs.get(module_package, ()))
    target = driver_version_glob(settings)

    if state.status != "absent" and not installed:
        logger.warning(
            f"{host.print_prefix}an NVIDIA driver is present ({state.status}, "
            f"{state.driver_version or state.library_version or 'version unknown'}) but no "
            f"package installed it: not touching it"
        )
        return

    change = bool(installed) and not any(fnmatch.fnmatch(v, target) for v in installed)
    if change and not settings.allow_driver_change:
        refuse(
            "NVIDIA",
            f"driver {', '.join(installed)} is installed, host data asks for {target} "
            "(gpuhost_driver_branch, gpuhost_driver_version). A driver change reboots the host "
            "and restarts the server: set gpuhost_allow_driver_change = True to allow it",
        )
        return

    lists_present = host.get_fact(AptListsPresent)
    tools = [p for p in PREREQUISITES if p not in debs]
    apt.packages(name="Download tools", packages=list(PREREQUISITES), no_recommends=True,
                 update=bool(tools) or not lists_present)
    keyring = files.download(
        name="NVIDIA repository signing key",
        src=f"{repo_url}cuda-archive-keyring.gpg",
        dest=KEYRING,
        sha256sum=settings.cuda_keyring_sha256,
        mode="644",
    )
    source = files.put(
        name="NVIDIA CUDA repository",
        src=StringIO(f"deb [signed-by={KEYRING}] {repo_url} /\n"),
        # The file name cuda-keyring's package uses, so that both never make two entries.
        dest=f"/etc/apt/sources.list.d/cuda-{folder.replace('/', '-')}.list",
        mode="644",
    )
    pin = files.template(
        name=f"Pin the driver to {target}",
        src=str(_templates() / "apt-nvidia-pin.j2"),
        dest="/etc/apt/preferences.d/gpuhost-nvidia-driver",
        version_glob=target,
        mode="644",
    )
    kernel = host.get_fact(OsVersion)
    headers = f"linux-headers-{kernel}"
    toolkit = toolkit_package(settings.cuda_toolkit)
    missing = [p for p in (headers, *packages, toolkit) if p not in debs]
    stale_lists = bool(missing) or change or not lists_present
    apt.update(name="Update apt lists", _if=lambda: stale_lists or any_changed(keyring, source, pin)())
    files.put(
        name="Keep unattended-upgrades off the driver and CUDA",
        src=str(_templates() / "51gpuhost-unattended-upgrades"),
        dest="/etc/apt/apt.conf.d/51gpuhost-unattended-upgrades",
        mode="644",
    )
    blacklist = files.put(
        name="Blacklist nouveau",
        src=str(_templates() / "gpuhost-blacklist-nouveau.conf"),
        dest="/etc/modprobe.d/gpuhost-blacklist-nouveau.conf",
        mode="644",
    )
    server.shell(
        name="Rebuild the initramfs without nouveau",
        commands=["if command -v update-initramfs >/dev/null; then update-initramfs -u; fi"],
        _if=blacklist.did_change,
    )

    apt.packages(name=f"Kernel headers for {kernel}", packages=[headers], no_recommends=True)
    driver = apt.packages(
        name=f"NVIDIA driver ({settings.driver_flavour} kernel modules, {target})",
        packages=list(packages),
        no_recommends=True,
        latest=change,
        allow_downgrades=change,
        extra_install_args="--allow-change-held-packages" if change else None,
    )
    apt.packages(name=f"CUDA toolkit {settings.cuda_toolkit}", packages=[toolkit],
                 no_recommends=True)
    held(name="Hold the driver and CUDA packages", packages=[*packages, module_package, toolkit])

    stale = bool(installed) and state.status in ("not-loaded", "mismatch")
    rebooted = reboot(
        name="Reboot to load the installed driver",
        _if=lambda: driver.did_change() or stale,
    )
    driver_answers(name="Check the loaded driver", version_glob=target, _if=rebooted.did_change)


def _templates() -> Path:
    return REPO_ROOT / "templates"
