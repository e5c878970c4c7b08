"""The fleet seen while it serves, end to end: two serving hosts (gpu1, gpu2) behind the API key
gate and a CPU-only router host (gpu3) running the real router and Debian's Prometheus, which
scrapes both servers, the router and both GPU hosts' node exporters (Debian's, with the GPU
readings of the nvidia-smi stand-in under DCGM exporter's names).

Checks go through ssh to Prometheus' own HTTP API on gpu3's loopback (python3's urllib: the
router host has no curl), systemctl, and requests over the lab switch; not through pyinfra.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import pytest

from tests.e2e import lab
from tests.e2e.test_server import changed

pytestmark = [
    pytest.mark.e2e, pytest.mark.slow,
    # Known open (issue #32, found when the fleet's planes were merged): Prometheus scrapes each
    # server's /metrics through its API key gate, which admitted the router hosts' addresses;
    # the gates now admit the router by the fleet key only, so those scrapes get 401 until
    # Prometheus sends the fleet key (a credentials file its own user can read).
    pytest.mark.xfail(reason="Prometheus does not send the fleet key to the workers' gates yet",
                      strict=False),
]

KEY_FILE = "/root/sglang-api.key"
SERVING = ("gpu1", "gpu2")
ROUTER_HOST = "gpu3"
PROMETHEUS = "http://127.0.0.1:9090"
ROUTER_KEY_FILE = "/root/router-api.key"
FLEET_KEY_FILE = "/root/fleet.key"
GET = ("import sys, urllib.request as u\ntry:\n    r = u.urlopen(sys.argv[1], timeout=10)\n"
       "    print(r.status); print(r.read().decode())\nexcept u.HTTPError as e:\n"
       "    print(e.code)\nexcept OSError as e:\n    print('refused', e)\n")


def write_inventory(path: Path) -> str:
    listed = json.loads(lab.sandbox("status", "--json").stdout)
    entries = []
    for h in listed:
        data = {**lab.inventory_data(h), "gpuhost_fleet_address": h["switch_address"],
                "gpuhost_gpu_metrics_interval": 5, "gpuhost_fleet_key_file": FLEET_KEY_FILE}
        if h["name"] != ROUTER_HOST:
            data.update(gpuhost_server_host=h["switch_address"], gpuhost_api_key_file=KEY_FILE)
        else:
            data.update(gpuhost_router_health_check_interval_secs=2,
                        gpuhost_router_api_key_file=ROUTER_KEY_FILE)
        entries.append((h["name"], data))
    literal = json.dumps(json.dumps(entries))
    path.write_text(f"import json\nsandbox = [tuple(e) for e in json.loads({literal})]\n"
                    f"gpuhost_router = [{ROUTER_HOST!r}]\n")
    return str(path)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    hosts = lab.up_from_image(hosts=3, host_scenarios={ROUTER_HOST: "cpu-only"})
    key = lab.GUARD.register("sk-" + secrets.token_hex(24), "API key")
    fleet_key = lab.GUARD.register("sk-" + secrets.token_hex(24), "fleet key")
    router_key = lab.GUARD.register("sk-" + secrets.token_hex(24), "router key")
    for h in hosts[:2]:
        h.ssh(f"umask 077; printf '%s\\n' {key} > {KEY_FILE}")
    for h in hosts:  # the fleet's planes (docs/security.md): the same fleet key everywhere
        h.ssh(f"umask 077; printf '%s\\n' {fleet_key} > {FLEET_KEY_FILE}")
    hosts[2].ssh(f"umask 077; printf '%s\\n' {router_key} > {ROUTER_KEY_FILE}")
    switch = {h["name"]: h["switch_address"]
              for h in json.loads(lab.sandbox("status", "--json").stdout)}
    inventory = write_inventory(tmp_path_factory.mktemp("obs") / "inventory.py")
    started = time.monotonic()
    first = lab.deploy(inventory=inventory)
    print(f"first deploy: {time.monotonic() - started:.0f} s")
    assert first.returncode == 0, first.output[-8000:]
    yield {"hosts": {h.name: h for h in hosts}, "switch": switch, "inventory": inventory}
    lab.sandbox("down", check=False)


def get(host: lab.Host, url: str) -> tuple[str, str]:
    out = host.ssh(f"python3 - '{url}' <<'EOF'\n{GET}EOF", check=False)
    status, _, body = out.partition("\n")
    return status.strip(), body


def api(fleet, path: str) -> dict:
    status, body = get(fleet["hosts"][ROUTER_HOST], PROMETHEUS + path)
    assert status == "200", (status, body)
    return json.loads(body)["data"]


def targets(fleet) -> dict[tuple[str, str], str]:
    return {(t["labels"]["job"], t["labels"]["host"]): t["health"]
            for t in api(fleet, "/api/v1/targets")["activeTargets"]}


def wait_for(what, check, timeout: float, pause: float = 5.0):
    end = time.monotonic() + timeout
    while True:
        seen = check()
        if seen:
            return seen
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(pause)


def firing(fleet, alert: str) -> list[dict]:
    return [a for a in api(fleet, "/api/v1/alerts")["alerts"]
            if a["labels"]["alertname"] == alert and a["state"] == "firing"]


def test_prometheus_lists_every_target_up(fleet):
    expected = {("prometheus", ROUTER_HOST), ("smg", ROUTER_HOST),
                *(("sglang", n) for n in SERVING), *(("node", n) for n in SERVING)}
    started = time.monotonic()
    seen = wait_for("every target up", lambda: (lambda t: t if set(t) == expected and all(
        h == "up" for h in t.values()) else None)(targets(fleet)), timeout=120)
    print(f"targets up {time.monotonic() - started:.0f} s after the deploy: {sorted(seen)}")
    rules = api(fleet, "/api/v1/rules")["groups"]
    assert {g["name"] for g in rules} == {"gpuhost", "gpuhost-thresholds"}


def test_gpu_metrics_under_dcgm_names_and_server_metrics(fleet):
    def query(q):
        from urllib.parse import quote
        return api(fleet, "/api/v1/query?query=" + quote(q))["result"]

    power = wait_for("GPU power readings", lambda: query("DCGM_FI_DEV_POWER_USAGE"), 60)
    # the reference lab: 8 GPUs on each serving host
    assert sorted({r["metric"]["host"] for r in power}) == list(SERVING) and len(power) == 16
    limit = query("DCGM_FI_DEV_POWER_MGMT_LIMIT")
    assert {float(r["value"][1]) for r in limit} == {600.0}
    assert len(query("DCGM_FI_DEV_CLOCKS_EVENT_REASONS")) == 16
    running = query("sglang:num_running_reqs")
    assert sorted(r["metric"]["host"] for r in running) == list(SERVING)
    units = query('node_systemd_unit_state{name="sglang.service",state="active"} == 1')
    assert sorted(r["metric"]["host"] for r in units) == list(SERVING)
    health = query("smg_worker_health == 1")
    assert len(health) == 2


def test_no_metrics_endpoint_answers_a_stranger(fleet):
    """From gpu2 (a worker, not a router host): gpu1's server /metrics through its gate without
    the key is refused; Prometheus and its UI are not on gpu3's fleet address; the router's
    metrics neither."""
    gpu2, sw = fleet["hosts"]["gpu2"], fleet["switch"]
    assert get(gpu2, f"http://{sw['gpu1']}:8000/metrics")[0] == "401"
    assert get(gpu2, f"http://{sw[ROUTER_HOST]}:9090/api/v1/targets")[0].startswith("refused")
    assert get(gpu2, f"http://{sw[ROUTER_HOST]}:29000/metrics")[0].startswith("refused")
    listening = fleet["hosts"][ROUTER_HOST].ssh("ss -Hltn")
    assert "127.0.0.1:9090" in listening and "0.0.0.0:9090" not in listening \
        and "*:9090" not in listening
    node = fleet["hosts"]["gpu1"].ssh("ss -Hltn")
    assert f"{sw['gpu1']}:9100" in node and "*:9100" not in node


def test_the_second_deploy_changes_nothing(fleet):
    second = lab.deploy("--json", inventory=fleet["inventory"])
    assert second.returncode == 0, second.output[-6000:]
    assert changed(second) == []


def test_a_stopped_server_fires_its_alert_and_a_restart_clears_it(fleet):
    gpu1 = fleet["hosts"]["gpu1"]
    gpu1.ssh("systemctl stop sglang.service")
    started = time.monotonic()
    try:
        alerts = wait_for("SGLangServerDown firing", lambda: firing(fleet, "SGLangServerDown"),
                          timeout=180)
        print(f"SGLangServerDown firing {time.monotonic() - started:.0f} s after the stop")
        assert [a["labels"]["host"] for a in alerts] == ["gpu1"]
    finally:
        gpu1.ssh("systemctl start sglang.service")
    started = time.monotonic()
    wait_for("SGLangServerDown cleared", lambda: not firing(fleet, "SGLangServerDown"),
             timeout=180)
    print(f"cleared {time.monotonic() - started:.0f} s after the start")
