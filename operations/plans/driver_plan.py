"""The driver stage's decision from a host's facts, made before any change (no side effects)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from packaging.version import Version

from operations.facts.driver_facts import DriverFiles, Headers, PciGpu
from operations.facts.nvsmi import DriverState
from operations.plans.cuda_repo import AptSource, SourcesCheck, check_sources
from operations.plans.driver_names import (
    MODULE_PACKAGE_NAMES,
    driver_package_names,
    driver_version_glob,
    toolkit_package,
    upstream,
)
from operations.plans.settings import CUDA_MIN_DRIVER, Settings

@dataclass(frozen=True)
class DriverPlan:
    """What the nvidia stage will do on one host, decided from facts before any change.

    ``installed``: the kernel-module package's installed versions; ``target``: the apt version
    pattern host data asks for; ``install``: the driver packages will be installed or changed;
    ``change``: an installed driver changes version (an upgrade or a downgrade);
    ``reboot_reasons``: why a reboot follows (empty: none); ``refusals``: why the stage must not
    run (empty: it may); ``warnings``: what is reported and left alone; ``keep_present``: a
    driver no package installed is used as it is; ``present``: the version nvidia-smi or
    /proc/driver/nvidia reports, if any; ``adopted``: the host's own entries of NVIDIA's
    repository used instead of gpuhost's (:func:`check_sources`); ``repo_listed``: apt lists
    the repository now; ``kernel``: the running kernel; ``next_kernel``: the kernel that boots
    next where it is not the running one and the driver's module must be built for it too
    (``next_module``: DKMS has built it); ``next_headers_unknown``: whether apt can install its
    headers is known only once NVIDIA's repository is in apt's lists.
    """

    installed: tuple[str, ...]
    target: str
    install: bool
    change: bool
    toolkit_installed: str | None
    toolkit_target: str
    reboot_reasons: tuple[str, ...] = ()
    refusals: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    keep_present: bool = False
    headers_unknown: bool = False
    present: str | None = None
    adopted: tuple[AptSource, ...] = ()
    repo_listed: bool = False
    kernel: str = ""
    next_kernel: str | None = None
    next_module: bool = False
    next_headers_unknown: bool = False

    def summary(self, resolved: str | None = None) -> str:
        """One line for the log and --dry: installed and target versions, what follows;
        ``resolved``: the version apt's simulation would install ("590.44.01-1"), if known."""
        driver = ", ".join(upstream(v) for v in self.installed) or "none"
        if self.keep_present:
            driver = f"{self.present or 'of unknown version'} by no package (kept)"
        tk = upstream(self.toolkit_installed) if self.toolkit_installed else "none"
        target = self.target.rstrip("-*") if self.target.endswith("-*") else (
            f"newest {self.target}")
        if resolved and not self.target.endswith("-*"):
            target += f" ({resolved} in apt's lists)"
        follows = []
        if self.reboot_reasons:
            into = f" into kernel {self.next_kernel}" if self.next_kernel else ""
            follows.append(f"a reboot{into} ({'; '.join(self.reboot_reasons)}) and a server "
                           "restart")
        line = (f"driver installed {driver}, target {target}"
                f"{' (a driver change)' if self.change else ''}; CUDA toolkit installed {tk}, "
                f"target {self.toolkit_target}")
        if self.next_kernel:
            line += (f"; kernel {self.next_kernel} boots next (installed, not running yet): its "
                     "headers and the NVIDIA module for it as well as for the running "
                     f"{self.kernel}" + (" (its module built already)" if self.next_module
                                         else ""))
        return line + ("; then " + ", ".join(follows) if follows else "; no reboot")


def plan_driver(
    settings: Settings,
    *,
    debs: dict[str, list[str]],
    state: DriverState,
    files_: DriverFiles,
    headers: Headers,
    gpus: tuple[PciGpu, ...] | None,
    sources: list[AptSource],
    repo_url: str,
    source_path: str,
    lists_present: bool,
    folder: str = "debian12/x86_64",
    available: tuple[str, ...] | None = None,
) -> DriverPlan:
    """Decide the nvidia stage from a host's facts (no side effects; units: none).

    Refuses: an entry of NVIDIA's repository added by hand that apt could not read beside
    gpuhost's (:func:`check_sources`; adopted instead with ``gpuhost_cuda_repo_adopt``); an
    installed driver other than the one host data asks for, unless
    ``gpuhost_allow_driver_change``; a driver no package installed, unless
    ``gpuhost_unpackaged_driver`` says "keep" or "replace"; a driver install when the running
    kernel has no headers and apt offers none (DKMS could not build the module: the host would
    come back from its reboot without a driver), and the same for the kernel that boots next
    (a newer one installed, not booted: :class:`KernelHeaders`) when this run reboots (a
    warning otherwise); a driver install when apt's lists of NVIDIA's
    repository (``available``: the kernel-module package's versions, apt-cache madison; None
    when the repository is not configured yet, and then the install checks it) have no version
    host data asks for: apt would ignore the pin and install the branch's newest. Reboots when
    the loaded module is not the installed one (nvidia-smi: "Driver/library version
    mismatch"), when no module is loaded although the packages are installed, after an
    install, and when nouveau holds a GPU.
    """
    packages, module_package = driver_package_names(folder, settings.driver_flavour,
                                                    settings.driver_branch)
    installed = _installed_versions(settings.driver_flavour, debs)
    target = driver_version_glob(settings)
    toolkit = toolkit_package(settings.cuda_toolkit)
    tk_versions = sorted(debs.get(toolkit) or ())
    refusals: list[str] = []
    warnings: list[str] = []

    listing = _listing(settings, sources, repo_url, source_path, debs, refusals, warnings)
    keep = _unpackaged(settings, state, files_, installed, module_package, refusals, warnings)
    change = _change(settings, installed, target, refusals)
    # The metapackage and the module decide whether the driver is installed (and a reboot
    # follows); a compute package missing beside them (nvidia-smi, which hosts converged before
    # it was named may lack) installs at the pinned version without one.
    install = not keep and (change or any(p not in debs for p in (packages[0], module_package)))

    configured = lists_present and listing.listed
    if install and configured:
        refusals.extend(_version_missing(settings, module_package, target, available))
    headers_unknown = install and _headers_missing(headers, debs, configured, refusals)
    reasons = [] if keep else _reboot_reasons(state, gpus, install, installed)
    next_kernel = headers.next_kernel if not keep and (install or installed) else None
    next_headers_unknown = _next_kernel_checks(headers, debs, next_kernel, configured,
                                               bool(reasons), refusals, warnings)

    return DriverPlan(
        installed=installed,
        target=target,
        install=install,
        change=change,
        toolkit_installed=tk_versions[0] if tk_versions else None,
        toolkit_target=f"{settings.cuda_toolkit} ({toolkit})",
        reboot_reasons=tuple(reasons),
        refusals=tuple(refusals),
        warnings=tuple(warnings),
        keep_present=keep,
        headers_unknown=headers_unknown,
        present=state.driver_version or files_.module_version,
        adopted=listing.adopted,
        repo_listed=listing.listed,
        kernel=headers.kernel,
        next_kernel=next_kernel,
        next_module=bool(next_kernel) and headers.next_module,
        next_headers_unknown=next_headers_unknown,
    )


def _installed_versions(flavour: str, debs: dict[str, list[str]]) -> tuple[str, ...]:
    """The installed versions of the flavour's kernel-module packages, whatever their branch."""
    return tuple(sorted(v for name, versions in debs.items()
                        if MODULE_PACKAGE_NAMES[flavour].fullmatch(name) for v in versions))


def _listing(settings: Settings, sources: list[AptSource], repo_url: str, source_path: str,
             debs: dict[str, list[str]], refusals: list[str],
             warnings: list[str]) -> SourcesCheck:
    """The host's entries of NVIDIA's repository (:func:`check_sources`), their refusals and
    warnings added, and the warning of the distribution's nvidia-cuda-toolkit."""
    listing = check_sources(sources, repo_url, source_path, settings.cuda_repo_adopt)
    refusals.extend(listing.refusals)
    warnings.extend(listing.warnings)
    if "nvidia-cuda-toolkit" in debs:
        warnings.append("the distribution's nvidia-cuda-toolkit is installed: its nvcc is not "
                        f"the one builds use ({settings.cuda_home}/bin/nvcc); remove it")
    return listing


def _change(settings: Settings, installed: tuple[str, ...], target: str,
            refusals: list[str]) -> bool:
    """Whether an installed driver changes version; adds the refusal where host data does not
    allow the change (gpuhost_allow_driver_change)."""
    change = bool(installed) and not any(fnmatch.fnmatch(v, target) for v in installed)
    if change and not settings.allow_driver_change:
        refusals.append(
            f"driver {', '.join(upstream(v) for v in installed)} is installed, host data asks "
            f"for {target} (gpuhost_driver_branch, gpuhost_driver_version). A driver change "
            "reboots the host and restarts the server: set gpuhost_allow_driver_change = True "
            "for this run to allow it")
    return change


def _unpackaged(settings: Settings, state: DriverState, files_: DriverFiles,
                installed: tuple[str, ...], module_package: str, refusals: list[str],
                warnings: list[str]) -> bool:
    """Whether a driver no package installed is kept as it is (gpuhost_unpackaged_driver =
    'keep'); adds to ``refusals`` and ``warnings`` what such a driver, or an nvidia-smi of
    another package, calls for."""
    unpackaged = files_.present and not installed and (
        files_.smi_package is None or state.status == "absent")
    keep = False
    if unpackaged:
        what = (f"nvidia-smi at {files_.smi_path}" if files_.smi_path
                else "no nvidia-smi") + (
            f", kernel module {files_.module_version} loaded" if files_.module_version else "")
        if settings.unpackaged_driver == "keep":
            keep = True
            warnings.append(f"a driver no package installed is present ({what}): kept as it is "
                            "(gpuhost_unpackaged_driver = 'keep')")
        elif settings.unpackaged_driver == "refuse":
            refusals.append(
                f"a driver no package installed is present ({what}: a runfile install, or "
                "mounted from the hypervisor). Installing NVIDIA's packages over it could leave "
                "the host without a working driver. Set gpuhost_unpackaged_driver = 'keep' to "
                "use it as it is, or 'replace' to install NVIDIA's packages over it "
                "(uninstall a runfile driver first: nvidia-uninstall)")
    elif files_.smi_package and not installed:
        warnings.append(
            f"nvidia-smi comes from the package {files_.smi_package}, not with NVIDIA's "
            f"repository's {module_package}: apt resolves the two drivers' packages")
    if keep:
        loaded = state.driver_version or files_.module_version
        minimum = CUDA_MIN_DRIVER[settings.cuda_toolkit]
        if loaded and Version(loaded) < Version(minimum):
            refusals.append(
                f"the present driver {loaded} is older than {minimum}, the minimum for CUDA "
                f"{settings.cuda_toolkit} (gpuhost_cuda_toolkit): upgrade it where it comes "
                "from, or set gpuhost_unpackaged_driver = 'replace'")
    return keep


def _version_missing(settings: Settings, module_package: str, target: str,
                     available: tuple[str, ...] | None) -> list[str]:
    """The refusal of an install whose ``target`` apt's lists (``available``) do not offer: apt
    would ignore the pin; none where they offer it or are not known."""
    if available is None or any(fnmatch.fnmatch(v, target) for v in available):
        return []
    offered = [upstream(v) for v in available
               if upstream(v).startswith(f"{settings.driver_branch}.")] or [
        upstream(v) for v in available]
    return [f"NVIDIA's repository has no {module_package} {target} (gpuhost_driver_branch, "
            f"gpuhost_driver_version): it has {', '.join(offered) or 'no version of it'}. apt "
            "would install another driver than the one pinned: set gpuhost_driver_version to "
            "one it has, or None for the branch's newest"]


def _headers_missing(headers: Headers, debs: dict[str, list[str]], configured: bool,
                     refusals: list[str]) -> bool:
    """For a driver install: whether the running kernel's headers are neither installed nor
    known to apt yet (True: only the updated lists can tell); adds the refusal where apt's lists
    of the configured repository have none."""
    headers_package = f"linux-headers-{headers.kernel}"
    have_headers = headers.build_tree or headers_package in debs
    if have_headers or headers.candidate is not None:
        return False
    if not configured:
        return True
    refusals.append(
        f"no kernel headers for the running kernel {headers.kernel}: apt has no "
        f"installable {headers_package}, so DKMS cannot build the NVIDIA module and the "
        "host would come back from its reboot without a driver. Install the headers, "
        "or boot a kernel whose headers the archive still has, then run again")
    return False


def _reboot_reasons(state: DriverState, gpus: tuple[PciGpu, ...] | None, install: bool,
                    installed: tuple[str, ...]) -> list[str]:
    """Why a packaged driver needs a reboot: an install, the loaded module not the installed
    one or none loaded, nouveau holding a GPU; empty when none does."""
    reasons: list[str] = []
    if install:
        reasons.append("the driver is installed or changed: its module loads at boot")
    elif state.status == "mismatch":
        reasons.append(f"the loaded module is not the installed driver (NVML "
                       f"{state.library_version}: driver/library version mismatch)")
    elif state.status == "not-loaded":
        reasons.append("the installed driver's module is not loaded")
    elif (state.status == "ok" and state.driver_version and installed
          and state.driver_version not in {upstream(v) for v in installed}):
        reasons.append(f"the loaded driver {state.driver_version} is not the installed one")
    bound = [g for g in gpus or () if g.driver == "nouveau"]
    if bound:
        reasons.append(f"nouveau holds {', '.join(g.address for g in bound)}")
    return reasons


def _next_kernel_checks(headers: Headers, debs: dict[str, list[str]], next_kernel: str | None,
                        configured: bool, reboots: bool, refusals: list[str],
                        warnings: list[str]) -> bool:
    """For the kernel that boots next: whether its headers are known only once the lists are
    updated; adds the refusal (this run reboots) or the warning (it does not) where apt has no
    headers for it, and the warning of a GRUB_DEFAULT that may boot another kernel."""
    next_headers_unknown = False
    if next_kernel and not headers.next_module:
        next_package = f"linux-headers-{next_kernel}"
        if not (headers.next_build_tree or next_package in debs
                or headers.next_candidate is not None):
            if not configured:
                next_headers_unknown = True
            elif reboots:
                refusals.append(
                    f"no kernel headers for the kernel that boots next, {next_kernel} "
                    f"(installed, not running yet): apt has no installable {next_package}, so "
                    "DKMS cannot build the NVIDIA module for it, and the reboot this run makes "
                    "would boot it without a driver. Install its headers, or remove "
                    f"linux-image-{next_kernel} (the running kernel {headers.kernel} then stays "
                    "the one that boots), then run again")
            else:
                warnings.append(
                    f"no kernel headers for the kernel that boots next, {next_kernel} "
                    f"(installed, not running yet): apt has no installable {next_package}, so "
                    "DKMS cannot build the NVIDIA module for it and the host's next reboot "
                    "would come up without a driver; install its headers and run again")
    if next_kernel and headers.grub_default not in (None, "0"):
        warnings.append(
            f"GRUB_DEFAULT={headers.grub_default} in /etc/default/grub: the kernel that boots "
            f"next may not be {next_kernel}, the newest installed; the NVIDIA module is built "
            f"for it and for the running {headers.kernel}, and the check after a reboot says "
            "which kernel booted")
    return next_headers_unknown
