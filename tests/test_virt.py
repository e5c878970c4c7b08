"""Platform facts (operations/facts/virt.py) on outputs of real machines and of the sandbox's
stand-ins (sandbox/standins/virt), which must answer in the real tools' formats."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from operations.facts.virt import Platform, parse_virt
from sandbox import scenarios

STANDINS = Path(__file__).resolve().parents[1] / "sandbox" / "standins" / "virt"

# What the fact's command printed on the lent H200 (a Firecracker guest, 2026-11-29: no
# systemd-detect-virt, no dmidecode, no DMI, no lspci; /sys/kernel/iommu_groups empty).
H200 = [
    "virt-absent",
    "dmidecode-absent",
    "iommu-groups=0",
    "iommu-units=",
    ("cmdline=mitigations=auto,no_guest_host,no_guest_guest console=ttyS0 quiet reboot=k "
    "panic=1 random.trust_cpu=1 swiotlb=noforce psi=1 rdinit=/process_api pci=realloc=off"),
    "lspci-absent",
]

# A Proxmox q35 guest with a virtual IOMMU and lspci, read as root.
PROXMOX_Q35 = [
    "virt=kvm",
    "dmidecode-error=",
    "dmidecode:system-manufacturer=QEMU",
    "dmidecode:system-product-name=Standard PC (Q35 + ICH9, 2009)",
    "dmidecode:system-version=pc-q35-9.2+pve1",
    "dmidecode:bios-vendor=EFI Development Kit II / OVMF",
    "dmidecode:bios-version=4.2025.02-3",
    "dmidecode:chassis-manufacturer=QEMU",
    "sysfs:sys_vendor=QEMU",
    "iommu-groups=14",
    "iommu-units=dmar0 ",
    "cmdline=BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro intel_iommu=on iommu=pt quiet",
    ("acs:00:1c.0 \t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ "
    "EgressCtrl- DirectTrans-"),
    ("acs:00:1c.1 \t\tACSCtl:\tSrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd- "
    "EgressCtrl- DirectTrans-"),
    "lspci-present",
]


def test_the_h200_firecracker_guest_has_nothing_to_say():
    info = Platform().process(H200)
    assert info.detect_virt is None and info.dmi == {} and info.dmi_source is None
    assert info.machine_type is None and info.firmware is None and not info.proxmox
    assert info.iommu_groups == 0 and info.iommu_cmdline == () and info.acs is None
    assert info.describe() == ("systemd-detect-virt absent, no DMI, no IOMMU in the guest, "
                               "ACS unknown (no lspci -vvv as root)")


def test_proxmox_q35_with_iommu_and_acs():
    info = parse_virt(PROXMOX_Q35)
    assert info.detect_virt == "kvm" and info.dmi_source == "dmidecode"
    assert (info.machine_type, info.firmware, info.proxmox) == ("q35", "OVMF", True)
    assert info.iommu_groups == 14 and info.iommu_units == ("dmar0",)
    assert info.iommu_cmdline == ("intel_iommu=on", "iommu=pt")
    assert info.acs_redirecting == ("00:1c.0",)
    assert "QEMU q35 (pc-q35-9.2+pve1, Proxmox), OVMF" in info.describe()
    assert "ACS redirecting on 00:1c.0" in info.describe()


def test_dmidecode_without_root_falls_back_to_sysfs():
    info = parse_virt([
        "virt=kvm",
        "dmidecode-error=/sys/firmware/dmi/tables/smbios_entry_point: Permission denied",
        "dmidecode:system-manufacturer=",
        "sysfs:sys_vendor=QEMU",
        "sysfs:product_name=Standard PC (i440FX + PIIX, 1996)",
        "sysfs:bios_vendor=SeaBIOS",
        "iommu-groups=0",
        "lspci-absent",
    ])
    assert info.dmi_source == "sysfs"
    assert (info.machine_type, info.firmware) == ("i440fx", "SeaBIOS")


def test_bare_metal():
    info = parse_virt(["virt=none", "dmidecode-error=", "dmidecode:system-manufacturer=Supermicro",
                       "dmidecode:system-version=Not Specified", "lspci-present"])
    assert info.detect_virt == "none" and info.dmi == {"sys_vendor": "Supermicro"}
    assert info.machine_type is None and info.acs == {} and info.acs_redirecting == ()


def test_lspci_without_root_or_refusing_says_nothing_of_acs():
    assert parse_virt(["lspci-denied", "lspci-present"]).acs is None
    assert parse_virt(["lspci-failed"]).acs is None


@pytest.mark.skipif(os.geteuid() != 0, reason="dmidecode, stand-in or real, needs root")
@pytest.mark.parametrize("name", scenarios.names())
def test_standins_answer_the_scenario_through_the_facts_own_command(tmp_path, name):
    hardware = scenarios.load(name)
    (tmp_path / "hw.json").write_text(json.dumps(hardware))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("systemd-detect-virt", "dmidecode"):
        (bin_dir / tool).write_text((STANDINS / tool).read_text())
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "GPUHOST_SANDBOX_HARDWARE": str(tmp_path / "hw.json")}
    out = subprocess.run(["sh", "-c", Platform().command()], env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    info = parse_virt(out)
    virt = hardware["virtualization"]
    assert info.detect_virt == virt["systemd_detect_virt"]
    if virt["dmi"] is None:
        assert info.dmi_source is None or info.dmi_source == "sysfs"  # the machine's own, if any
    else:
        assert info.dmi_source == "dmidecode"
        assert info.dmi == {k: v for k, v in virt["dmi"].items() if k in info.dmi}
        assert info.dmi["sys_vendor"] == virt["dmi"]["sys_vendor"]


def test_standin_detect_virt_exit_status_is_the_real_tools(tmp_path):
    for answer, status in (("kvm", 0), ("none", 1)):
        (tmp_path / "hw.json").write_text(json.dumps(
            {"virtualization": {"systemd_detect_virt": answer, "dmi": None}}))
        proc = subprocess.run([str(STANDINS / "systemd-detect-virt")], check=False, capture_output=True,
                              text=True, env={**os.environ,
                                              "GPUHOST_SANDBOX_HARDWARE": str(tmp_path / "hw.json")})
        assert (proc.stdout.strip(), proc.returncode) == (answer, status)
