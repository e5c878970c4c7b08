"""A fleet behind one endpoint, end to end: three serving hosts (gpu1..gpu3) and a CPU-only
router host (gpu4, sandbox scenario cpu-only: no GPU, no driver, no ML venv, no server) running
the real router (smg from PyPI, through the lab's index), over the lab switch.

Each server binds its switch address behind the API key gate; the router binds gpu4's switch
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
FLEET_KEY_FILE = "/root/fleet.key"
CONTROL_KEY_FILE = "/etc/gpuhost/router-control.key"
ROUTER = "sglang-router.service"
ROUTER_GATE = "sglang-router-gate.service"
ROUTER_PORT = 8100
ROUTER_OWN = "http://127.0.0.1:30100"  # behind the gate, on gpu4's loopback
SERVING = ("gpu1", "gpu2", "gpu3")
ROUTER_HOST = "gpu4"


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
        data = {**lab.inventory_data(h), "gpuhost_fleet_address": h["switch_address"],
                "gpuhost_fleet_key_file": FLEET_KEY_FILE, **(extra or {})}
        if h["name"] == ROUTER_HOST:  # gpuhost_serving = False from the sandbox's host data
            data.update(gpuhost_router_host=h["switch_address"],
                        gpuhost_router_api_key_file=router_key_file,
                        gpuhost_router_health_check_interval_secs=2)
        else:
            data.update(gpuhost_server_host=h["switch_address"], gpuhost_api_key_file=key_file)
        entries.append((h["name"], data))
    literal = json.dumps(json.dumps(entries))
    path.write_text(f"import json\nsandbox = [tuple(e) for e in json.loads({literal})]\n"
                    f"gpuhost_router = [{ROUTER_HOST!r}]\n")
    return str(path)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    hosts = lab.up_from_image(hosts=4, host_scenarios={ROUTER_HOST: "cpu-only"})
    key = lab.GUARD.register("sk-" + secrets.token_hex(24), "API key")
    router_key = lab.GUARD.register("sk-" + secrets.token_hex(24), "router API key")
    fleet_key = lab.GUARD.register("sk-" + secrets.token_hex(24), "fleet key")
    for h in hosts:
        h.ssh(f"umask 077; printf '%s\\n' {fleet_key} > {FLEET_KEY_FILE}")
    for h in hosts[:3]:
        h.ssh(f"umask 077; printf '%s\\n' {key} > {KEY_FILE}")
    hosts[3].ssh(f"umask 077; printf '%s\\n' {router_key} > {ROUTER_KEY_FILE}")
    switch = {h["name"]: h["switch_address"]
              for h in json.loads(lab.sandbox("status", "--json").stdout)}
    inventory = write_inventory(tmp_path_factory.mktemp("router") / "inventory.py",
                                KEY_FILE, ROUTER_KEY_FILE)
    first = lab.deploy(inventory=inventory)
    assert first.returncode == 0, first.output[-8000:]
    yield Fleet(hosts, switch, inventory, key, router_key)
    lab.sandbox("down", check=False)


def router_api(fleet: Fleet, path: str, method: str = "GET", check: bool = True) -> str:
    """The router's own API on the router host's loopback, with its python3 (a CPU-only VM
    left as the deploy leaves it has no curl) and the control-plane key the deploy made there
    (root's only)."""
    script = ("import sys, urllib.request as u; k = open(sys.argv[3]).read().strip(); "
              "r = u.Request(sys.argv[1], method=sys.argv[2], "
              "headers={'Authorization': 'Bearer ' + k}); "
              "print(u.urlopen(r, timeout=10).read().decode())")
    return fleet.hosts[3].ssh(f"python3 -c {json.dumps(script)} {ROUTER_OWN}{path} {method} "
                              f"{CONTROL_KEY_FILE}", check=check)


def router_workers(fleet: Fleet) -> dict[str, bool]:
    body = json.loads(router_api(fleet, "/workers"))
    return {w["url"]: w["is_healthy"] for w in body["workers"]}


def every_worker(fleet: Fleet, names=SERVING) -> dict[str, bool]:
    """What router_workers gives when the router lists ``names`` healthy."""
    return dict.fromkeys((f"http://{fleet.switch[n]}:8000" for n in names), True)


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
    url = f"http://{fleet.switch[ROUTER_HOST]}:{ROUTER_PORT}"
    fleet.hosts[2].ssh(f"rm -f /tmp/client.stop; cat > /tmp/client.py <<'EOF'\n{CLIENT}\nEOF")
    out = fleet.hosts[2].ssh(
        f"python3 /tmp/client.py {url} {key or fleet.router_key} {count} {seconds} 0",
        check=False)
    return json.loads(out.strip().splitlines()[-1])


def test_router_lists_every_serving_host_healthy(fleet):
    router = fleet.hosts[3]
    assert router.ssh(f"systemctl is-active {ROUTER} {ROUTER_GATE}").split() == [
        "active", "active"]
    assert router_workers(fleet) == every_worker(fleet)
    # the real router from the lab's index, in its own venv
    assert "smg==1.13.0" in router.ssh(
        "/opt/gpuhost/router-venv/bin/python -m pip freeze --disable-pip-version-check")
    # a CPU-only VM, left one: no NVIDIA device, no driver, no ML venv, no server
    assert router.ssh("lspci -Dnnk -d 10de:") == ""
    assert router.ssh("command -v nvidia-smi || echo none") == "none\n"
    assert router.ssh("dpkg-query -W -f '${Status} ${Package}\\n' 'nvidia*' 'cuda*' "
                      "2>/dev/null | grep '^install ok installed' || true") == ""
    assert not {"venv", "venvs", "models"} & set(router.ssh("ls /opt/gpuhost").split())
    # the gate (nginx) and its key files' path unit with the oneshot that reloads it
    assert sorted(router.ssh("systemctl list-unit-files 'sglang*' --no-legend").split()[::3]) \
        == ["sglang-router-gate-keys.path", "sglang-router-gate-keys.service", ROUTER_GATE,
            ROUTER]


def test_requests_through_the_router_reach_every_worker_and_need_the_key(fleet):
    since = time.time() - 1
    result = client_loop(fleet, count=30, seconds=60)
    assert result == {"ok": 30, "failed": 0, "errors": []}, result
    refused = client_loop(fleet, count=1, seconds=10, key="wrong")
    assert refused["failed"] == 1 and "401" in refused["errors"][0], refused
    served = {}
    for h in fleet.hosts[:3]:  # the server's own access lines (each request once, where it ran)
        journal = h.ssh(f"journalctl -u sglang.service --since @{since:.0f} --no-pager -o cat",
                        check=False)
        served[h.name] = journal.count('"POST /v1/chat/completions HTTP/1.1" 200')
    # cache_aware may keep a prefix on one worker; the prompts differ, so load spreads
    assert sum(served.values()) == 30 and sum(n > 0 for n in served.values()) >= 2, served
    # the router's key is on no command line and in no unit file
    pid = fleet.hosts[3].main_pid(ROUTER)
    assert fleet.router_key not in " ".join(fleet.hosts[3].process_args(pid))
    assert fleet.router_key not in fleet.hosts[3].ssh(
        f"cat /etc/systemd/system/{ROUTER} /etc/systemd/system/{ROUTER_GATE}")


def test_a_second_run_changes_nothing_on_the_router(fleet):
    before = fleet.hosts[3].main_pid(ROUTER)
    again = lab.deploy("--json", inventory=fleet.inventory)
    assert again.returncode == 0, again.output[-6000:]
    assert changed(again) == [], changed(again)
    assert fleet.hosts[3].main_pid(ROUTER) == before
    dry = lab.deploy("--dry", inventory=fleet.inventory)
    assert dry.returncode == 0, dry.output[-6000:]
    assert f"[{ROUTER_HOST}]" in dry.output and "serves no model" in dry.output, dry.output[-6000:]


def test_a_bench_through_a_cpu_only_router_host_is_refused_before_any_load(fleet):
    """bench.py with gpuhost_bench_target=router: the fleet's load comes from a router host's ML
    venv (bench_serving) and model folder (the tokenizer), which the CPU-only router host has
    not: refused while planning, before any load, and the workers, which the fleet bench would
    load, bench nothing of their own either."""
    since = time.time() - 1
    run = lab.deploy("--data", "gpuhost_bench_levels=[4]", "--data", "gpuhost_bench_prompts=8",
                     "--data", "gpuhost_bench_input_len=32", "--data",
                     "gpuhost_bench_output_len=16", "--data", "gpuhost_bench_target=router",
                     inventory=fleet.inventory, deploy_file="bench.py")
    assert run.returncode != 0, run.output[-8000:]
    assert f"gpuhost_bench_target = 'router' on {ROUTER_HOST}, which serves no model " \
        "(gpuhost_serving = False)" in run.output, run.output[-8000:]
    assert run.output.count("no router host of this run benches the fleet") >= 3, \
        run.output[-8000:]
    assert not re.findall(r"bench: (\S+)/results\.json", run.output), run.output[-8000:]
    served = sum(h.ssh(f"journalctl -u sglang.service --since @{since:.0f} --no-pager -o cat",
                       check=False).count('"POST /generate HTTP/1.1" 200')
                 for h in fleet.hosts[:3])
    assert served == 0, served


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


def take_out(fleet: Fleet, url: str) -> None:
    """Take ``url`` out through the router's own API once the router lists it (what smg does
    not undo by itself), and wait until it lists it no more."""
    deadline, taken = time.monotonic() + 120, False
    while time.monotonic() < deadline:
        answer = router_api(fleet, "/workers", check=False)
        listed = {w["url"]: w["id"] for w in json.loads(answer or '{"workers": []}')["workers"]}
        if url in listed:
            taken = router_api(fleet, f"/workers/{listed[url]}", "DELETE",
                               check=False) != "" or taken
        elif taken:
            break
        time.sleep(1)
    assert url not in router_workers(fleet)


def test_a_run_registers_again_workers_the_router_lost_after_their_hosts_rebooted(fleet):
    """smg registers its --worker-urls at its start only (router_workers.py says what was
    seen): a worker it lost, after the router host rebooted or after the worker's host did, is
    listed again by the next run, checked from its own list."""
    reboot(fleet.hosts[3])  # the router host
    # the router registers its --worker-urls at its start: gpu3 listed, then taken out
    gpu3 = f"http://{fleet.switch['gpu3']}:8000"
    take_out(fleet, gpu3)
    reboot(fleet.hosts[1])  # a worker's host: its server starts again at boot
    gpu2 = f"http://{fleet.switch['gpu2']}:8000"
    take_out(fleet, gpu2)
    run = lab.deploy(inventory=fleet.inventory)
    assert run.returncode == 0, run.output[-6000:]
    for url in (gpu2, gpu3):
        assert f"registering {url} again" in run.output, run.output[-6000:]
    assert router_workers(fleet) == every_worker(fleet)


def rolling_deploy(fleet: Fleet, inventory: str, client=None,
                   seconds: int = 480) -> tuple[lab.Run, dict]:
    """A deploy while a client (on gpu3 unless ``client`` says which host) sends requests
    through the router (lab addresses only, bounded: 20000 requests, ``seconds``), stopped
    when the deploy ends; its counts."""
    client = client or fleet.hosts[2]
    url = f"http://{fleet.switch[ROUTER_HOST]}:{ROUTER_PORT}"
    client.ssh(f"rm -f /tmp/client.stop /tmp/roll-client.out; cat > /tmp/client.py "
               f"<<'EOF'\n{CLIENT}\nEOF")
    client.ssh(f"nohup python3 /tmp/client.py {url} {fleet.router_key} 20000 {seconds} 0.05 "
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


def took_out_and_back(run: lab.Run, positions: int) -> None:
    """Each position's host (gpu1, gpu2, gpu3 in that order) was taken out of the router on
    gpu4 and put back in: the router's own words, through each host's leave and join."""
    for k in range(1, positions + 1):
        for step, said in (("out of the router, drained", "drained and out"),
                           ("back in the router, healthy", "back in, healthy")):
            section = run.output.partition(f"Roll position {k}: {step}")[2].partition(
                "--> Starting operation")[0]
            assert f"[gpu{k}] Roll: on {ROUTER_HOST}: router: " in section and said in \
                section, (k, step, section[-2000:])


def server_pids(fleet: Fleet) -> dict[str, int]:
    return {h.name: h.main_pid("sglang.service") for h in fleet.hosts[:3]}


def test_a_flag_change_rolls_one_host_at_a_time_without_a_failed_request(fleet, tmp_path):
    fleet.extra = {"gpuhost_moe_runner_backend": "flashinfer_cutedsl",
                   "gpuhost_router_wait_timeout": 30}
    inventory = write_inventory(tmp_path / "inventory.py", KEY_FILE, ROUTER_KEY_FILE,
                                fleet.extra)
    before = server_pids(fleet)
    dry = lab.deploy("--dry", inventory=inventory)
    assert dry.returncode == 0, dry.output[-6000:]
    order = "1. gpu1; 2. gpu2; 3. gpu3"
    assert "Roll (planned): servers restart 1 at a time, each out of the router on gpu4" in \
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
                         "sglang.service)\" +%s")) for h in fleet.hosts[:3]]
    assert started == sorted(started) and len(set(started)) == 3, started
    assert {h.name: backend(h) for h in fleet.hosts[:3]} == dict.fromkeys(before,
                                                                       "flashinfer_cutedsl")
    assert router_workers(fleet) == every_worker(fleet)
    fleet.inventory = inventory
    took_out_and_back(run, 3)


def test_a_cuda_13_upgrade_rolls_one_host_at_a_time_without_a_failed_request(fleet, tmp_path):
    """gpuhost_cuda_toolkit = "13.0" with the CUDA 13 stack's lock (issue 39: the sandbox's
    stand-in of locks/cuda13.0.txt, `status --json` locks, named as a real lab names its own):
    each host installs the CUDA 13 toolkit and builds the new venv beside the serving one
    before the roll, then restarts on it in its turn, out of the router; a client through the
    router sees no failed request. The later tests run on CUDA 13."""
    listed = json.loads(lab.sandbox("status", "--json").stdout)
    lock = listed[0]["locks"]["13.0"]
    fleet.extra = {**fleet.extra, "gpuhost_cuda_toolkit": "13.0", "gpuhost_lock": lock}
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
                         "sglang.service)\" +%s")) for h in fleet.hosts[:3]]
    assert started == sorted(started) and len(set(started)) == 3, started
    for h in fleet.hosts[:3]:
        assert h.process_env(after[h.name])["CUDA_HOME"] == "/usr/local/cuda-13.0", h.name
        venv = h.process_args(after[h.name])[0].removesuffix("/bin/python")
        versions = h.ssh(f"{venv}/bin/python -c 'import torch, sglang; "
                         "print(torch.__version__, sglang.__version__)'").split()
        assert versions == ["2.11.0+cu130", "0.5.17"], (h.name, versions)
    assert router_workers(fleet) == every_worker(fleet)
    fleet.inventory = inventory
    took_out_and_back(run, 3)


def driver(h) -> str:
    """The loaded driver's version, as nvidia-smi says it (one line per GPU, all alike)."""
    return set(h.ssh("nvidia-smi --query-gpu=driver_version --format=csv,noheader")
               .split()).pop()


def test_a_driver_upgrade_rolls_one_host_at_a_time_without_a_failed_request(fleet, tmp_path):
    """A driver change (the sandbox repository's other 580 driver; the fleet has the newest)
    reboots each serving host in its turn, out of the router: a client on the router host,
    which serves no model and does not reboot, sees no failed request; after the reboots the
    router lists all three again, from its own list."""
    fleet.extra = {**fleet.extra, "gpuhost_driver_version": "580.95.05",
                   "gpuhost_allow_driver_change": True}
    inventory = write_inventory(tmp_path / "inventory.py", KEY_FILE, ROUTER_KEY_FILE,
                                fleet.extra)
    boots = {h.name: h.ssh("cat /proc/sys/kernel/random/boot_id") for h in fleet.hosts}
    dry = lab.deploy("--dry", inventory=inventory)
    assert dry.returncode == 0, dry.output[-6000:]
    for name in SERVING:
        assert f"[{name}] NVIDIA: the driver changes in this host's turn of the roll" in \
            dry.output, dry.output[-6000:]
    assert "Roll (planned): servers restart 1 at a time" in dry.output and \
        "1. gpu1; 2. gpu2; 3. gpu3" in dry.output, dry.output[-6000:]
    assert "the router runs here" not in dry.output  # gpu4 serves nothing: no reboot there
    run, client = rolling_deploy(fleet, inventory, client=fleet.hosts[3], seconds=1200)
    assert run.returncode == 0, run.output[-8000:]
    assert client["failed"] == 0 and client["ok"] > 20, client
    took_out_and_back(run, 3)
    after = {h.name: h.ssh("cat /proc/sys/kernel/random/boot_id") for h in fleet.hosts}
    assert [n for n in after if after[n] != boots[n]] == list(SERVING), (boots, after)
    assert {h.name: driver(h) for h in fleet.hosts[:3]} == dict.fromkeys(SERVING, "580.95.05")
    # one host at a time: each server started on its new driver after the one before
    started = [int(h.ssh("date -d \"$(systemctl show -p ExecMainStartTimestamp --value "
                         "sglang.service)\" +%s")) for h in fleet.hosts[:3]]
    assert started == sorted(started) and len(set(started)) == 3, started
    assert router_workers(fleet) == every_worker(fleet)
    fleet.inventory = inventory
    pids = server_pids(fleet)
    again = lab.deploy("--json", inventory=inventory)
    assert again.returncode == 0 and server_pids(fleet) == pids, again.output[-6000:]
    assert changed(again) == [] and "Roll:" not in again.output, changed(again)


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
    assert workers == every_worker(fleet, ("gpu1", "gpu3")), workers
