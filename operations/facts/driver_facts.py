"""Facts the driver stage reads: kernel headers, apt's versions, the driver's files, PCI GPUs."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Final

from pyinfra.api import FactBase
from typing_extensions import override

#: PCI vendor id of NVIDIA, and the PCI class of display controllers (0300 VGA, 0302 3D):
#: the GPUs, as opposed to the HDMI audio functions of the same cards (pci.ids).
NVIDIA_VENDOR: Final = "10de"


#: Where DKMS installs a module it built for a kernel on Debian and Ubuntu (dkms(8):
#: DEST_MODULE_LOCATION is ignored there for the distribution's /updates/dkms; DKMS says
#: "Installing to /lib/modules/<kernel>/updates/dkms/"), compressed on Ubuntu (nvidia.ko.zst).
DKMS_MODULE: Final = "/lib/modules/{kernel}/updates/dkms/nvidia.ko"


@dataclass(frozen=True)
class Headers:
    """The running kernel (``uname -r``), whether its build tree
    (/lib/modules/<kernel>/build, what DKMS compiles against) exists, and, where it does not,
    apt's candidate for ``linux-headers-<kernel>`` (None: apt knows no installable version, or
    not asked: ``apt-cache policy`` loads apt's whole cache, 0.41 s of a sandbox host's CPU at
    each no-op run, docs/development.md).

    ``next_kernel``: the kernel that boots next where it is not the running one (a newer
    ``linux-image`` installed, not booted yet), else None; the same ``next_build_tree`` and
    ``next_candidate`` for it; ``next_module``: DKMS installed an NVIDIA module for it
    (:data:`DKMS_MODULE`); ``grub_default``: GRUB_DEFAULT of /etc/default/grub, if set."""

    kernel: str
    build_tree: bool
    candidate: str | None
    next_kernel: str | None = None
    next_build_tree: bool = False
    next_candidate: str | None = None
    next_module: bool = False
    grub_default: str | None = None


class KernelHeaders(FactBase[Headers]):
    """Headers for the running kernel and for the kernel that boots next, installed or
    installable.

    .. code:: python

        Headers(kernel="6.1.0-26-amd64", build_tree=False, candidate="6.1.112-1",
                next_kernel="6.1.0-28-amd64", next_build_tree=False,
                next_candidate="6.1.119-1", next_module=False, grub_default="0")

    The kernel that boots next is the newest /boot/vmlinuz-* by ``LC_ALL=C sort -V``: GRUB
    boots its default entry (GRUB_DEFAULT=0, Debian's and Ubuntu's default: the first), and
    update-grub, run by every kernel package's hooks, makes the first entry of the newest
    kernel (grub-mkconfig's 10_linux: ``version_sort -r`` of the images, *.dpkg-* left out).
    DKMS's own postinst picks the same kernel to build for (dkms_common.postinst: the running
    and the newest installed kernel).
    """

    @override
    def command(self) -> str:
        return (
            'k=$(uname -r); echo "kernel=$k"; '
            'if [ -e "/lib/modules/$k/build" ]; then echo build=yes; else echo build=no; '
            "if command -v apt-cache >/dev/null 2>&1; then "
            'apt-cache policy "linux-headers-$k" 2>/dev/null '
            "| sed -n 's/^ *Candidate: */candidate=/p'; fi; fi; "
            "n=$(ls -1 /boot/vmlinuz-* 2>/dev/null | sed 's|^/boot/vmlinuz-||' "
            "| grep -v '[.]dpkg-' | LC_ALL=C sort -V | tail -n 1); "
            'if [ -n "$n" ] && [ "$n" != "$k" ]; then echo "next=$n"; '
            'if [ -e "/lib/modules/$n/build" ]; then echo next_build=yes; '
            "elif command -v apt-cache >/dev/null 2>&1; then "
            'apt-cache policy "linux-headers-$n" 2>/dev/null '
            "| sed -n 's/^ *Candidate: */next_candidate=/p'; fi; "
            'if ls "/lib/modules/$n/updates/dkms/"nvidia.ko* >/dev/null 2>&1; then '
            "echo next_module=yes; fi; fi; "
            "sed -n 's/^GRUB_DEFAULT=/grub_default=/p' /etc/default/grub 2>/dev/null "
            "| tail -n 1; true"
        )

    @override
    def process(self, output: list[str]) -> Headers:
        values = dict(line.split("=", 1) for line in output if "=" in line)

        def candidate(key: str) -> str | None:
            value = values.get(key, "").strip()
            return None if value in ("", "(none)") else value

        return Headers(
            kernel=values.get("kernel", "").strip(),
            build_tree=values.get("build") == "yes",
            candidate=candidate("candidate"),
            next_kernel=values.get("next", "").strip() or None,
            next_build_tree=values.get("next_build") == "yes",
            next_candidate=candidate("next_candidate"),
            next_module=values.get("next_module") == "yes",
            grub_default=values.get("grub_default", "").strip().strip("\"'") or None,
        )


class AptVersions(FactBase["tuple[str, ...] | None"]):
    """The versions of a package that apt's lists offer (``apt-cache madison``), newest first;
    None where apt-cache is missing.

    .. code:: python

        ("580.105.08-1", "580.95.05-1", "570.172.08-1")

    madison's format (apt-cache(8)): one line per version and source,
    "nvidia-kernel-open-dkms | 580.95.05-1 | https://.../debian12/x86_64  Packages".
    """

    @override
    def command(self, package: str) -> str:
        return (f"if command -v apt-cache >/dev/null 2>&1; then "
                f"apt-cache madison {shlex.quote(package)} 2>/dev/null; echo rc=0; "
                "else echo rc=127; fi")

    @override
    def process(self, output: list[str]) -> tuple[str, ...] | None:
        return parse_madison(output)


def parse_madison(output: list[str]) -> tuple[str, ...] | None:
    """Parse :class:`AptVersions`' output: each version once, in apt's order; None for rc=127."""
    if output and output[-1].strip() == "rc=127":
        return None
    versions: list[str] = []
    for line in output:
        fields_ = [f.strip() for f in line.split("|")]
        if len(fields_) >= 3 and fields_[1] and fields_[1] not in versions:
            versions.append(fields_[1])
    return tuple(versions)


@dataclass(frozen=True)
class DriverFiles:
    """Where the driver on a host came from: the path of ``nvidia-smi`` (None: not on PATH), the
    package that installed it (None: no package did, as with NVIDIA's runfile or a driver mounted
    from the hypervisor), and the loaded kernel module's version from
    /proc/driver/nvidia/version (None: no module loaded)."""

    smi_path: str | None
    smi_package: str | None
    module_version: str | None

    @property
    def present(self) -> bool:
        return self.smi_path is not None or self.module_version is not None


class NvidiaDriverFiles(FactBase[DriverFiles]):
    """nvidia-smi's path and owning package (``dpkg-query -S``), and the loaded module's version.

    .. code:: python

        DriverFiles(smi_path="/usr/local/nvidia/bin/nvidia-smi", smi_package=None,
                    module_version="580.159.04")

    The module line is NVIDIA's: "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64
    580.159.04  Release Build ..." (../shared/fixtures/h200-1gpu/system.txt).
    """

    @override
    def command(self) -> str:
        return (
            "if p=$(command -v nvidia-smi 2>/dev/null); then echo \"smi=$p\"; "
            'r=$(readlink -f "$p"); '
            'echo "package=$(dpkg-query -S "$r" 2>/dev/null | grep -v "^diversion" '
            '| head -n 1 | cut -d: -f1)"; fi; '
            "if [ -r /proc/driver/nvidia/version ]; then "
            "sed -n 's/^NVRM version:.*  \\([0-9][0-9.]*\\)  .*/module=\\1/p' "
            "/proc/driver/nvidia/version; fi; echo ."
        )

    @override
    def process(self, output: list[str]) -> DriverFiles:
        values = dict(line.split("=", 1) for line in output if "=" in line)
        return DriverFiles(
            smi_path=values.get("smi") or None,
            smi_package=(values.get("package") or "").strip() or None,
            module_version=(values.get("module") or "").strip() or None,
        )


@dataclass(frozen=True)
class PciGpu:
    """One NVIDIA display controller as ``lspci -Dnnk`` shows it: PCI address
    ("0000:01:00.0") and the kernel driver in use (None: no driver bound)."""

    address: str
    driver: str | None


class PciGpus(FactBase["tuple[PciGpu, ...] | None"]):
    """NVIDIA GPUs on the PCI bus and their kernel driver, from ``lspci -Dnnk -d 10de:``; None
    where lspci is not installed (pciutils).

    .. code:: python

        (PciGpu(address="0000:01:00.0", driver="nouveau"),)

    lspci's format (pciutils, lspci(8)): a device line "0000:01:00.0 3D controller [0302]:
    NVIDIA Corporation GH100 [H200 SXM 141GB] [10de:2335] (rev a1)", then tab-indented lines,
    among them "Kernel driver in use: nvidia". Only class 03xx (display controllers) count.
    """

    @override
    def command(self) -> str:
        return (f"if command -v lspci >/dev/null 2>&1; then lspci -Dnnk -d {NVIDIA_VENDOR}: ; "
                'echo "rc=$?"; else echo rc=127; fi')

    @override
    def process(self, output: list[str]) -> tuple[PciGpu, ...] | None:
        return parse_lspci(output)


def parse_lspci(output: list[str]) -> tuple[PciGpu, ...] | None:
    """Parse :class:`PciGpus`' output (``lspci -Dnnk`` lines, then ``rc=N``); None for rc=127."""
    if output and output[-1].strip() == "rc=127":
        return None
    gpus: list[PciGpu] = []
    current: str | None = None
    driver: str | None = None
    for line in output:
        if re.match(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:", line):
            if current:
                gpus.append(PciGpu(current, driver))
            current = line.split()[0] if re.search(r"\[03[0-9a-fA-F]{2}\]:", line) else None
            driver = None
        elif current and line.strip().startswith("Kernel driver in use:"):
            driver = line.split(":", 1)[1].strip() or None
    if current:
        gpus.append(PciGpu(current, driver))
    return tuple(gpus)
