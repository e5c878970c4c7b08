"""The sandbox's PCI stand-ins: lspci prints the scenario's GPUs in `lspci -Dnnk`'s format with
the driver the boot-time stand-ins bound (nouveau unless blacklisted, then nvidia)."""

import json
import subprocess

from operations.facts.driver_facts import PciGpu, parse_lspci
from sandbox import pci, scenarios


def run_lspci(tmp_path, driver: str | None, module_built: bool) -> list[str]:
    hardware = json.loads(scenarios.hardware_json("single-gpu"))
    devices = tmp_path / "pci-devices"
    devices.write_text(pci.device_lines(hardware))
    state = tmp_path / "pci-driver"
    if driver:
        state.write_text(driver + "\n")
    modules = tmp_path / "modules"
    if module_built:
        (modules / subprocess.run(["uname", "-r"], capture_output=True, text=True,
                                  check=True).stdout.strip()).mkdir(parents=True)
    script = (pci.STANDINS / "lspci").read_text()
    script = (script.replace("/etc/gpuhost-sandbox/pci-devices", str(devices))
              .replace("/run/gpuhost-sandbox/pci-driver", str(state))
              .replace("/var/lib/nvidia-sandbox/modules", str(modules)))
    path = tmp_path / "lspci"
    path.write_text(script)
    out = subprocess.run(["sh", str(path), "-Dnnk", "-d", "10de:"], capture_output=True,
                         text=True, check=True)
    return out.stdout.splitlines()


def test_nouveau_bound_before_the_driver(tmp_path):
    lines = run_lspci(tmp_path, "nouveau", module_built=False)
    assert lines == [
        ("0000:00:06.0 3D controller [0302]: NVIDIA Corporation GH100 [H200 SXM 141GB] "
        "[10de:2335] (rev a1)"),
        "\tSubsystem: NVIDIA Corporation Device [10de:18be]",
        "\tKernel driver in use: nouveau",
        "\tKernel modules: nvidiafb, nouveau",
    ]
    assert parse_lspci([*lines, "rc=0"]) == (PciGpu("0000:00:06.0", "nouveau"),)


def test_nvidia_bound_after_the_install(tmp_path):
    lines = run_lspci(tmp_path, "nvidia", module_built=True)
    assert lines[2:] == ["\tKernel driver in use: nvidia",
                         "\tKernel modules: nvidiafb, nouveau, nvidia_drm, nvidia"]


def test_unbound(tmp_path):
    lines = run_lspci(tmp_path, None, module_built=False)
    assert parse_lspci([*lines, "rc=0"]) == (PciGpu("0000:00:06.0", None),)


def test_install_enables_the_nouveau_stand_in(tmp_path):
    pci.install(tmp_path, scenarios.hardware_json("nouveau-bound"))
    wants = tmp_path / "etc/systemd/system/sysinit.target.wants" / pci.UNIT
    assert wants.is_symlink()
    assert (tmp_path / "usr/local/sbin/lspci").stat().st_mode & 0o111
    assert '"nouveau": true' in scenarios.hardware_json("nouveau-bound")
    assert (tmp_path / "etc/gpuhost-sandbox/pci-devices").read_text().startswith("0000:00:06.0\t")


def test_a_cpu_only_host_lists_no_nvidia_device(tmp_path):
    """scenario cpu-only: no GPU, so the lspci stand-in prints nothing for -d 10de: (as a
    CPU-only VM's lspci lists no NVIDIA device) and the product's parser finds none."""
    hardware = json.loads(scenarios.hardware_json("cpu-only"))
    assert hardware["gpus"] == [] and pci.device_lines(hardware) == ""
    devices = tmp_path / "pci-devices"
    devices.write_text(pci.device_lines(hardware))
    script = (pci.STANDINS / "lspci").read_text().replace("/etc/gpuhost-sandbox/pci-devices",
                                                          str(devices))
    (tmp_path / "lspci").write_text(script)
    out = subprocess.run(["sh", str(tmp_path / "lspci"), "-Dnnk", "-d", "10de:"],
                         capture_output=True, text=True, check=True).stdout
    assert out == "" and parse_lspci(["rc=0"]) == ()
