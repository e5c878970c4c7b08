"""A newer kernel installed but not booted yet (a linux-image upgrade, as unattended-upgrades
leaves it), end to end on a sandbox host (sandbox/kernels.py): on a fresh host the plan names
it, the deploy installs its headers and builds the driver's module for it too, and after the
deploy's reboot the booted kernel is the newer one and has the module (the driver loaded); then
on the converged host the next kernel upgrade gets its headers and module without a reboot,
and the operator's own reboot comes up with the driver. Checks over ssh, never through pyinfra."""

import json
import time

import pytest

from sandbox import kernels
from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def module(host: lab.Host, release: str) -> bool:
    return host.ssh(f"ls /lib/modules/{release}/updates/dkms/nvidia.ko 2>/dev/null; true") \
        .strip() != ""


def install_kernel_image(host: lab.Host, release: str) -> None:
    """``dpkg -i`` of the repository's linux-image stand-in, as unattended-upgrades installs a
    kernel upgrade (its hooks run, nothing is booted)."""
    (listed,) = json.loads(lab.sandbox("status", "--json").stdout)
    url = (f"{listed['cuda_repo_url']}/debian12/x86_64/linux-image-{release}_"
           f"{kernels.package_version(release)}_amd64.deb")
    host.ssh(f"python3 -c \"import urllib.request; open('/tmp/k.deb', 'wb').write("
             f"urllib.request.urlopen('{url}').read())\" && dpkg -i /tmp/k.deb >/dev/null "
             "&& rm /tmp/k.deb")


def boot_id(host: lab.Host) -> str:
    return host.ssh("cat /proc/sys/kernel/random/boot_id").strip()


def loaded_driver(host: lab.Host) -> str:
    return host.ssh("nvidia-smi --query-gpu=driver_version --format=csv,noheader").strip()


def reboot(host: lab.Host) -> None:
    """The operator's reboot, as a VM reboots (tests/e2e/test_router.py's)."""
    boot = boot_id(host)
    host.ssh("systemd-run --on-active=1 systemctl reboot")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        time.sleep(3)
        now = host.ssh("cat /proc/sys/kernel/random/boot_id", check=False).strip()
        if now and now != boot and host.ssh("systemctl is-system-running --wait",
                                            check=False).strip() in ("running", "degraded"):
            return
    raise AssertionError(f"{host.name} did not come back from its reboot")


@pytest.fixture(scope="module")
def fresh_host():
    (host,) = lab.up(hosts=1, scenario="single-gpu")
    yield host
    lab.sandbox("down", check=False)


def test_a_pending_kernel_gets_the_module_before_the_deploys_reboot(fresh_host):
    host = fresh_host
    running = host.ssh("uname -r").strip()
    pending, later = kernels.newer_releases(running)
    install_kernel_image(host, pending)
    assert host.ssh("uname -r").strip() == running

    dry = lab.deploy("--dry")
    assert dry.returncode == 0, dry.output[-6000:]
    assert f"kernel {pending} boots next (installed, not running yet)" in dry.output
    assert f"a reboot into kernel {pending}" in dry.output

    boot = boot_id(host)
    run = lab.deploy()
    assert run.returncode == 0, run.output[-6000:]
    assert f"Kernel headers for {running} and {pending}" in run.output
    assert f"booted kernel {pending} has the NVIDIA module" in run.output
    assert boot_id(host) != boot
    assert host.ssh("uname -r").strip() == pending
    assert module(host, pending) and module(host, running)
    installed = host.ssh(f"dpkg-query -W -f='${{Status}}\\n' linux-headers-{running} "
                         f"linux-headers-{pending}").split("\n")
    assert installed[:2] == ["install ok installed"] * 2
    assert loaded_driver(host).startswith("580.")
    assert "Kernel driver in use: nvidia" in host.ssh("lspci -Dnnk -d 10de:")

    again = lab.deploy("--dry")
    assert again.returncode == 0, again.output[-6000:]
    assert "boots next" not in again.output  # the newest installed kernel is the running one

    # The next upgrade, on the converged host: headers and module, no reboot by the deploy.
    install_kernel_image(host, later)
    assert not module(host, later)
    boot = boot_id(host)
    upgrade = lab.deploy()
    assert upgrade.returncode == 0, upgrade.output[-6000:]
    assert f"kernel {later} boots next" in upgrade.output
    assert boot_id(host) == boot and host.ssh("uname -r").strip() == pending
    assert module(host, later)
    reboot(host)
    assert host.ssh("uname -r").strip() == later
    assert loaded_driver(host).startswith("580.")
