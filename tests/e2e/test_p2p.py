"""P2P end to end, one fresh sandbox host per scenario, the four booted together in one lab
and converged by one deploy: each server's process ends with the NCCL environment and flags
its measured P2P gives; the decision is printed per host (run and --dry); a second run
re-measures nothing and changes nothing; gpuhost_p2p_remeasure measures again, with the server
stopped first (on the p2p-ok-wrong-data host alone, ``--limit``); before the first deploy,
--dry says P2P will be measured and a bad override is refused. The reference lab's scenario is
tests/e2e/test_deploy.py's fresh host (the same first deploy, second run and --dry, on a boot
of its own there). Checked over ssh (/proc/<MainPID>/environ and cmdline, the record), never
through pyinfra.

One boot of four hosts and one converge of them: a boot and converge from bare per scenario
cost a lane 2 to 2.5 minutes each (tests/lanes.py SECONDS: four units of 128 to 142 s in the
2550 s CI run of 8cfba4e), most of it the controller's and the boot's, which four hosts share."""

from __future__ import annotations

import json

import pytest

from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

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
#: host name: its scenario (gpu1 the lab's own, the others their hosts' own)
SCENARIOS = {f"gpu{i}": s for i, s in enumerate(EXPECTED, start=1)}


@pytest.fixture(scope="module")
def hosts():
    """The four fresh hosts, by scenario, removed afterwards."""
    first, *others = SCENARIOS.values()
    booted = lab.up(hosts=len(SCENARIOS), scenario=first,
                    host_scenarios={n: s for n, s in SCENARIOS.items() if s != first})
    yield {SCENARIOS[h.name]: h for h in booted}
    lab.sandbox("down", check=False)


def changed(run: lab.Run) -> list[str]:
    assert run.results is not None, run.output[-3000:]
    return [op["name"] for op in run.results["results"]["operations"]
            if op["success"] or op["error"]]


def test_measured_p2p_ends_in_the_servers_environment_and_flags(hosts):
    fresh_hosts_dry_run_and_a_bad_override(hosts)

    first = lab.deploy()
    assert first.returncode == 0, first.output[-6000:]
    pids, measured_at = {}, {}
    for scenario, (p2p, env, disabled, verified) in EXPECTED.items():
        host = hosts[scenario]
        assert f"[{host.name}] P2P: P2P {p2p}: " in first.output, (scenario, first.output[-6000:])
        pid = pids[scenario] = host.main_pid()
        proc_env = host.process_env(pid)
        assert {k: v for k, v in proc_env.items() if k in NCCL_KEYS} == env, scenario
        args = host.process_args(pid)
        assert ("--disable-custom-all-reduce" in args) == disabled, (scenario, args)
        record = json.loads(host.ssh("cat /var/lib/gpuhost/p2p.json"))
        assert record["decision"]["p2p"] == p2p, scenario
        assert record["verification"]["verified"] is verified, scenario
        measured_at[scenario] = record["measured_at"]
    wrong = hosts["p2p-ok-wrong-data"].name
    assert f"[{wrong}] P2P: 2 GPU pairs: 2 WRONG DATA on arrival" in first.output
    assert "x-nv-gpudirect-clique" in first.output  # the warning, printed
    single = hosts["single-gpu"].name
    assert f"[{single}] P2P: one GPU: no pairs, nothing to verify" in first.output

    second = lab.deploy("--json")
    assert second.returncode == 0, second.output[-6000:]
    assert changed(second) == []
    for scenario, host in hosts.items():
        assert host.main_pid() == pids[scenario], scenario
        assert json.loads(host.ssh("cat /var/lib/gpuhost/p2p.json"))["measured_at"] == \
            measured_at[scenario], scenario

    dry = lab.deploy("--dry")
    assert dry.returncode == 0, dry.output[-6000:]
    for scenario, (p2p, *_) in EXPECTED.items():
        assert f"[{hosts[scenario].name}] P2P {p2p}: " in dry.output, scenario
    assert dry.output.count("(measured ") >= len(hosts)

    remeasure_on_request_stops_the_server_first(hosts["p2p-ok-wrong-data"], hosts)


def remeasure_on_request_stops_the_server_first(host: lab.Host, hosts) -> None:
    """On a converged host: gpuhost_p2p_remeasure measures again, the server stopped for it and
    started again with the new record's environment; the hosts left out of the run untouched."""
    pid = host.main_pid()
    others = {h.name: h.main_pid() for h in hosts.values() if h is not host}
    before = json.loads(host.ssh("cat /var/lib/gpuhost/p2p.json"))["measured_at"]
    host.ssh("sleep 1.1")  # measured_at has seconds
    again = lab.deploy("--limit", host.name, "--data", "gpuhost_p2p_remeasure=true")
    assert again.returncode == 0, again.output[-6000:]
    assert f"[{host.name}] " in again.output and "gpuhost_p2p_remeasure is set" in again.output
    after = json.loads(host.ssh("cat /var/lib/gpuhost/p2p.json"))
    assert after["measured_at"] != before and after["decision"]["p2p"] == "off"
    new_pid = host.main_pid()
    assert new_pid not in (0, pid)  # stopped for the measurement, started again
    assert host.process_env(new_pid)["NCCL_P2P_LEVEL"] == "PHB"
    assert {h.name: h.main_pid() for h in hosts.values() if h is not host} == others


def fresh_hosts_dry_run_and_a_bad_override(hosts) -> None:
    """On fresh hosts, before their first deploy: --dry says when P2P will be measured, and a
    bad override is refused with nothing written."""
    dry = lab.deploy("--dry")
    assert dry.returncode == 0, dry.output[-6000:]
    for host in hosts.values():
        assert f"[{host.name}] P2P will be measured after the driver loads" in dry.output
    # the single-GPU scenario's host is Firecracker-like
    assert f"[{hosts['single-gpu'].name}] P2P platform: kvm, no DMI" in dry.output
    bad = lab.deploy("--dry", "--data", "gpuhost_p2p_override=maybe")
    assert bad.returncode != 0
    assert ("gpuhost_p2p_override = 'maybe' is not allowed: one of on, off, "
            "or None to leave it unset") in bad.output
    assert "Traceback" not in bad.output
    for host in hosts.values():
        assert host.ssh("test -e /var/lib/gpuhost/p2p.json || echo absent").strip() == "absent"
