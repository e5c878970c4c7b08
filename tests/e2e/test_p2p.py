"""P2P end to end, one fresh sandbox host per scenario: the server's process ends with the NCCL
environment and flags its measured P2P gives; the decision is printed per host (run and --dry);
a second run re-measures nothing and changes nothing; gpuhost_p2p_remeasure measures again,
with the server stopped first (on the p2p-ok-wrong-data host, after its own checks); on the
single-GPU host, before its first deploy, --dry says P2P will be measured and a bad override is
refused. The reference lab's scenario is tests/e2e/test_deploy.py's fresh host (the same first
deploy, second run and --dry, on a boot of its own there). Checked over ssh
(/proc/<MainPID>/environ and cmdline, the record), never through pyinfra.

One host per scenario and no more: each boot and converge from bare costs a lane 3 to 5
minutes of the suite (tests/lanes.py SECONDS), so what a scenario's host can show after its own
checks is shown there rather than on a host of its own."""

from __future__ import annotations

import json

import pytest

from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
#: every test boots a host of its own: tests/lanes.py runs each as a unit, spread over the lanes
LANES_UNIT_PER_TEST = True

BASE = {"NCCL_IB_DISABLE": "1"}
NO_P2P = {**BASE, "NCCL_P2P_LEVEL": "PHB", "NCCL_ALLOC_P2P_NET_LL_BUFFERS": "1",
          "NCCL_MIN_NCHANNELS": "8"}
P2P_DISABLED = {**NO_P2P, "NCCL_P2P_DISABLE": "1"}
NCCL_KEYS = set(P2P_DISABLED)

#: scenario: (P2P decision, NCCL environment, --disable-custom-all-reduce, verified)
EXPECTED = {
    "bare-metal-p2p": ("on", BASE, False, True),
    "q35-cns": ("off", NO_P2P, True, True),
    "p2p-ok-wrong-data": ("off", P2P_DISABLED, True, False),
    "single-gpu": ("n/a", BASE, False, None),
}


@pytest.fixture(params=sorted(EXPECTED))
def scenario_host(request):
    """One fresh sandbox host of the scenario, removed afterwards."""
    (host,) = lab.up(hosts=1, scenario=request.param)
    yield request.param, host
    lab.sandbox("down", check=False)


def changed(run: lab.Run) -> list[str]:
    assert run.results is not None, run.output[-3000:]
    return [op["name"] for op in run.results["results"]["operations"]
            if op["success"] or op["error"]]


def test_measured_p2p_ends_in_the_servers_environment_and_flags(scenario_host):
    scenario, host = scenario_host
    p2p, env, disabled, verified = EXPECTED[scenario]
    if scenario == "single-gpu":
        fresh_host_dry_run_and_a_bad_override(host)

    first = lab.deploy()
    assert first.returncode == 0, first.output[-6000:]
    assert f"P2P: P2P {p2p}: " in first.output, first.output[-6000:]
    if scenario == "p2p-ok-wrong-data":
        assert "WRONG DATA on arrival" in first.output
        assert "x-nv-gpudirect-clique" in first.output  # the warning, printed
    if scenario == "single-gpu":
        assert "one GPU: no pairs, nothing to verify" in first.output

    pid = host.main_pid()
    proc_env = host.process_env(pid)
    assert {k: v for k, v in proc_env.items() if k in NCCL_KEYS} == env
    args = host.process_args(pid)
    assert ("--disable-custom-all-reduce" in args) == disabled, args
    record = json.loads(host.ssh("cat /var/lib/gpuhost/p2p.json"))
    assert record["decision"]["p2p"] == p2p
    assert record["verification"]["verified"] is verified
    measured_at = record["measured_at"]

    second = lab.deploy("--json")
    assert second.returncode == 0, second.output[-6000:]
    assert changed(second) == []
    assert host.main_pid() == pid
    assert json.loads(host.ssh("cat /var/lib/gpuhost/p2p.json"))["measured_at"] == measured_at

    dry = lab.deploy("--dry")
    assert dry.returncode == 0, dry.output[-6000:]
    assert f"P2P {p2p}: " in dry.output and "(measured " in dry.output

    if scenario == "p2p-ok-wrong-data":
        remeasure_on_request_stops_the_server_first(host)


def remeasure_on_request_stops_the_server_first(host: lab.Host) -> None:
    """On a converged host: gpuhost_p2p_remeasure measures again, the server stopped for it and
    started again with the new record's environment."""
    pid = host.main_pid()
    before = json.loads(host.ssh("cat /var/lib/gpuhost/p2p.json"))["measured_at"]
    host.ssh("sleep 1.1")  # measured_at has seconds
    again = lab.deploy("--data", "gpuhost_p2p_remeasure=true")
    assert again.returncode == 0, again.output[-6000:]
    assert "gpuhost_p2p_remeasure is set" in again.output
    after = json.loads(host.ssh("cat /var/lib/gpuhost/p2p.json"))
    assert after["measured_at"] != before and after["decision"]["p2p"] == "off"
    new_pid = host.main_pid()
    assert new_pid not in (0, pid)  # stopped for the measurement, started again
    assert host.process_env(new_pid)["NCCL_P2P_LEVEL"] == "PHB"


def fresh_host_dry_run_and_a_bad_override(host: lab.Host) -> None:
    """On a fresh host, before its first deploy: --dry says when P2P will be measured, and a
    bad override is refused with nothing written."""
    dry = lab.deploy("--dry")
    assert dry.returncode == 0, dry.output[-6000:]
    assert "P2P will be measured after the driver loads" in dry.output
    assert "P2P platform: kvm, no DMI" in dry.output  # the Firecracker-like scenario
    bad = lab.deploy("--dry", "--data", "gpuhost_p2p_override=maybe")
    assert bad.returncode != 0
    assert ("host gpu1: gpuhost_p2p_override = 'maybe' is not allowed: one of on, off, "
            "or None to leave it unset") in bad.output
    assert "Traceback" not in bad.output
    assert host.ssh("test -e /var/lib/gpuhost/p2p.json || echo absent").strip() == "absent"
