"""Facts about the machine under the OS: hypervisor, firmware (DMI), IOMMU and PCIe ACS, as far
as a guest can read them.

The hypervisor and the DMI strings are read through commands, not files: ``systemd-detect-virt``
and ``dmidecode -s`` (falling back to /sys/class/dmi/id, world-readable, where dmidecode is
missing or not run as root). A test host under systemd-nspawn sees its machine's /sys, which
nothing inside it can replace; a command can be answered by a stand-in in the real tool's
format. IOMMU and ACS are read where the guest itself can (/sys/kernel/iommu_groups,
/sys/class/iommu, /proc/cmdline, ``lspci -vvv``'s ACSCtl lines): no stand-in answers those.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final

from pyinfra.api import FactBase
from typing_extensions import override

#: dmidecode -s keywords (dmidecode(8), "-s, --string") and the /sys/class/dmi/id files that
#: hold the same SMBIOS strings.
DMI_KEYS: Final = (
    ("system-manufacturer", "sys_vendor"),
    ("system-product-name", "product_name"),
    ("system-version", "product_version"),
    ("bios-vendor", "bios_vendor"),
    ("bios-version", "bios_version"),
    ("chassis-manufacturer", "chassis_vendor"),
)

_COMMAND: Final = "; ".join([
    ("if command -v systemd-detect-virt >/dev/null 2>&1; then "
    'echo "virt=$(systemd-detect-virt 2>/dev/null)"; else echo virt-absent; fi'),
    ("if command -v dmidecode >/dev/null 2>&1; then "
    'echo "dmidecode-error=$(dmidecode -s system-manufacturer 2>&1 >/dev/null | head -n1)"; '
    f"for k in {' '.join(k for k, _ in DMI_KEYS)}; do "
    'echo "dmidecode:$k=$(dmidecode -s $k 2>/dev/null | head -n1)"; done; '
    "else echo dmidecode-absent; fi"),
    (f"for f in {' '.join(f for _, f in DMI_KEYS)}; do "
    '[ -r /sys/class/dmi/id/$f ] && echo "sysfs:$f=$(cat /sys/class/dmi/id/$f)"; done'),
    'echo "iommu-groups=$(ls /sys/kernel/iommu_groups 2>/dev/null | wc -l)"',
    'echo "iommu-units=$(ls /sys/class/iommu 2>/dev/null | tr "\\n" " ")"',
    'echo "cmdline=$(cat /proc/cmdline 2>/dev/null)"',
    ("if command -v lspci >/dev/null 2>&1; then if out=$(lspci -vvv 2>/dev/null); then "
    "printf '%s\\n' \"$out\" | awk '/^[0-9a-f]/{dev=$1} /ACSCtl:/{print \"acs:\" dev \" \" $0} "
    "/<access denied>/{d=1} END{if (d) print \"lspci-denied\"}'; echo lspci-present; "
    "else echo lspci-failed; fi; else echo lspci-absent; fi"),
    "true",
])


@dataclass(frozen=True)
class VirtInfo:
    """The machine as the guest sees it.

    + detect_virt: what ``systemd-detect-virt`` answers ("none" on bare metal, "kvm" in a
      KVM/QEMU guest such as Proxmox's); None where the tool is missing
    + dmi: SMBIOS strings by /sys/class/dmi/id name (sys_vendor, product_name,
      product_version, bios_vendor, bios_version, chassis_vendor); empty where there are none
    + dmi_source: "dmidecode", "sysfs", or None where there is no DMI
    + iommu_groups: how many IOMMU groups the guest's kernel has (0: no IOMMU in the guest)
    + iommu_units: /sys/class/iommu entries (dmar0, ...) of a virtual IOMMU in the guest
    + iommu_cmdline: the kernel command line's IOMMU words (intel_iommu=on, iommu=pt, ...)
    + acs: ``lspci -vvv`` ACSCtl lines by PCI address; None where lspci is missing, fails,
      or runs without root (capabilities hidden)
    """

    detect_virt: str | None = None
    dmi: dict[str, str] = field(default_factory=dict)
    dmi_source: str | None = None
    iommu_groups: int = 0
    iommu_units: tuple[str, ...] = ()
    iommu_cmdline: tuple[str, ...] = ()
    acs: dict[str, str] | None = None

    @property
    def machine_type(self) -> str | None:
        """QEMU's machine type from the DMI product name: "q35", "i440fx" or None."""
        text = f"{self.dmi.get('product_name', '')} {self.dmi.get('product_version', '')}".lower()
        if "q35" in text:
            return "q35"
        if "i440fx" in text:
            return "i440fx"
        return None

    @property
    def firmware(self) -> str | None:
        """"OVMF" (UEFI, EDK II) or "SeaBIOS" from the BIOS vendor; None when neither."""
        vendor = self.dmi.get("bios_vendor", "")
        if "OVMF" in vendor or "EDK II" in vendor or "EFI Development Kit" in vendor:
            return "OVMF"
        if "SeaBIOS" in vendor:
            return "SeaBIOS"
        return None

    @property
    def proxmox(self) -> bool:
        """Whether the machine version names Proxmox's QEMU build ("pc-q35-9.2+pve1")."""
        return "+pve" in self.dmi.get("product_version", "")

    @property
    def acs_redirecting(self) -> tuple[str, ...]:
        """PCI addresses whose ACS redirects peer requests or completions upstream
        (ReqRedir+ or CmpltRedir+): peer traffic through them takes the root complex."""
        return tuple(sorted(a for a, line in (self.acs or {}).items()
                            if "ReqRedir+" in line or "CmpltRedir+" in line))

    def describe(self) -> str:
        """One line for people, e.g. "kvm, QEMU q35 (pc-q35-9.2+pve1, Proxmox), OVMF,
        no IOMMU in the guest, ACS unknown (no lspci -vvv as root)"."""
        parts = [self.detect_virt or "systemd-detect-virt absent"]
        if self.dmi:
            what = self.dmi.get("sys_vendor", "?")
            if self.machine_type:
                what += f" {self.machine_type}"
            extra = [self.dmi.get("product_version", "")] + (["Proxmox"] if self.proxmox else [])
            extra = [e for e in extra if e]
            parts.append(what + (f" ({', '.join(extra)})" if extra else ""))
            parts.append(self.firmware or self.dmi.get("bios_vendor", "firmware unknown"))
        else:
            parts.append("no DMI")
        if self.iommu_groups or self.iommu_units:
            parts.append(f"IOMMU in the guest ({self.iommu_groups} groups)")
        else:
            parts.append("no IOMMU in the guest")
        if self.acs is None:
            parts.append("ACS unknown (no lspci -vvv as root)")
        elif self.acs_redirecting:
            parts.append(f"ACS redirecting on {', '.join(self.acs_redirecting)}")
        else:
            parts.append("no ACS redirection seen")
        return ", ".join(parts)


def parse_virt(lines: list[str]) -> VirtInfo:
    """Parse the output of :class:`Platform`'s command (one ``key=value`` or marker per
    line). Tolerates every part being absent (the lent H200 machine: no systemd-detect-virt,
    no DMI, no lspci)."""
    detect = None
    dmidecode: dict[str, str] = {}
    sysfs: dict[str, str] = {}
    dmidecode_error = None
    dmidecode_present = False
    groups, units, cmdline, acs, lspci, denied = 0, (), (), {}, False, False
    names = dict(DMI_KEYS)
    for line in lines:
        if line.startswith("virt="):
            detect = line[len("virt="):].strip() or None
        elif line.startswith("dmidecode-error="):
            dmidecode_present = True
            dmidecode_error = line[len("dmidecode-error="):].strip() or None
        elif line.startswith("dmidecode:"):
            key, _, value = line[len("dmidecode:"):].partition("=")
            if key in names and value.strip() not in ("", "Not Specified"):
                dmidecode[names[key]] = value.strip()
        elif line.startswith("sysfs:"):
            key, _, value = line[len("sysfs:"):].partition("=")
            if value.strip():
                sysfs[key] = value.strip()
        elif line.startswith("iommu-groups="):
            value = line.partition("=")[2].strip()
            groups = int(value) if value.isdigit() else 0
        elif line.startswith("iommu-units="):
            units = tuple(line.partition("=")[2].split())
        elif line.startswith("cmdline="):
            cmdline = tuple(w for w in line.partition("=")[2].split()
                            if re.match(r"(intel_iommu|amd_iommu|iommu)(=|\.)", w))
        elif line.startswith("acs:"):
            address, _, rest = line[len("acs:"):].partition(" ")
            acs[address] = " ".join(rest.split())
        elif line.strip() == "lspci-present":
            lspci = True
        elif line.strip() == "lspci-denied":
            denied = True  # not root: extended capabilities, ACS among them, are hidden
    if dmidecode_present and dmidecode_error is None and dmidecode:
        dmi, source = dmidecode, "dmidecode"
    elif dmidecode_present and dmidecode_error and "No SMBIOS" in dmidecode_error:
        dmi, source = {}, None  # dmidecode read the firmware tables: there are none
    elif sysfs:
        dmi, source = sysfs, "sysfs"
    else:
        dmi, source = {}, None
    return VirtInfo(detect, dmi, source, groups, units, cmdline, acs if lspci and not denied else None)


class Platform(FactBase[VirtInfo]):
    """Hypervisor, firmware, IOMMU and ACS as the guest sees them (module docstring).

    .. code:: python

        VirtInfo(detect_virt="kvm", dmi={"sys_vendor": "QEMU", "product_name":
            "Standard PC (Q35 + ICH9, 2009)", "product_version": "pc-q35-9.2+pve1",
            "bios_vendor": "EFI Development Kit II / OVMF", ...}, dmi_source="dmidecode",
            iommu_groups=0, iommu_units=(), iommu_cmdline=(), acs=None)

    Every part may be absent: a Firecracker guest has no DMI and no systemd-detect-virt.
    """

    @override
    def command(self) -> str:
        return _COMMAND

    @override
    def process(self, output: list[str]) -> VirtInfo:
        return parse_virt(list(output))
