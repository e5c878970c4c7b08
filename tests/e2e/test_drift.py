"""State that drifts while a run would say success, on one converged sandbox host (the suite
run's image where it keeps one: conftest.py ``converged_host``) taken through it in order: a
P2P re-measure and a driver change (one start of the server each), a hand-edited p2p.env,
drop-ins gpuhost does not own. Checked over ssh (dpkg-query, journalctl,
/proc/<MainPID>/environ, the files), never through pyinfra. A driver pin NVIDIA's repository
lacks, refused on a fresh host, is test_deploy.py's (its fresh host, before its first
deploy)."""

from __future__ import annotations

import pytest

from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DROPINS = "/etc/systemd/system/sglang.service.d"
P2P_ENV = "/etc/gpuhost/p2p.env"


@pytest.fixture(scope="module")
def host(converged_host):
    return converged_host


def changed(run: lab.Run) -> list[str]:
    assert run.results is not None, run.output[-3000:]
    return [op["name"] for op in run.results["results"]["operations"]
            if op["success"] or op["error"]]


def starts_since(host: lab.Host, since: str) -> tuple[int, int]:
    """How often systemd's journal says sglang.service started, and killed a start (SIGTERM
    of a control process: a restart during a start)."""
    lines = host.ssh(f"journalctl -u sglang.service --no-pager -o cat {since}").splitlines()
    return (sum(line.startswith("Starting sglang.service") for line in lines),
            sum("status=15/TERM" in line for line in lines))


def test_a_remeasure_starts_the_server_once(host):
    first = lab.deploy()
    assert first.returncode == 0, first.output[-6000:]
    since = "--since @" + host.ssh("date +%s").strip()
    host.ssh("sleep 1.1")
    again = lab.deploy("--data", "gpuhost_p2p_remeasure=true")
    assert again.returncode == 0, again.output[-6000:]
    assert starts_since(host, since) == (1, 0)


def test_a_driver_change_starts_the_server_once(host):
    pin = ("--data", "gpuhost_driver_version=580.95.05")
    run = lab.deploy(*pin, "--data", "gpuhost_allow_driver_change=true")
    assert run.returncode == 0, run.output[-6000:]
    assert host.ssh("dpkg-query -W -f='${Version}' nvidia-kernel-open-dkms") == "580.95.05-1"
    # -b: this boot, the reboot's start at boot included
    assert starts_since(host, "-b") == (1, 0)
    assert host.ssh("systemctl is-enabled sglang.service").strip() == "enabled"
    second = lab.deploy("--json", *pin)
    assert second.returncode == 0 and changed(second) == [], second.output[-6000:]


def test_a_hand_edited_p2p_env_is_rewritten_before_the_restart(host):
    good = host.ssh(f"cat {P2P_ENV}")
    assert "NCCL_P2P_LEVEL=PHB\n" in good
    host.ssh(f"sed -i 's/^NCCL_P2P_LEVEL=PHB$/NCCL_P2P_LEVEL=NVL/' {P2P_ENV}")
    run = lab.deploy()
    assert run.returncode == 0, run.output[-6000:]
    assert host.ssh(f"cat {P2P_ENV}") == good
    pid = host.main_pid()
    assert host.process_env(pid)["NCCL_P2P_LEVEL"] == "PHB"
    second = lab.deploy("--json")
    assert second.returncode == 0 and changed(second) == [], second.output[-6000:]
    assert host.main_pid() == pid


def test_foreign_drop_ins_are_reported_and_removed_unless_allowed(host):
    host.ssh(f"printf '[Service]\\nRestart=no\\n' > {DROPINS}/50-theirs.conf; "
             f"printf '[Service]\\nEnvironment=LOCAL_MARK=1\\n' > {DROPINS}/60-local.conf; "
             "systemctl daemon-reload")
    allow = ("--data", 'gpuhost_allowed_dropins=["60-local.conf"]')
    dry = lab.deploy("--dry", *allow)
    assert dry.returncode == 0, dry.output[-6000:]
    assert (f"drop-in {DROPINS}/50-theirs.conf is not gpuhost's and host data does not allow "
            "it: removing it") in dry.output
    assert f"drop-in {DROPINS}/60-local.conf is not gpuhost's: kept" in dry.output
    assert host.ssh(f"ls {DROPINS}").split() == [
        "10-gpuhost-driver-gate.conf", "50-theirs.conf", "60-local.conf"]  # dry changed nothing

    run = lab.deploy(*allow)
    assert run.returncode == 0, run.output[-6000:]
    assert host.ssh(f"ls {DROPINS}").split() == ["10-gpuhost-driver-gate.conf", "60-local.conf"]
    assert host.ssh("systemctl show -p Restart --value sglang.service").strip() == "on-failure"
    pid = host.main_pid()
    # the allowed drop-in counts in what the server runs with: it restarted with it
    assert host.process_env(pid).get("LOCAL_MARK") == "1"
    second = lab.deploy("--json", *allow)
    assert second.returncode == 0 and changed(second) == [], second.output[-6000:]
    assert host.main_pid() == pid
