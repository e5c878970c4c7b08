"""Read-only checks of a host before any change: what would fail later fails here."""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import FactBase, deploy
from pyinfra.facts.server import Arch, LinuxDistribution, OsVersion
from typing_extensions import override

from operations.gpu import NvidiaDriver
from operations.host import HostResources
from operations.nvidia import PlanError, repo_folder
from operations.settings import Settings


class Virtualization(FactBase[str]):
    """What ``systemd-detect-virt`` says: "none" on bare metal, "kvm" in a KVM/QEMU guest
    (Proxmox), "systemd-nspawn" in a container; "unknown" where the tool is missing."""

    default = str

    @override
    def command(self) -> str:
        return "systemd-detect-virt 2>/dev/null || true; echo ."

    @override
    def process(self, output: list[str]) -> str:
        answer = [line for line in output if line.strip() and line.strip() != "."]
        return answer[0].strip() if answer else "unknown"


@deploy("Preflight")
def preflight(settings: Settings) -> None:
    """Facts only: OS and architecture supported by NVIDIA's repository, the GPUs (when the
    driver already answers) matching host data. Raises PlanError, with what to do, before any
    change to the host."""
    meta = host.get_fact(LinuxDistribution).get("release_meta", {})
    os_id, version_id = meta.get("ID", "").lower(), meta.get("VERSION_ID", "")
    folder = repo_folder(os_id, version_id, host.get_fact(Arch))
    driver = host.get_fact(NvidiaDriver)
    resources = host.get_fact(HostResources)
    virt = host.get_fact(Virtualization)

    if driver.status == "ok":
        count = len(driver.gpus)
        if count != settings.gpu_count:
            raise PlanError(
                f"host {host.name}: nvidia-smi lists {count} GPU(s), host data says "
                f"gpuhost_gpu_count = {settings.gpu_count}: correct the inventory"
            )
        capabilities = sorted({g.compute_capability for g in driver.gpus})
        if capabilities != [settings.compute_capability]:
            raise PlanError(
                f"host {host.name}: the GPUs have compute capability {', '.join(capabilities)}, "
                f"host data says gpuhost_compute_capability = {settings.compute_capability!r}"
            )
        gpus = f"{count} x {driver.gpus[0].name}, driver {driver.driver_version}"
    else:
        gpus = f"driver {driver.status}"
    logger.info(
        f"{host.print_prefix}{os_id} {version_id} ({folder}), kernel {host.get_fact(OsVersion)}, "
        f"virtualisation {virt}, {resources.cores} cores, {resources.mem_available_gib:.1f} GiB "
        f"available; {gpus}"
    )
