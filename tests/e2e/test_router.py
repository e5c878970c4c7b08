"""A fleet behind one endpoint, end to end: three serving hosts and the real router (smg from
PyPI, through the lab's index) on the first, over the lab switch.

Each server binds its switch address behind the API key gate; the router binds gpu1's switch
address behind its own gate. Checks go through ssh (systemctl, the router's /workers on its
loopback, the workers' gate journals) and a client on gpu3 over the switch (lab addresses
only), not through pyinfra.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e import lab
from tests.e2e.test_server import changed

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY_FILE = "/root/sglang-api.key"
ROUTER_KEY_FILE = "/root/router-api.key"
ROUTER = "sglang-router.service"
ROUTER_GATE = "sglang-router-gate.service"
ROUTER_PORT = 8100
ROUTER_OWN = "http://127.0.0.1:30100"  # behind the gate, on gpu1's loopback


@dataclass
class Fleet:
    hosts: list
    switch: dict
    inventory: str
    key: str = field(repr=False)
    router_key: str = field(repr=False)


def write_inventory(path: Path, key_file: str, router_key_file: str) -> str:
    listed = json.loads(lab.sandbox("status", "--json").stdout)
    entries = []
    for h in listed:
        data = {**lab.inventory_data(h), "gpuhost_server_host": h["switch_address"],
                "gpuhost_fleet_address": h["switch_address"], "gpuhost_api_key_file": key_file}
        if h["name"] == "gpu1":
            data.update(gpuhost_router_host=h["switch_address"],
                        gpuhost_router_api_key_file=router_key_file,
                        gpuhost_router_health_check_interval_secs=2)
        entries.append((h["name"], data))
    literal = json.dumps(json.dumps(entries))
    path.write_text(f"import json\nsandbox = [tuple(e) for e in json.loads({literal})]\n"
                    "gpuhost_router = ['gpu1']\n")
    return str(path)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    hosts = lab.up(hosts=3, scenario="reference-lab")
    key = lab.GUARD.register("sk-" + secrets.token_hex(24), "API key")
    router_key = lab.GUARD.register("sk-" + secrets.token_hex(24), "router API key")
    for h in hosts:
        h.ssh(f"umask 077; printf '%s\\n' {key} > {KEY_FILE}")
    hosts[0].ssh(f"umask 077; printf '%s\\n' {router_key} > {ROUTER_KEY_FILE}")
    switch = {h["name"]: h["switch_address"]
              for h in json.loads(lab.sandbox("status", "--json").stdout)}
    inventory = write_inventory(tmp_path_factory.mktemp("router") / "inventory.py",
                                KEY_FILE, ROUTER_KEY_FILE)
    first = lab.deploy(inventory=inventory)
    assert first.returncode == 0, first.output[-8000:]
    yield Fleet(hosts, switch, inventory, key, router_key)
    lab.sandbox("down", check=False)


def router_workers(fleet: Fleet) -> dict[str, bool]:
    body = json.loads(fleet.hosts[0].ssh(f"curl -s -m 10 {ROUTER_OWN}/workers"))
    return {w["url"]: w["is_healthy"] for w in body["workers"]}


CLIENT = r"""
import json, sys, time, urllib.request, urllib.error
url, key, count, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
ok = failed = 0; errors = []; end = time.monotonic() + limit
for i in range(count):
    if time.monotonic() > end:
        break
    body = json.dumps({"model": "glm-5", "messages": [{"role": "user", "content": f"q{i} {time.time()}"}],
                       "max_tokens": 4}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body,
                                 {"content-type": "application/json", "Authorization": "Bearer " + key})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            json.loads(r.read())["choices"][0]; ok += 1
    except Exception as exc:
        failed += 1; errors.append(type(exc).__name__ + ": " + str(getattr(exc, "code", exc)))
print(json.dumps({"ok": ok, "failed": failed, "errors": errors[:5]}))
"""


def client_loop(fleet: Fleet, count: int, seconds: float, key: str | None = None) -> dict:
    """Requests from gpu3 to the router over the switch (lab addresses only), bounded in count
    and time."""
    url = f"http://{fleet.switch['gpu1']}:{ROUTER_PORT}"
    fleet.hosts[2].ssh(f"cat > /tmp/client.py <<'EOF'\n{CLIENT}\nEOF")
    out = fleet.hosts[2].ssh(
        f"python3 /tmp/client.py {url} {key or fleet.router_key} {count} {seconds}", check=False)
    return json.loads(out.strip().splitlines()[-1])


def test_router_lists_every_serving_host_healthy(fleet):
    assert fleet.hosts[0].ssh(f"systemctl is-active {ROUTER} {ROUTER_GATE}").split() == [
        "active", "active"]
    want = {"http://127.0.0.1:30000"} | {f"http://{fleet.switch[n]}:8000" for n in ("gpu2", "gpu3")}
    assert router_workers(fleet) == dict.fromkeys(want, True)
    # the real router from the lab's index, in its own venv
    assert "smg==1.13.0" in fleet.hosts[0].ssh(
        "/opt/gpuhost/router-venv/bin/python -m pip freeze --disable-pip-version-check")


def test_requests_through_the_router_reach_every_worker_and_need_the_key(fleet):
    since = time.time() - 1
    result = client_loop(fleet, count=30, seconds=60)
    assert result == {"ok": 30, "failed": 0, "errors": []}, result
    refused = client_loop(fleet, count=1, seconds=10, key="wrong")
    assert refused["failed"] == 1 and "401" in refused["errors"][0], refused
    served = {}
    for h in fleet.hosts:  # the server's own access lines (each request once, where it ran)
        journal = h.ssh(f"journalctl -u sglang.service --since @{since:.0f} --no-pager -o cat",
                        check=False)
        served[h.name] = journal.count('"POST /v1/chat/completions HTTP/1.1" 200')
    # cache_aware may keep a prefix on one worker; the prompts differ, so load spreads
    assert sum(served.values()) == 30 and sum(n > 0 for n in served.values()) >= 2, served
    # the router's key is on no command line and in no unit file
    pid = fleet.hosts[0].main_pid(ROUTER)
    assert fleet.router_key not in " ".join(fleet.hosts[0].process_args(pid))
    assert fleet.router_key not in fleet.hosts[0].ssh(
        f"cat /etc/systemd/system/{ROUTER} /etc/systemd/system/{ROUTER_GATE}")


def test_a_second_run_changes_nothing_on_the_router(fleet):
    before = fleet.hosts[0].main_pid(ROUTER)
    again = lab.deploy("--json", inventory=fleet.inventory)
    assert again.returncode == 0, again.output[-6000:]
    assert changed(again) == [], changed(again)
    assert fleet.hosts[0].main_pid(ROUTER) == before
