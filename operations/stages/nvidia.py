"""The nvidia stage: NVIDIA's repository, the driver (open kernel modules), the CUDA toolkit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.server import Arch, LinuxDistribution
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus
from pyinfra.operations import apt, files, server, systemd
from pyinfra.operations.util import any_changed

from operations import REPO_ROOT
from operations.facts.driver_facts import (
    AptVersions,
    Headers,
    KernelHeaders,
    NvidiaDriverFiles,
    PciGpus,
)
from operations.facts.gpu import NvidiaDriver
from operations.facts.host import AptListsPresent, DpkgInterrupted, FileText
from operations.plans.cuda_repo import AptSources, repo_folder, repository_entry, source_file
from operations.plans.driver_names import (
    driver_package_names,
    installed_module_package,
    renamed_packages,
    toolkit_package,
)
from operations.plans.driver_plan import DriverPlan, plan_driver
from operations.plans.plan import PlanError, fact, refuse
from operations.plans.settings import Settings
from operations.stages import driver_lock, driver_rollback, roll
from operations.stages.apt_simulation import DriverSimulation
from operations.stages.driver_checks import (
    booted_kernel_module,
    driver_failure,
    headers_installable,
    module_built,
)
from operations.stages.driver_install import driver_packages, held
from operations.stages.package_runs import dpkg_finished, lists_updated
from operations.stages.reboot import reboot
from operations.stages.secureboot import SigningPlan, dkms_signing, secure_boot_signing

#: What fetching the repository's key needs on a minimal image (pyinfra's files.download runs
#: curl or wget on the host), and lspci, which says which kernel driver holds each GPU.
PREREQUISITES: Final = ("ca-certificates", "curl", "pciutils")

#: The server unit (operations/stages/server.py) that must never run across a driver change.
SERVER_UNIT: Final = "sglang.service"

#: The server unit's drop-in this stage writes (templates/sglang-driver-gate.conf).
DRIVER_GATE_DROPIN: Final = "10-gpuhost-driver-gate.conf"
#: What a rolling host's driver change is called in the roll (operations/stages/roll.py in_turn).
DRIVER_CHANGE: Final = "the driver change"


@dataclass
class _Stage:
    """What the stage's steps share on one host: the settings, the repository's folder, URL and
    source file, the facts read while planning, the plan and its packages, the driver
    rollback's records and the Secure Boot signing plan; ``stale_lists`` and
    ``configured_lists`` once the repository's entries are planned."""

    settings: Settings
    folder: str
    repo_url: str
    source_path: str
    debs: dict[str, list[str]]
    lists_present: bool
    headers: Headers
    plan: DriverPlan
    packages: list[str]
    module_package: str
    removals: list[str]
    pending: dict[str, Any] | None
    last_good: Any
    signing: SigningPlan
    stale_lists: bool = False
    configured_lists: bool = False


@deploy("NVIDIA driver and CUDA toolkit")
def nvidia(settings: Settings):
    """Converge NVIDIA's repository, the driver branch (open kernel modules by default), the
    CUDA toolkit, package holds, unattended-upgrades exclusions and the nouveau blacklist;
    reboot only when needed (see :func:`plan_driver`) and then verify the driver.

    + settings: the host's validated settings

    Logs, per host (also in --dry), the installed and target versions of the driver and the
    CUDA toolkit and whether a reboot and a server restart follow. Refuses (operations.plans.plan)
    before any change: an OS without NVIDIA's repository, what :func:`plan_driver` refuses,
    and a DKMS build under Secure Boot without an enrolled MOK in host data
    (operations.stages.secureboot.plan_signing); DKMS's signing configuration is written before the
    driver's packages install.
    The server unit is stopped before the driver packages change, the host is rebooted
    before the server stage runs (on a rolling host whose server runs, all of it waits for the
    host's turn in the roll instead: :func:`driver_change`, operations/stages/roll.py), and a
    drop-in (templates/sglang-driver-gate.conf) keeps the unit from starting while nvidia-smi fails
    (no driver, or a driver/library version mismatch), so that no server runs across a driver
    change.

    Returns the stage's :class:`DriverPlan` (None where the stage is refused or finishes an
    interrupted rollback): the P2P stage reads from it whether the driver changes in this run.
    """
    stage = _planned(settings)
    if stage is None:
        return None
    _apt_ready(stage)
    if stage.pending and stage.pending.get("phase") == "rolling-back":
        driver_rollback.finished(
            name=f"Finish the interrupted driver rollback to {stage.pending.get('from')}",
            packages=list(stage.packages), module_package=stage.module_package,
            gpu_count=settings.gpu_count, failure_of=driver_failure, server_unit=SERVER_UNIT)
        return None
    _repository(stage)
    _host_files(stage)
    dkms_signing(settings, stage.signing)
    running = bool(fact(SystemdStatus, services=SERVER_UNIT).get(SERVER_UNIT))
    if not stage.plan.keep_present:
        _driver(stage, running)
    _toolkit_and_holds(stage)
    return stage.plan


def _planned(settings: Settings) -> _Stage | None:
    """Read the host's facts and decide (:func:`plan_driver`); log the plan, its warnings and
    the rollback's lines; refuse and return None where the plan or Secure Boot refuses."""
    meta = fact(LinuxDistribution).get("release_meta", {})
    try:
        folder = repo_folder(meta.get("ID", "").lower(), meta.get("VERSION_ID", ""),
                             fact(Arch))
    except PlanError as exc:
        refuse("NVIDIA", str(exc))
        return None
    repo_url = f"{settings.cuda_repo_url}/{folder}/"
    source_path = source_file(folder)
    debs = fact(DebPackages)
    lists_present = fact(AptListsPresent)
    headers = fact(KernelHeaders)
    plan = plan_driver(
        settings,
        debs=debs,
        state=fact(NvidiaDriver),
        files_=fact(NvidiaDriverFiles),
        headers=headers,
        gpus=fact(PciGpus),
        sources=fact(AptSources),
        repo_url=repo_url,
        source_path=source_path,
        lists_present=lists_present,
        folder=folder,
        available=fact(AptVersions, package=driver_package_names(
            folder, settings.driver_flavour, settings.driver_branch)[1]),
    )
    packages, module_package = driver_package_names(folder, settings.driver_flavour,
                                                    settings.driver_branch)
    removals = renamed_packages(folder, settings.driver_flavour, plan.installed, debs,
                                [*packages, module_package])
    pending = driver_rollback.pending_change(fact(FileText, path=driver_rollback.CHANGE))
    last_good = driver_rollback.load(fact(FileText, path=driver_rollback.LAST_GOOD))
    _log_plan(plan, lists_present, packages, module_package, removals, pending, last_good)
    signing = secure_boot_signing(settings, builds=plan.install)
    for reason in (*plan.refusals, *signing.refusals):
        refuse("NVIDIA", reason)
    if plan.refusals or signing.refusals:
        return None
    return _Stage(settings, folder, repo_url, source_path, debs, lists_present, headers, plan,
                  list(packages), module_package, removals, pending, last_good, signing)


def _log_plan(plan: DriverPlan, lists_present: bool, packages: list[str], module_package: str,
              removals: list[str], pending: dict[str, Any] | None, last_good: Any) -> None:
    """Log the plan's line (with the version apt's simulation would install, where the
    repository is in apt's lists), its warnings and the driver rollback's lines."""
    simulation = None
    if plan.install and not plan.keep_present and lists_present and plan.repo_listed:
        simulation = fact(DriverSimulation,
                          packages=[*packages, module_package, *(f"{r}-" for r in removals)],
                          version_glob=plan.target)
    resolved = simulation.version_of(module_package) if simulation else None
    logger.info(f"{host.print_prefix}NVIDIA: {plan.summary(resolved)}")
    for warning in plan.warnings:
        logger.warning(f"{host.print_prefix}NVIDIA: {warning}")
    for level, line in driver_rollback.plan_lines(
            install=plan.install and not plan.keep_present, change=plan.change,
            module_package=module_package, simulation=simulation, last_good=last_good,
            pending=pending):
        getattr(logger, level)(f"{host.print_prefix}NVIDIA: {line}")


def _apt_ready(stage: _Stage) -> None:
    """apt waits for dpkg's lock, and an interrupted package run is finished first."""
    files.put(
        name="apt waits for dpkg's lock",
        src=str(_templates() / "50gpuhost-dpkg-lock-timeout"),
        dest="/etc/apt/apt.conf.d/50gpuhost-dpkg-lock-timeout",
        mode="644",
    )
    interrupted = fact(DpkgInterrupted)
    if interrupted:
        logger.warning(f"{host.print_prefix}NVIDIA: an earlier package run was interrupted "
                       f"({interrupted[0]}{', ...' if len(interrupted) > 1 else ''}): "
                       "finishing it with dpkg --configure -a")
        dpkg_finished(name="Finish the interrupted package run (dpkg --configure -a)")


def _repository(stage: _Stage) -> None:
    """The download tools, NVIDIA's repository (key, entry, pin), apt's lists updated where
    they are stale or those changed, and the kernel headers' check where only the updated
    lists can say whether apt has them."""
    plan, headers, debs = stage.plan, stage.headers, stage.debs
    tools = [p for p in PREREQUISITES if p not in debs]
    if tools or not stage.lists_present:
        lists_updated(name="Update apt lists (for the download tools)")
    apt.packages(name="Download tools and lspci", packages=list(PREREQUISITES),
                 no_recommends=True)
    entries = repository_entry(stage.settings, stage.repo_url, stage.source_path, plan.adopted,
                               plan.target)
    toolkit = toolkit_package(stage.settings.cuda_toolkit)
    missing = [p for p in (toolkit,) if p not in debs]
    stale_lists = plan.install or bool(missing) or not stage.lists_present
    stage.stale_lists = stale_lists
    stage.configured_lists = stage.lists_present and any(
        s.file == stage.source_path for s in fact(AptSources))
    lists_updated(name="Update apt lists",
                  _if=lambda: stale_lists or any_changed(
                      *(op for op in entries if op is not None))())
    if plan.headers_unknown:
        headers_installable(name=f"Kernel headers installable for {headers.kernel}",
                            kernel=headers.kernel)
    if plan.next_headers_unknown and plan.next_kernel:
        headers_installable(name=f"Kernel headers installable for {plan.next_kernel} (the "
                            "kernel that boots next)", kernel=plan.next_kernel,
                            role="the kernel that boots next")


def _host_files(stage: _Stage) -> None:
    """unattended-upgrades kept off the driver, nouveau blacklisted (the initramfs rebuilt
    without it), and the server unit's driver gate."""
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

    gate = files.put(
        name=f"{SERVER_UNIT} starts only on a matching driver",
        src=str(_templates() / "sglang-driver-gate.conf"),
        dest=f"/etc/systemd/system/{SERVER_UNIT}.d/{DRIVER_GATE_DROPIN}",
        mode="644",
    )
    systemd.daemon_reload(name="Reload systemd units (driver gate)", _if=gate.did_change)


def _driver(stage: _Stage, running: bool) -> None:
    """The kernel headers, the installed driver kept for a rollback, and the driver's change:
    in this host's turn of the roll where it changes a rolling host's driver, else in place."""
    settings, plan, headers = stage.settings, stage.plan, stage.headers
    packages, module_package, removals = stage.packages, stage.module_package, stage.removals
    kernels = [headers.kernel, *([plan.next_kernel] if plan.next_kernel else [])]
    apt.packages(name=f"Kernel headers for {' and '.join(kernels)}"
                 + (" (the running kernel and the one that boots next)"
                    if plan.next_kernel else ""),
                 packages=[f"linux-headers-{k}" for k in kernels], no_recommends=True)
    if plan.install and plan.installed:
        driver_rollback.kept(
            name="Keep the installed driver's packages for a rollback",
            packages=[*packages, *(f"{r}-" for r in removals)],
            module_package=module_package,
            version_glob=plan.target,
            kept_module_package=installed_module_package(settings.driver_flavour, stage.debs,
                                                         module_package))
    name = host.name
    pinning = driver_lock.pinning_package(settings.driver_branch, settings.driver_version)
    offered = (bool(fact(AptVersions, package=pinning))
               if stage.configured_lists and not stage.stale_lists else None)
    if plan.install and plan.installed and roll.in_turn(
            DRIVER_CHANGE, lambda when: driver_change(settings, plan, packages, module_package,
                                                 running, when, (pinning, offered),
                                                 removals),
            running=running, reboots=bool(plan.reboot_reasons),
            stops=lambda: driver_rollback.rolled_back(name)):
        logger.info(f"{host.print_prefix}NVIDIA: the driver changes in this host's turn "
                    "of the roll, out of the router")
    else:
        driver_change(settings, plan, packages, module_package, running,
                      lock=(pinning, offered), removals=removals)


def _toolkit_and_holds(stage: _Stage) -> None:
    """The CUDA toolkit, the packages held, and the loaded driver checked (and recorded as
    verified) where no reboot follows but a change is pending or none was verified yet."""
    settings, plan = stage.settings, stage.plan
    toolkit = toolkit_package(settings.cuda_toolkit)
    apt.packages(name=f"CUDA toolkit {settings.cuda_toolkit}", packages=[toolkit],
                 no_recommends=True)
    holds = ([toolkit] if plan.keep_present
             else [*stage.packages, stage.module_package, toolkit])
    held(name="Hold the driver and CUDA packages", packages=holds)
    if not plan.reboot_reasons and not plan.keep_present and (
            stage.pending or (plan.installed and stage.last_good is None)):
        driver_rollback.checked(
            name="Check the loaded driver (and record it as verified)",
            packages=list(stage.packages), module_package=stage.module_package,
            gpu_count=settings.gpu_count, failure_of=driver_failure)


def driver_change(settings: Settings, plan: DriverPlan, packages: list[str],
                  module_package: str, running: bool,
                  when: Callable[[], bool] | None = None,
                  lock: tuple[str, bool | None] | None = None,
                  removals: list[str] | None = None) -> None:
    """Plan the driver's change (see :func:`nvidia`): the server stopped, NVIDIA's pinning
    package (``lock``: its name and whether the lists offer it, operations.stages.driver_lock), the
    packages, the reboot and the loaded driver's check; ``when``: its host's turn in the roll
    (each operation runs only then, and the server is enabled again after the check, restarted
    by the roll), else None (in place; the server stage enables and starts the server)."""
    only = [when] if when else []
    if plan.install and (running or fact(SystemdEnabled, services=SERVER_UNIT).get(
            SERVER_UNIT)):
        # Disabled too: started at the reboot's boot, it would be stopped again by the P2P
        # check; it starts once, on the new driver.
        systemd.service(name=f"Stop {SERVER_UNIT} before the driver changes",
                        service=SERVER_UNIT, running=False, enabled=False, _if=only)
    if lock:
        driver_lock.nvidia_pinning(
            name=f"NVIDIA's {lock[0]}, where the repository has it (apt's lock)",
            package=lock[0], offered=lock[1], _if=only)
    driver_packages(
        name=f"NVIDIA driver ({settings.driver_flavour} kernel modules, {plan.target})",
        packages=list(packages),
        module_package=module_package,
        version_glob=plan.target,
        allow_change=settings.allow_driver_change,
        removals=list(removals or ()),
        _if=only,
    )
    if plan.next_kernel:
        module_built(name=f"NVIDIA module for kernel {plan.next_kernel} (boots next)",
                     kernel=plan.next_kernel, built=plan.next_module, _if=only)
    if plan.reboot_reasons:
        rebooted = reboot(name="Reboot: " + "; ".join(plan.reboot_reasons), _if=only)
        booted_kernel_module(
            name="The booted kernel has the NVIDIA module",
            expected=plan.next_kernel or plan.kernel, _if=[*only, rebooted.did_change])
        driver_rollback.checked(
            name="Check the loaded driver (rolled back to the kept one if it fails)",
            packages=list(packages), module_package=module_package,
            gpu_count=settings.gpu_count, failure_of=driver_failure,
            _if=[*only, rebooted.did_change])
    if when:
        # apt-get's --allow-change-held-packages leaves the new packages unheld: the stage's
        # hold ran before them (seen on the sandbox: the next run held them again)
        held(name="Hold the changed driver packages", packages=[*packages, module_package],
             _if=only)
        systemd.service(name=f"Enable {SERVER_UNIT} again (the roll restarts it)",
                        service=SERVER_UNIT, running=False, enabled=True, _if=only)


def _templates() -> Path:
    return REPO_ROOT / "templates"
