"""A fleet behind one endpoint, end to end: three serving hosts and the real router (smg from
PyPI, through the lab's index) on the first, over the lab switch.

Each server binds its switch address behind the API key gate; the router binds gpu1's switch
address behind its own gate. Checks go through ssh (systemctl, the router's /workers on its
loopback, the workers' gate journals) and a client on gpu3 over the switch (lab addresses
only), not through pyinfra.
"""

from __future__ import annotations

import json
import re
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
    extra: dict = field(default_factory=dict)  # host data the tests so far set


def write_inventory(path: Path, key_file: str, router_key_file: str,
                    extra: dict | None = None) -> str:
    listed = json.loads(lab.sandbox("status", "--json").stdout)
    entries = []
    for h in listed:
        data = {**lab.inventory_data(h), "gpuhost_server_host": h["switch_address"],
                "gpuhost_fleet_address": h["switch_address"], "gpuhost_api_key_file": key_file,
                **(extra or {})}
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
import json, os, sys, time, urllib.request
url, key, count, limit, pause = (sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]),
                                 float(sys.argv[5]))
ok = failed = 0; errors = []; end = time.monotonic() + limit
for i in range(count):
    if time.monotonic() > end or os.path.exists("/tmp/client.stop"):
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
    time.sleep(pause)
print(json.dumps({"ok": ok, "failed": failed, "errors": errors[:5]}))
"""


def client_loop(fleet: Fleet, count: int, seconds: float, key: str | None = None) -> dict:
    """Requests from gpu3 to the router over the switch (lab addresses only), bounded in count
    and time."""
    url = f"http://{fleet.switch['gpu1']}:{ROUTER_PORT}"
    fleet.hosts[2].ssh(f"rm -f /tmp/client.stop; cat > /tmp/client.py <<'EOF'\n{CLIENT}\nEOF")
    out = fleet.hosts[2].ssh(
        f"python3 /tmp/client.py {url} {key or fleet.router_key} {count} {seconds} 0",
        check=False)
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


def test_a_bench_through_the_router_measures_the_fleet(fleet):
    """bench.py with gpuhost_bench_target=router: the load from gpu1 through the router's public
    endpoint (its key), bench_serving's native backend (/generate: smg 1.13.0 refuses the
    sglang-oai backend's /v1/completions), the workers sending none of their own."""
    since = time.time() - 1
    run = lab.deploy("--data", "gpuhost_bench_levels=[4]", "--data", "gpuhost_bench_prompts=8",
                     "--data", "gpuhost_bench_input_len=32", "--data",
                     "gpuhost_bench_output_len=16", "--data", "gpuhost_bench_target=router",
                     inventory=fleet.inventory, deploy_file="bench.py")
    assert run.returncode == 0, run.output[-8000:]
    for name in ("gpu2", "gpu3"):
        assert re.search(rf"\[{name}\].*a worker of the fleet, loaded through the router on "
                         "gpu1", run.output), run.output[-8000:]
    found = re.findall(r"bench: (\S+)/results\.json", run.output)
    assert len(found) == 1, run.output[-8000:]
    dest = Path(found[0])
    assert dest.parent.name == "fleet-gpu1", dest
    results = json.loads((dest / "results.json").read_text())
    assert results["endpoint"]["kind"] == "router" and results["endpoint"]["url"] == \
        f"http://{fleet.switch['gpu1']}:{ROUTER_PORT}"
    assert results["endpoint"]["workers"] == ["gpu1", "gpu2", "gpu3"]
    assert [lv["bench"]["completed"] for lv in results["levels"]] == [8]
    assert "with 3 workers listed healthy (gpu1, gpu2, gpu3)" in \
        (dest / "summary.md").read_text()
    served = sum(h.ssh(f"journalctl -u sglang.service --since @{since:.0f} --no-pager -o cat",
                       check=False).count('"POST /generate HTTP/1.1" 200') for h in fleet.hosts)
    assert served >= 8, served  # the level's 8 prompts (and the warm-up), through the router
    assert not fleet.hosts[1].ssh("ls /var/lib/gpuhost/bench 2>/dev/null", check=False).strip()


def reboot(h) -> None:
    """Reboot a lab host as a VM reboots (nspawn's exit 133: the supervisor boots it again)."""
    boot = h.ssh("cat /proc/sys/kernel/random/boot_id")
    h.ssh("systemd-run --on-active=1 systemctl reboot")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        time.sleep(3)
        now = h.ssh("cat /proc/sys/kernel/random/boot_id", check=False).strip()
        if now and now != boot and h.ssh("systemctl is-system-running --wait",
                                         check=False).strip() in ("running", "degraded"):
            return
    raise AssertionError(f"{h.name} did not come back from its reboot")


def test_a_run_registers_again_a_worker_the_router_lost_after_its_host_rebooted(fleet):
    """smg registers its --worker-urls at its start only (router_workers.py says what was
    seen): a worker it lost is listed again by the next run, checked from its own list."""
    router_host = fleet.hosts[0]
    reboot(router_host)
    gpu3 = f"http://{fleet.switch['gpu3']}:8000"
    # the router registers its --worker-urls at its start: gpu3 listed, then taken out through
    # the router's own API (what smg does not undo by itself)
    deadline, taken = time.monotonic() + 120, False
    while time.monotonic() < deadline:
        answer = router_host.ssh(f"curl -s -m 10 {ROUTER_OWN}/workers", check=False)
        listed = {w["url"]: w["id"] for w in json.loads(answer or '{"workers": []}')["workers"]}
        if gpu3 in listed:
            taken = router_host.ssh(f"curl -s -m 10 -X DELETE {ROUTER_OWN}/workers/"
                                    f"{listed[gpu3]}", check=False) != "" or taken
        elif taken:
            break
        time.sleep(1)
    assert gpu3 not in router_workers(fleet)
    run = lab.deploy(inventory=fleet.inventory)
    assert run.returncode == 0, run.output[-6000:]
    assert f"registering {gpu3} again" in run.output, run.output[-6000:]
    want = {"http://127.0.0.1:30000"} | {f"http://{fleet.switch[n]}:8000" for n in ("gpu2", "gpu3")}
    assert router_workers(fleet) == dict.fromkeys(want, True)


def rolling_deploy(fleet: Fleet, inventory: str) -> tuple[lab.Run, dict]:
    """A deploy while a client on gpu3 sends requests through the router (lab addresses only,
    bounded: 20000 requests, 480 s), stopped when the deploy ends; its counts."""
    client = fleet.hosts[2]
    url = f"http://{fleet.switch['gpu1']}:{ROUTER_PORT}"
    client.ssh(f"rm -f /tmp/client.stop /tmp/roll-client.out; cat > /tmp/client.py "
               f"<<'EOF'\n{CLIENT}\nEOF")
    client.ssh(f"nohup python3 /tmp/client.py {url} {fleet.router_key} 20000 480 0.05 "
               "> /tmp/roll-client.out 2>&1 < /dev/null &")
    time.sleep(2)
    run = lab.deploy(inventory=inventory)
    client.ssh("touch /tmp/client.stop")
    for _ in range(60):
        out = client.ssh("cat /tmp/roll-client.out", check=False).strip()
        if out:
            return run, json.loads(out.splitlines()[-1])
        time.sleep(1)
    raise AssertionError("the client loop did not finish")


def backend(h) -> str | None:
    """The MoE runner backend the running server was started with (its command line)."""
    args = " ".join(h.process_args(h.main_pid("sglang.service"))).split()
    return args[args.index("--moe-runner-backend") + 1] if "--moe-runner-backend" in args \
        else None


def server_pids(fleet: Fleet) -> dict[str, int]:
    return {h.name: h.main_pid("sglang.service") for h in fleet.hosts}


def test_a_flag_change_rolls_one_host_at_a_time_without_a_failed_request(fleet, tmp_path):
    fleet.extra = {"gpuhost_moe_runner_backend": "flashinfer_cutedsl",
                   "gpuhost_router_wait_timeout": 30}
    inventory = write_inventory(tmp_path / "inventory.py", KEY_FILE, ROUTER_KEY_FILE,
                                fleet.extra)
    before = server_pids(fleet)
    dry = lab.deploy("--dry", inventory=inventory)
    assert dry.returncode == 0, dry.output[-6000:]
    order = "1. gpu1; 2. gpu2; 3. gpu3"
    assert "Roll (planned): servers restart 1 at a time, each out of the router on gpu1" in \
        dry.output and order in dry.output, dry.output[-6000:]
    assert server_pids(fleet) == before
    run, client = rolling_deploy(fleet, inventory)
    assert run.returncode == 0, run.output[-8000:]
    assert client["failed"] == 0 and client["ok"] > 20, client
    assert "Roll: servers restart 1 at a time" in run.output and order in run.output
    after = server_pids(fleet)
    assert all(after[n] != before[n] for n in before), (before, after)
    # one position after the other: each restart after the one before had passed its gate
    started = [int(h.ssh("date -d \"$(systemctl show -p ExecMainStartTimestamp --value "
                         "sglang.service)\" +%s")) for h in fleet.hosts]
    assert started == sorted(started) and len(set(started)) == 3, started
    assert {h.name: backend(h) for h in fleet.hosts} == dict.fromkeys(before,
                                                                       "flashinfer_cutedsl")
    want = {"http://127.0.0.1:30000"} | {f"http://{fleet.switch[n]}:8000" for n in ("gpu2", "gpu3")}
    assert router_workers(fleet) == dict.fromkeys(want, True)
    fleet.inventory = inventory


def test_a_lock_upgrade_rolls_one_host_at_a_time_without_a_failed_request(fleet, tmp_path):
    # another lock digest, the same distributions (tests/e2e/test_rollback.py's relocked): each
    # host builds the new venv beside the serving one, then restarts on it in the roll
    from tests.e2e.test_rollback import relocked

    listed = json.loads(lab.sandbox("status", "--json").stdout)
    lock = relocked(Path(listed[0]["lock"]), tmp_path / "relocked.txt")
    fleet.extra = {**fleet.extra, "gpuhost_lock": str(lock)}
    inventory = write_inventory(tmp_path / "inventory.py", KEY_FILE, ROUTER_KEY_FILE,
                                fleet.extra)
    before = server_pids(fleet)
    run, client = rolling_deploy(fleet, inventory)
    assert run.returncode == 0, run.output[-8000:]
    assert client["failed"] == 0 and client["ok"] > 20, client
    assert "Roll: servers restart 1 at a time" in run.output and \
        "1. gpu1; 2. gpu2; 3. gpu3" in run.output, run.output[-8000:]
    after = server_pids(fleet)
    assert all(after[n] != before[n] for n in before), (before, after)
    started = [int(h.ssh("date -d \"$(systemctl show -p ExecMainStartTimestamp --value "
                         "sglang.service)\" +%s")) for h in fleet.hosts]
    assert started == sorted(started) and len(set(started)) == 3, started
    want = {"http://127.0.0.1:30000"} | {f"http://{fleet.switch[n]}:8000" for n in ("gpu2", "gpu3")}
    assert router_workers(fleet) == dict.fromkeys(want, True)
    fleet.inventory = inventory


def test_a_failed_upgrade_stops_the_roll_and_the_rest_keeps_serving(fleet, tmp_path):
    # gpu2's stand-in dies at start with the cutlass MoE runner backend (sandbox scenario)
    fleet.hosts[1].ssh("python3 - <<'EOF'\nimport json\np = '/etc/gpuhost-sandbox/hardware.json'\n"
                       "d = json.load(open(p))\n"
                       "d['serving']['backend_modes'] = {'cutlass': 'crash-on-start'}\n"
                       "json.dump(d, open(p, 'w'))\nEOF")
    inventory = write_inventory(tmp_path / "inventory.py", KEY_FILE, ROUTER_KEY_FILE, {
        **fleet.extra, "gpuhost_moe_runner_backend": "cutlass"})
    before = server_pids(fleet)
    run, client = rolling_deploy(fleet, inventory)
    assert run.returncode != 0, run.output[-8000:]
    assert client["failed"] == 0 and client["ok"] > 5, client
    assert "Roll: stopped (gpu2 failed its upgrade): gpu3 not restarted" in run.output, \
        run.output[-8000:]
    after = server_pids(fleet)
    assert after["gpu1"] != before["gpu1"]  # upgraded, back in the router
    assert after["gpu3"] == before["gpu3"]  # untouched, serving
    assert backend(fleet.hosts[0]) == "cutlass" and backend(fleet.hosts[2]) == \
        "flashinfer_cutedsl"
    # gpu2 failed its health gate: rolled back to its last known good (issue 17), serving its
    # old flag again, and out of the router until a run upgrades it
    assert "gpu2" in run.output and "rolled back to the last known good" in run.output, \
        run.output[-8000:]
    assert backend(fleet.hosts[1]) == "flashinfer_cutedsl"
    workers = router_workers(fleet)
    assert workers == {"http://127.0.0.1:30000": True,
                       f"http://{fleet.switch['gpu3']}:8000": True}, workers
