"""The sandbox hosts' PCI stand-ins: lspci listing the scenario's GPUs, and nouveau binding them
at boot unless blacklisted (sandbox/standins/pci/).

`install(root, hardware_json)` puts them into a host tree at `up`:

    /usr/local/sbin/lspci                      shadows pciutils' /usr/bin/lspci on root's PATH
    /usr/local/lib/gpuhost-sandbox/load-nouveau and its boot unit (sysinit.target)
    /etc/gpuhost-sandbox/pci-devices           one GPU a line: address, device text, subsystem
"""

from __future__ import annotations

import json
from pathlib import Path

STANDINS = Path(__file__).with_name("standins") / "pci"
UNIT = "gpuhost-sandbox-nouveau.service"

#: PCI device ids and lspci's names (pci.ids) of the GPUs the scenarios have; others are shown
#: as lspci shows a device pci.ids does not know ("Device 10de:xxxx").
DEVICES = {
    "NVIDIA H200": ("2335", "GH100 [H200 SXM 141GB]", "18be", "a1"),
    "NVIDIA RTX PRO 6000 Blackwell Server Edition": (
        "2bb5", "GB202GL [RTX PRO 6000 Blackwell Server Edition]", "204e", "a1"),
}


def device_lines(hardware: dict) -> str:
    """/etc/gpuhost-sandbox/pci-devices for a scenario's hardware document (tab-separated)."""
    lines = []
    for gpu in hardware.get("gpus", []):
        device, name, subsystem, rev = DEVICES.get(gpu["name"], ("2300", "Device 2300", "0000",
                                                                 "a1"))
        domain, rest = gpu["pci_bus_id"].split(":", 1)
        address = f"{domain[-4:]}:{rest}".lower()
        text = (f"3D controller [0302]: NVIDIA Corporation {name} [10de:{device}] (rev {rev})")
        lines.append(f"{address}\t{text}\tNVIDIA Corporation Device [10de:{subsystem}]\n")
    return "".join(lines)


def install(root: Path, hardware_json: str) -> None:
    """Put the PCI stand-ins into the host tree `root` for the given hardware document."""
    files = {
        "usr/local/sbin/lspci": ((STANDINS / "lspci").read_text(), 0o755),
        "usr/local/lib/gpuhost-sandbox/load-nouveau": (
            (STANDINS / "load-nouveau").read_text(), 0o755),
        f"etc/systemd/system/{UNIT}": ((STANDINS / UNIT).read_text(), 0o644),
        "etc/gpuhost-sandbox/pci-devices": (device_lines(json.loads(hardware_json)), 0o644),
    }
    for path, (text, mode) in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode)
    wants = root / "etc/systemd/system/sysinit.target.wants" / UNIT
    wants.parent.mkdir(parents=True, exist_ok=True)
    if wants.is_symlink() or wants.exists():
        wants.unlink()
    wants.symlink_to(f"/etc/systemd/system/{UNIT}")
