"""--dry touches nothing: on a bare host, and on a converged host with a pending change in every
stage, a checksum of dpkg's status, /etc, /opt (the venv), /usr/local, gpuhost's records and the
server's MainPID is the same before and after."""

import subprocess

import pytest

from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STATE = (
    "{ sha256sum /var/lib/dpkg/status; "
    "find /etc /opt /usr/local /var/lib/gpuhost -xdev \\( -type f -o -type l -o -type d \\) "
    "-printf '%p %m %l\\n' 2>/dev/null | sort; "
    "find /etc /opt /usr/local /var/lib/gpuhost -xdev -type f -print0 2>/dev/null | sort -z "
    "| xargs -0 -r sha256sum; systemctl show -p MainPID --value sglang.service; } | sha256sum"
)

#: A pending change for every stage: the driver, the venv (by hand, below), P2P, the server.
PENDING = ["--data", "gpuhost_driver_version=580.95.05",
           "--data", "gpuhost_allow_driver_change=true",
           "--data", "gpuhost_p2p_remeasure=true",
           "--data", "gpuhost_max_running_requests=32"]


def state(host: lab.Host) -> str:
    return host.ssh(STATE).strip()


def dry_run(*extra: str) -> lab.Run:
    """``pyinfra INVENTORY deploy.py --dry`` as a person types it: without -y, so that pyinfra
    runs the operations' change detection and prints what they find."""
    result = subprocess.run([str(lab.PYINFRA), "inventory/sandbox.py", "deploy.py", "--dry",
                             *extra], cwd=lab.ROOT, text=True, capture_output=True, check=False)
    lab.GUARD.observe(f"pyinfra --dry {' '.join(extra)}", result.stdout + result.stderr)
    return lab.Run(result.returncode, result.stdout + result.stderr, None)


@pytest.fixture(scope="module")
def host():
    (h,) = lab.up(hosts=1, scenario="single-gpu")
    yield h
    lab.sandbox("down", check=False)


def test_dry_run_on_a_bare_host_changes_nothing(host):
    before = state(host)
    dry = dry_run()
    assert dry.returncode == 0, dry.output[-4000:]
    assert state(host) == before


def test_dry_run_with_a_pending_change_in_every_stage_changes_nothing(host):
    converged = lab.deploy()
    assert converged.returncode == 0, converged.output[-6000:]
    host.ssh("/opt/gpuhost/venv/bin/python -m pip uninstall -q -y packaging")
    before = state(host)
    dry = dry_run(*PENDING)
    assert dry.returncode == 0, dry.output[-4000:]
    assert "packaging missing" in dry.output  # the venv's drift is shown
    assert "580.95.05" in dry.output  # the driver's target version is shown
    assert state(host) == before
