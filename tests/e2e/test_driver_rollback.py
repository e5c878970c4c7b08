"""Driver upgrades that cannot leave a host without a driver, end to end on one sandbox host:
--dry names the exact versions apt would install and the rollback; an upgrade to a driver whose
module does not load (the stand-in 590.44.01) is rolled back to the kept packages, verified and
serving, the run failing with what failed; an interrupted rollback is finished by the next run;
a good upgrade then goes through. Checks are made with ssh, never through pyinfra."""

import json

import pytest

from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

X, Y, BROKEN = "580.95.05", "580.105.08", "590.44.01"
LAST_GOOD = "/var/lib/gpuhost/driver-last-good.json"
CHANGE = "/var/lib/gpuhost/driver-change.json"
TO_BROKEN = ("--data", "gpuhost_driver_branch=590", "--data", "gpuhost_allow_driver_change=true")
#: What a dry run must not change: packages, configuration, gpuhost's records.
CHECKSUM = ("{ sha256sum /var/lib/dpkg/status; find /etc /var/lib/gpuhost -xdev -type f -print0 "
            "| sort -z | xargs -0 sha256sum; } | sha256sum")


def boot_id(host: lab.Host) -> str:
    return host.ssh("cat /proc/sys/kernel/random/boot_id").strip()


def loaded_driver(host: lab.Host) -> str:
    return host.ssh("nvidia-smi --query-gpu=driver_version --format=csv,noheader").strip()


def installed(host: lab.Host, package: str = "nvidia-kernel-open-dkms") -> str:
    return host.ssh(f"dpkg-query -W -f='${{Version}}' {package}").strip()


def serves(host: lab.Host) -> bool:
    models = json.loads(host.http_get("http://127.0.0.1:8000/v1/models"))
    return bool(models["data"])


def last_good(host: lab.Host) -> dict:
    return json.loads(host.ssh(f"cat {LAST_GOOD}"))


@pytest.fixture(scope="module")
def host_on_x():
    (host,) = lab.up(hosts=1, scenario="single-gpu")
    first = lab.deploy("--data", f"gpuhost_driver_version={X}")
    assert first.returncode == 0, first.output[-6000:]
    yield host
    lab.sandbox("down", check=False)


def test_dry_names_exact_versions_and_the_rollback(host_on_x):
    host = host_on_x
    assert last_good(host)["version"] == X
    before, boot = host.ssh(CHECKSUM), boot_id(host)
    dry = lab.deploy("--dry", *TO_BROKEN)
    out = dry.output
    assert f"target newest 590.* ({BROKEN}-1 in apt's lists) (a driver change)" in out, \
        out[-6000:]
    assert f"nvidia-open {BROKEN}-1 (now {X}-1)" in out
    assert f"nvidia-kernel-open-dkms {BROKEN}-1 (now {X}-1)" in out
    assert f"libcuda1 {BROKEN}-1 (now {X}-1)" in out
    assert f"driver rollback available: if {BROKEN} fails its checks after the reboot" in out
    assert f"nvidia-kernel-open-dkms {X}-1" in out and "are reinstalled" in out
    assert host.ssh(CHECKSUM) == before and boot_id(host) == boot
    assert host.ssh("ls /var/lib/gpuhost/driver-kept 2>&1; true").strip().endswith(
        "No such file or directory")


def test_broken_driver_is_rolled_back_and_the_host_serves(host_on_x):
    host = host_on_x
    boot = boot_id(host)
    run = lab.deploy(*TO_BROKEN)
    assert run.returncode != 0, run.output[-6000:]
    assert (f"driver {BROKEN} failed its checks after the reboot (nvidia-smi fails: NVIDIA-SMI "
            "has failed because it couldn't communicate with the NVIDIA driver") in run.output
    assert f"rolled back to {X}: reinstalled, rebooted and verified" in run.output
    assert boot_id(host) != boot
    assert loaded_driver(host) == X and installed(host) == f"{X}-1"
    assert installed(host, "nvidia-open") == f"{X}-1"
    assert "Kernel driver in use: nvidia" in host.ssh("lspci -Dnnk -d 10de:")
    assert host.ssh("systemctl is-active sglang.service").strip() == "active"
    assert serves(host)
    record = last_good(host)
    assert record["version"] == X and record["packages"]["nvidia-open"] == f"{X}-1"
    assert record["failed"][-1]["version"] == BROKEN
    assert host.ssh(f"test -e {CHANGE} && echo left || echo gone").strip() == "gone"


def test_interrupted_rollback_is_finished_then_a_good_upgrade_goes_through(host_on_x):
    host = host_on_x
    # As a run cut off in its rollback leaves the host: the broken driver's packages installed
    # (the loaded module still the old one: no reboot yet), the change recorded as rolling back.
    lab.driver_by_hand(host, BROKEN)
    kept = host.ssh("cd /var/lib/gpuhost/driver-kept && for f in *.deb; do "
                    "echo \"$(dpkg-deb -f $f Package) $(dpkg-deb -f $f Version) $PWD/$f "
                    "$(sha256sum < $f | cut -d' ' -f1)\"; done").split("\n")
    restore = [dict(zip(("package", "version", "file", "sha256"), line.split()))
               for line in kept if line.strip()]
    assert {r["package"] for r in restore} >= {"nvidia-open", "nvidia-kernel-open-dkms"}
    change = {"phase": "rolling-back", "from": X, "to": BROKEN, "restore": restore,
              "remove": [], "failure": "nvidia-smi fails", "started_at": "2026-12-01T00:00:00Z"}
    host.ssh(f"cat > {CHANGE} <<'EOF'\n{json.dumps(change)}\nEOF")
    boot = boot_id(host)

    good = ("--data", f"gpuhost_driver_version={Y}", "--data", "gpuhost_allow_driver_change=true")
    finish = lab.deploy(*good)
    assert finish.returncode != 0, finish.output[-6000:]
    assert "an interrupted driver rollback is finished first" in finish.output
    assert (f"rolled back to {X}: reinstalled, rebooted and verified (1 GPU(s)); an earlier "
            "run had left the rollback unfinished") in finish.output
    assert boot_id(host) != boot and loaded_driver(host) == X
    assert installed(host) == f"{X}-1" and serves(host)

    upgrade = lab.deploy(*good)
    assert upgrade.returncode == 0, upgrade.output[-6000:]
    assert loaded_driver(host) == Y and installed(host) == f"{Y}-1"
    assert serves(host)
    assert last_good(host)["version"] == Y
    assert host.ssh(f"test -e {CHANGE} && echo left || echo gone").strip() == "gone"
    # The verified driver, recorded: the next run changes nothing.
    again = lab.deploy("--json", *good)
    assert again.returncode == 0, again.output[-6000:]
    changed = [op["name"] for op in again.results["results"]["operations"]
               if op["success"] or op["error"]]
    assert changed == []
