"""Read-only checks of a host before any change: what would fail later fails here."""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import FactBase, deploy
from pyinfra.facts.server import Arch, LinuxDistribution, OsVersion
from typing_extensions import override

from operations.facts.gpu import NvidiaDriver
from operations.facts.host import HostResources
from operations.plans.cuda_repo import repo_folder
from operations.plans.model_revision import fleet_commit
from operations.plans.plan import PlanError, fact, refuse
from operations.plans.settings import Settings
from operations.stages.model import model_room_problem
from operations.stages.secureboot import SecureBoot


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


class InitSystem(FactBase[str]):
    """The name of PID 1 (/proc/1/comm): "systemd" on a VM or bare metal; something else in
    some containers and microVMs (the lent GPU machine's is "process_api")."""

    @override
    def command(self) -> str:
        return "cat /proc/1/comm"

    @override
    def process(self, output: list[str]) -> str:
        return output[0].strip()


@deploy("Preflight")
def preflight(settings: Settings) -> None:
    """Facts only: OS and architecture supported by NVIDIA's repository, the GPUs (when the
    driver already answers) matching host data, the Secure Boot state (which the NVIDIA stage
    weighs against a DKMS build: operations.stages.secureboot), room for the model's download
    (operations.stages.model.model_room_problem). Refuses (operations.plans.plan), with what
    to do, before any change to the host. On a host that serves no model (``gpuhost_serving =
    False``): :func:`router_host_preflight` instead."""
    meta = fact(LinuxDistribution).get("release_meta", {})
    os_id, version_id = meta.get("ID", "").lower(), meta.get("VERSION_ID", "")
    if not settings.serving:
        router_host_preflight(os_id, version_id)
        return
    try:
        folder = repo_folder(os_id, version_id, fact(Arch))
    except PlanError as exc:
        refuse("Preflight", str(exc))
        folder = "unsupported"
    driver = fact(NvidiaDriver)
    resources = fact(HostResources)
    virt = fact(Virtualization)
    secure_boot = fact(SecureBoot)

    if driver.status == "ok":
        count = len(driver.gpus)
        if count != settings.gpu_count:
            refuse("Preflight", f"nvidia-smi lists {count} GPU(s), host data says "
                                f"gpuhost_gpu_count = {settings.gpu_count}: correct the inventory"
                   + (", or, where a GPU fell off the bus (dmesg | grep 'NVRM: Xid'), reboot "
                      "the host, reseat or replace it" if count < settings.gpu_count else ""))
        capabilities = sorted({g.compute_capability for g in driver.gpus})
        if capabilities != [settings.compute_capability]:
            refuse("Preflight", f"the GPUs have compute capability {', '.join(capabilities)}, "
                                "host data says gpuhost_compute_capability = "
                                f"{settings.compute_capability!r}")
        gpus = f"{count} x {driver.gpus[0].name}, driver {driver.driver_version}"
    else:
        gpus = f"driver {driver.status}"
    problem = model_room_problem(fact, settings, fleet_commit(settings))
    if problem:
        refuse("Preflight", problem)
    logger.info(
        f"{host.print_prefix}{os_id} {version_id} ({folder}), kernel {fact(OsVersion)}, "
        f"virtualisation {virt}, {secure_boot.summary()}, PID 1 {fact(InitSystem)}, "
        f"{resources.cores} cores, "
        f"{resources.mem_available_gib:.1f} GiB available; {gpus}"
    )


def router_host_preflight(os_id: str, version_id: str) -> None:
    """A router host that serves no model (a CPU-only VM): no NVIDIA repository, GPU or Secure
    Boot fact (they are the driver's), and no GPU asked of it; refused where PID 1 is not
    systemd (the router runs as a systemd unit). Says what the host is."""
    init = fact(InitSystem)
    if init != "systemd":
        refuse("Preflight", f"PID 1 is {init!r}, not systemd: the router runs as a systemd unit")
    resources = fact(HostResources)
    logger.info(
        f"{host.print_prefix}{os_id} {version_id} ({fact(Arch)}), kernel {fact(OsVersion)}, "
        f"virtualisation {fact(Virtualization)}, PID 1 {init}, {resources.cores} cores, "
        f"{resources.mem_available_gib:.1f} GiB available; serves no model "
        "(gpuhost_serving = False): the router only"
    )
