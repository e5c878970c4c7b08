"""The NVIDIA stage on a host that presents itself as Ubuntu 24.04 (scenario ubuntu-2404: a
Debian root with Ubuntu's os-release, NVIDIA's ubuntu2404 stand-in repository,
sandbox/ubuntu_driver.py): Ubuntu's package names with the branch up to 580, NVIDIA's pinning
package beside gpuhost's pin, and an upgrade 580 -> 590 across the rename that drops the branch
from the names. Checked with ssh and dpkg, never through pyinfra."""

import json

import pytest

from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OLD, NEW = "580.105.08-0ubuntu1", "590.44.01-1ubuntu1"


def installed(host: lab.Host) -> dict[str, str]:
    out = host.ssh("dpkg-query -W -f='${Package} ${Version} ${Status}\\n'")
    return {f[0]: f[1] for f in (line.split() for line in out.splitlines())
            if f and f[-1] == "installed"}


@pytest.fixture(scope="module")
def ubuntu_host():
    (host,) = lab.up(hosts=1, scenario="ubuntu-2404")
    yield host
    lab.sandbox("down", check=False)


def test_ubuntu_names_the_pinning_package_and_the_upgrade_across_the_rename(ubuntu_host):
    host = ubuntu_host
    assert "ID=ubuntu" in host.ssh("cat /etc/os-release")
    first = lab.deploy("--data", "gpuhost_driver_branch=580")
    assert first.returncode == 0, first.output[-6000:]
    assert "ubuntu2404/x86_64" in first.output
    pkgs = installed(host)
    for name in ("nvidia-dkms-580-open", "nvidia-utils-580", "libnvidia-compute-580",
                 "nvidia-open"):
        assert pkgs.get(name) == OLD, (name, pkgs.get(name))
    assert "nvidia-driver-pinning-580" in pkgs
    assert not any(n.startswith("nvidia-driver-pinning-") and n != "nvidia-driver-pinning-580"
                   for n in pkgs)
    assert host.ssh("nvidia-smi --query-gpu=driver_version --format=csv,noheader").strip() \
        == OLD.split("-")[0]
    assert json.loads(host.http_get("http://127.0.0.1:8000/v1/models"))["data"]
    again = lab.deploy("--data", "gpuhost_driver_branch=580")
    assert again.returncode == 0 and "No change" in again.output, again.output[-4000:]

    dry = lab.deploy("--dry", "--data", "gpuhost_driver_branch=590",
                     "--data", "gpuhost_allow_driver_change=true")
    said = "\n".join(line for line in dry.output.splitlines() if "NVIDIA" in line)
    assert dry.returncode == 0, dry.output[-6000:]
    assert f"target newest 590.* ({NEW} in apt's lists) (a driver change)" in said, said
    assert "nvidia-dkms-open 590.44.01-1ubuntu1 (new)" in said, said
    assert "nvidia-dkms-580-open removed" in said, said
    assert installed(host) == pkgs

    up = lab.deploy("--data", "gpuhost_driver_branch=590",
                    "--data", "gpuhost_allow_driver_change=true")
    assert up.returncode == 0, up.output[-6000:]
    pkgs = installed(host)
    for name in ("nvidia-dkms-open", "nvidia-utils", "libnvidia-compute", "nvidia-open"):
        assert pkgs.get(name) == NEW, (name, pkgs.get(name))
    # the old release's firmware, a dependency of the old module package only, stays as apt
    # leaves any orphan: marked automatically installed, for `apt autoremove`
    left = [n for n in pkgs if n.endswith("-580") or "-580-" in n]
    assert left == ["nvidia-firmware-580-580.105.08"], left
    assert "nvidia-firmware-580-580.105.08" in host.ssh("apt-mark showauto").split()
    assert "nvidia-driver-pinning-590" in pkgs and "nvidia-driver-pinning-580" not in pkgs
    assert host.ssh("nvidia-smi --query-gpu=driver_version --format=csv,noheader").strip() \
        == "590.44.01"
    assert json.loads(host.http_get("http://127.0.0.1:8000/v1/models"))["data"]
