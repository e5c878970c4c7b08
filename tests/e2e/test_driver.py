"""The NVIDIA stage end to end on sandbox hosts: a driver change shown by --dry without any
change, refused by an ordinary run, done with gpuhost_allow_driver_change (reboot included)
and serving again; a library/module mismatch rebooted away; nouveau holding the GPU; a driver
that no package installed; no kernel headers for the running kernel. Host states are prepared
over ssh as a person would leave them; every check is made with ssh, never through pyinfra."""

import json

import pytest

from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
#: every test boots a host of its own (the first through the module's fixture):
#: tests/lanes.py runs each as a unit, spread over the lanes
LANES_UNIT_PER_TEST = True

X, Y = "580.95.05", "580.105.08"

#: What must not change in a dry or refused run: installed packages, configuration, /usr/local.
CHECKSUM = (
    "{ sha256sum /var/lib/dpkg/status; "
    "find /etc /usr/local -xdev \\( -type f -o -type l \\) -printf '%p %m %l\\n' | sort; "
    "find /etc /usr/local -xdev -type f -print0 | sort -z | xargs -0 sha256sum; } | sha256sum"
)


def checksum(host: lab.Host) -> str:
    return host.ssh(CHECKSUM).strip()


def boot_id(host: lab.Host) -> str:
    return host.ssh("cat /proc/sys/kernel/random/boot_id").strip()


def loaded_driver(host: lab.Host) -> str:
    return host.ssh("nvidia-smi --query-gpu=driver_version --format=csv,noheader").strip()


def installed_driver(host: lab.Host) -> str:
    return host.ssh("dpkg-query -W -f='${Version}' nvidia-kernel-open-dkms").strip()


def serves(host: lab.Host) -> bool:
    models = json.loads(host.http_get("http://127.0.0.1:8000/v1/models"))
    return bool(models["data"])


@pytest.fixture(scope="module")
def one_gpu_host():
    (host,) = lab.up(hosts=1, scenario="single-gpu")
    yield host
    lab.sandbox("down", check=False)


def test_driver_change_dry_refused_then_allowed_and_mismatch_rebooted(one_gpu_host):
    host = one_gpu_host
    first = lab.deploy("--data", f"gpuhost_driver_version={X}")
    assert first.returncode == 0, first.output[-6000:]
    assert loaded_driver(host) == X and installed_driver(host) == f"{X}-1"
    assert serves(host)
    # A stray second entry for NVIDIA's repository, left by hand: reported, not touched.
    repo = host.ssh("cat /etc/apt/sources.list.d/cuda-debian12-x86_64.list").strip()
    host.ssh(f"echo '{repo}' > /etc/apt/sources.list.d/stray-cuda.list")
    pid, boot, before = host.main_pid(), boot_id(host), checksum(host)

    dry = lab.deploy("--dry", "--data", f"gpuhost_driver_version={Y}")
    assert f"driver installed {X}, target {Y} (a driver change)" in dry.output, dry.output[-6000:]
    assert "then a reboot" in dry.output and "server restart" in dry.output
    assert "gpuhost_allow_driver_change = True" in dry.output
    assert "also listed in /etc/apt/sources.list.d/stray-cuda.list" in dry.output
    assert checksum(host) == before
    assert boot_id(host) == boot and host.main_pid() == pid

    refused = lab.deploy("--data", f"gpuhost_driver_version={Y}")
    assert refused.returncode != 0, refused.output[-6000:]
    assert "nothing was changed" in refused.output
    assert f"driver {X} is installed, host data asks for {Y}-*" in refused.output
    assert checksum(host) == before
    assert boot_id(host) == boot and host.main_pid() == pid

    host.ssh("rm /etc/apt/sources.list.d/stray-cuda.list")
    allowed = lab.deploy("--data", f"gpuhost_driver_version={Y}",
                         "--data", "gpuhost_allow_driver_change=true")
    assert allowed.returncode == 0, allowed.output[-6000:]
    assert boot_id(host) != boot
    assert loaded_driver(host) == Y and installed_driver(host) == f"{Y}-1"
    assert "Kernel driver in use: nvidia" in host.ssh("lspci -Dnnk -d 10de:")
    assert host.ssh("systemctl is-active sglang.service").strip() == "active"
    assert serves(host)
    held = host.ssh("apt-mark showhold").split()
    assert {"nvidia-open", "nvidia-kernel-open-dkms", "cuda-toolkit-12-8"} <= set(held)

    # Back to X by hand, without a reboot: the libraries are X, the loaded module still Y.
    lab.driver_by_hand(host, X)
    mismatch = host.ssh("nvidia-smi; echo rc=$?", check=False)
    assert "Driver/library version mismatch" in mismatch and "rc=18" in mismatch
    # The server does not start on a mismatched driver (the nvidia stage's drop-in).
    restart = host.ssh("systemctl restart sglang.service; echo rc=$?", check=False)
    assert "rc=0" not in restart
    assert host.ssh("systemctl is-active sglang.service", check=False).strip() != "active"
    # Holds and the unattended-upgrades exclusion lost by hand are repaired by the next run.
    host.ssh("apt-mark unhold cuda-toolkit-12-8 >/dev/null && "
             "rm /etc/apt/apt.conf.d/51gpuhost-unattended-upgrades")
    boot = boot_id(host)
    rebooted = lab.deploy("--data", f"gpuhost_driver_version={X}")
    assert rebooted.returncode == 0, rebooted.output[-6000:]
    assert "driver/library version mismatch" in rebooted.output
    assert boot_id(host) != boot
    assert loaded_driver(host) == X
    assert serves(host)
    assert "cuda-toolkit-12-8" in host.ssh("apt-mark showhold").split()
    assert '"cuda-";' in host.ssh("cat /etc/apt/apt.conf.d/51gpuhost-unattended-upgrades")

    again = lab.deploy("--json", "--data", f"gpuhost_driver_version={X}")
    assert again.returncode == 0, again.output[-6000:]
    nvidia = [op["name"] for op in again.results["results"]["operations"]
              if op["name"].startswith("NVIDIA") and (op["success"] or op["error"])]
    assert nvidia == []


def test_driver_outside_apt_is_refused_left_alone_or_replaced_on_request():
    host = lab.up(hosts=1, scenario="single-gpu")[0]
    # A runfile-style install: nvidia-smi in /usr/bin that no package owns.
    host.ssh("printf '#!/bin/sh\\necho \"NVIDIA-SMI has failed because it couldn'\"'\"'t "
             "communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is "
             "installed and running.\"\\nexit 9\\n' > /usr/bin/nvidia-smi && "
             "chmod 755 /usr/bin/nvidia-smi")
    smi = host.ssh("sha256sum /usr/bin/nvidia-smi")
    before, boot = checksum(host), boot_id(host)
    run = lab.deploy()
    assert run.returncode != 0, run.output[-6000:]
    assert "a driver no package installed is present (nvidia-smi at /usr/bin/nvidia-smi" \
        in run.output
    assert "gpuhost_unpackaged_driver" in run.output
    assert checksum(host) == before and boot_id(host) == boot
    assert host.ssh("sha256sum /usr/bin/nvidia-smi") == smi

    # Host data says to replace it: NVIDIA's packages take its place, and the host serves.
    replaced = lab.deploy("--data", "gpuhost_unpackaged_driver=replace")
    assert replaced.returncode == 0, replaced.output[-6000:]
    assert host.ssh("dpkg-query -S /usr/bin/nvidia-smi").startswith("nvidia-smi: ")
    assert boot_id(host) != boot and loaded_driver(host).startswith("580.")
    assert serves(host)


def test_no_headers_for_the_running_kernel_stops_before_the_driver():
    host = lab.up(hosts=1, scenario="single-gpu")[0]
    # The archive no longer has the running kernel's headers (as after a kernel upgrade).
    host.ssh("printf 'Package: linux-headers-%s\\nPin: version *\\nPin-Priority: -1\\n' "
             "\"$(uname -r)\" > /etc/apt/preferences.d/sandbox-no-headers")
    boot = boot_id(host)
    run = lab.deploy()
    assert run.returncode != 0, run.output[-6000:]
    assert "no kernel headers for the running kernel" in run.output
    assert host.ssh("dpkg-query -W nvidia-open nvidia-kernel-open-dkms 2>&1; true").count(
        "no packages found") == 2
    assert boot_id(host) == boot


def test_nouveau_bound_gpu_is_rebound_to_nvidia():
    (host,) = lab.up(hosts=1, scenario="nouveau-bound")
    try:
        assert "Kernel driver in use: nouveau" in host.ssh("lspci -Dnnk -d 10de:")
        boot = boot_id(host)
        run = lab.deploy()
        assert run.returncode == 0, run.output[-6000:]
        assert "nouveau holds 0000:00:06.0" in run.output
        assert boot_id(host) != boot
        pci = host.ssh("lspci -Dnnk -d 10de:")
        assert "Kernel driver in use: nvidia" in pci
        assert "Kernel driver in use: nouveau" not in pci
        assert host.ssh("cat /etc/modprobe.d/gpuhost-blacklist-nouveau.conf").startswith("#")
        assert loaded_driver(host).startswith("580.")
        assert serves(host)
    finally:
        lab.sandbox("down", check=False)
