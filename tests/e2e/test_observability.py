"""The fleet seen while it serves, end to end: two serving hosts (gpu1, gpu2) behind the API key
gate and a CPU-only router host (gpu3) running the real router and Debian's Prometheus, which
scrapes both servers, the router and both GPU hosts' node exporters (Debian's, with the GPU
readings of the nvidia-smi stand-in under DCGM exporter's names).

The fleet is tests/e2e/fleets.py's ``cpu_router_fleet``, test_planes.py's (whose tests come
first, in the same process: tests/lanes.py ``LANES_UNIT_WITH``); the router there is bound on
the lab switch. Checks go through ssh to Prometheus' own HTTP API on gpu3's loopback (python3's
urllib: the router host has no curl), systemctl, and requests over the lab switch; not through
pyinfra.
"""

from __future__ import annotations

import json
import re
import shlex
import time

import pytest

from tests.e2e import lab
from tests.e2e.fleets import CPU_ROUTER_HOST
from tests.e2e.test_server import changed

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
#: tests/lanes.py: this module's tests run in test_planes.py's unit, after its tests
LANES_UNIT_WITH = "test_planes.py"

SERVING = ("gpu1", "gpu2")
ROUTER_HOST = CPU_ROUTER_HOST
PROMETHEUS = "http://127.0.0.1:9090"
#: The webhook receiver on the router host (its loopback: fleets.HOOK_URL): each POST's
#: body, one line each.
HOOK_LOG = "/root/webhook.jsonl"
HOOK = ("import http.server\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_POST(self):\n"
        "        body = self.rfile.read(int(self.headers.get('Content-Length', 0)))\n"
        f"        with open('{HOOK_LOG}', 'ab') as f:\n"
        "            f.write(body.replace(b'\\n', b' ') + b'\\n')\n"
        "        self.send_response(200)\n"
        "        self.end_headers()\n"
        "http.server.HTTPServer(('127.0.0.1', 9999), H).serve_forever()\n")
#: A GET (with basic auth as prometheus where a password file is given) as urllib makes it.
GET = ("import base64, sys, urllib.request as u\nh = {}\nif len(sys.argv) > 2:\n"
       "    p = open(sys.argv[2]).read().strip()\n"
       "    b = base64.b64encode(('prometheus:' + p).encode()).decode()\n"
       "    h['Authorization'] = 'Basic ' + b\n"
       "try:\n    r = u.urlopen(u.Request(sys.argv[1], headers=h), timeout=10)\n"
       "    print(r.status); print(r.read().decode())\nexcept u.HTTPError as e:\n"
       "    print(e.code)\nexcept OSError as e:\n    print('refused', e)\n")
#: The metrics password on the Prometheus host (root:prometheus 0640).
PASSWORD_FILE = "/etc/prometheus/gpuhost-metrics.password"


@pytest.fixture(scope="module")
def fleet(cpu_router_fleet):
    """The run's fleet (tests/e2e/fleets.py ``cpu_router_fleet``: after test_planes.py's tests
    in the same process, tests/lanes.py), with a webhook receiver where Alertmanager posts (the
    router host's loopback, root's) for this module's tests alone: it answers every POST 200,
    and test_planes.py asks every port of the router host for a completion."""
    router = cpu_router_fleet.hosts[ROUTER_HOST]
    router.ssh(f"cat > /root/webhook.py <<'EOF'\n{HOOK}EOF\n"
               "systemd-run --unit=test-webhook python3 /root/webhook.py")
    yield {"hosts": cpu_router_fleet.hosts, "switch": cpu_router_fleet.switch,
           "inventory": cpu_router_fleet.inventory}
    router.ssh("systemctl stop test-webhook", check=False)


def get(host: lab.Host, url: str, user: str = "root", password_file: str = "") -> tuple[str, str]:
    """The status of a GET of ``url`` from ``host`` (and the body), as ``user`` there, with the
    metrics password of ``password_file`` (read there) where given."""
    run = "python3" if user == "root" else f"runuser -u {user} -- python3"
    out = host.ssh(f"cd / && {run} - '{url}' {password_file} <<'EOF'\n{GET}EOF", check=False)
    status, _, body = out.partition("\n")
    return status.strip(), body


def api(fleet, path: str) -> dict:
    status, body = get(fleet["hosts"][ROUTER_HOST], PROMETHEUS + path,
                       password_file=PASSWORD_FILE)
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
    """From gpu2 (a worker, not a router host) and from a local user of gpu1 (nobody): gpu1's
    server /metrics through its gate and its node exporter without the fleet's credentials are
    refused (401), the server's loopback port behind the gate too (the loopback guard's reset),
    and the router's metrics to a local user of gpu3;
    Prometheus and its UI are not on gpu3's fleet address; the router's metrics neither. Yet
    Prometheus, with the credentials, has every one of them up."""
    gpu1, gpu2, sw = fleet["hosts"]["gpu1"], fleet["hosts"]["gpu2"], fleet["switch"]
    for host, user in ((gpu2, "root"), (gpu1, "nobody")):
        for url in (f"http://{sw['gpu1']}:8000/metrics", f"http://{sw['gpu1']}:9100/metrics",
                    f"http://{sw['gpu1']}:9100/"):
            assert get(host, url, user)[0] == "401", (host.name, user, url)
    assert get(gpu1, "http://127.0.0.1:30000/metrics", "nobody")[0].startswith("refused")
    # the router's metrics: the loopback, and there root's and Prometheus' sockets alone
    router = fleet["hosts"][ROUTER_HOST]
    assert get(router, "http://127.0.0.1:29000/metrics", "nobody")[0].startswith("refused")
    assert get(router, "http://127.0.0.1:29000/metrics")[0] == "200"
    # Alertmanager: the loopback, no cluster port, and a local user's connection reset
    assert get(router, "http://127.0.0.1:9093/api/v2/status", "nobody")[0].startswith("refused")
    assert get(router, "http://127.0.0.1:9093/api/v2/status")[0] == "200"
    # Prometheus' API: the metrics password, even on its own host's loopback
    for user in ("root", "nobody"):
        assert get(router, PROMETHEUS + "/api/v1/targets", user)[0] == "401", user
    listening = router.ssh("ss -Hltn")
    assert "127.0.0.1:9093" in listening and ":9094" not in listening, listening
    # the credentials on the hosts: root and the prometheus group alone
    for host, path in ((gpu1, "/etc/gpuhost/node-exporter-web.yml"),
                       (fleet["hosts"][ROUTER_HOST], "/etc/prometheus/gpuhost-fleet.key"),
                       (fleet["hosts"][ROUTER_HOST],
                        PASSWORD_FILE),
                      (fleet["hosts"][ROUTER_HOST], "/etc/prometheus/gpuhost-web.yml")):
        assert host.ssh(f"stat -c '%U:%G %a' {path}").strip() == "root:prometheus 640", path
    assert "sk-" not in fleet["hosts"][ROUTER_HOST].ssh("cat /etc/prometheus/prometheus.yml")
    up = targets(fleet)
    assert all(up[(job, n)] == "up" for job in ("sglang", "node") for n in SERVING), up
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


def test_status_prints_the_fleet_and_draws_its_hour(fleet):
    """A bench of gpu1 (bench.py, two levels), then status.py: a line per host with serving,
    the sglang version, uptime, req/s, power against the limit, throttle reasons and (gpu1) the
    bench just made; the fleet's line; the picture. Its time is printed (issue 32: under 5 s for
    3 hosts), not asserted: this machine's load decides it."""
    bench = lab.deploy("--limit", "gpu1", "--data", "gpuhost_bench_levels=[1, 4]",
                       "--data", "gpuhost_bench_prompts=8", "--data",
                       "gpuhost_bench_input_len=32", "--data", "gpuhost_bench_output_len=24",
                       inventory=fleet["inventory"], deploy_file="bench.py")
    assert bench.returncode == 0, bench.output[-6000:]
    made = re.search(r"bench: \S+/(\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ)/results\.json",
                     bench.output)
    assert made, bench.output[-4000:]
    started = time.monotonic()
    # as docs/observability.md has it: no -y, and no terminal to answer a prompt (issue 42)
    run = lab.deploy(inventory=fleet["inventory"], deploy_file="status.py", yes=False)
    elapsed = time.monotonic() - started
    assert run.returncode == 0, run.output[-6000:]
    assert "Press enter" not in run.output and "Traceback" not in run.output, run.output[-3000:]
    lines = {line.split(":", 1)[0]: line for line in run.output.splitlines()
             if re.match(r"^(gpu\d|fleet): ", line)}
    print(f"status.py took {elapsed:.1f} s (pyinfra's start, ssh to 3 hosts, the queries, "
          "the picture)")
    print("\n".join(lines.values()))
    for name in SERVING:
        assert re.match(rf"{name}: serving; sglang 0\.5\.9; up \d+ (min|h)", lines[name]), lines
        assert re.search(r"\d+\.\d\d req/s, \d+\.\d output tok/s \(5 min\)", lines[name])
        assert re.search(r"8 GPUs at \d+ W of 4800 W \(\d+ %\); (no throttling|held back: )",
                         lines[name]), lines[name]
    assert re.search(rf"; last bench {made.group(1)}: \d+\.\d output tok/s at \d+ concurrent, "
                     r"p99 TTFT \d+ ms, power \d+ % of limit$", lines["gpu1"]), lines["gpu1"]
    assert lines[ROUTER_HOST] == (f"{ROUTER_HOST}: runs the router, Prometheus and Alertmanager, "
                                  "no server; router up")
    assert lines["fleet"].startswith("fleet: 2 of 2 server(s) serving; ")
    picture = re.search(r"the last hour: (status-results/fleet-\S+\.png)", run.output)
    assert picture, run.output[-3000:]
    assert (lab.ROOT / picture.group(1)).read_bytes()[:4] == b"\x89PNG"


def test_a_stopped_server_fires_its_alert_and_a_restart_clears_it(fleet):
    gpu1 = fleet["hosts"]["gpu1"]
    gpu1.ssh("systemctl stop sglang.service")
    started = time.monotonic()
    try:
        alerts = wait_for("SGLangServerDown firing", lambda: firing(fleet, "SGLangServerDown"),
                          timeout=180)
        print(f"SGLangServerDown firing {time.monotonic() - started:.0f} s after the stop")
        assert [a["labels"]["host"] for a in alerts] == ["gpu1"]
        # and Alertmanager posted it to the webhook host data names
        router = fleet["hosts"][ROUTER_HOST]

        def posted():
            out = router.ssh(f"cat {HOOK_LOG} 2>/dev/null || true")
            return [a for line in out.splitlines() if line.strip()
                    for a in json.loads(line)["alerts"]
                    if a["status"] == "firing" and a["labels"]["alertname"] == "SGLangServerDown"
                    and a["labels"]["host"] == "gpu1"]

        wait_for("the webhook got SGLangServerDown", posted, timeout=180)
        print(f"webhook got SGLangServerDown {time.monotonic() - started:.0f} s after the stop")
    finally:
        gpu1.ssh("systemctl start sglang.service")
    started = time.monotonic()
    wait_for("SGLangServerDown cleared", lambda: not firing(fleet, "SGLangServerDown"),
             timeout=180)
    print(f"cleared {time.monotonic() - started:.0f} s after the start")


def smg_health(router: lab.Host, worker: str) -> str | None:
    """smg's own health of ``worker`` (its metrics on the router host's loopback, root's):
    "1" healthy, "0" not, None not listed."""
    status, body = get(router, "http://127.0.0.1:29000/metrics")
    assert status == "200", status
    found = re.search(rf'^smg_worker_health{{[^}}]*worker="{re.escape(worker)}"[^}}]*}} (\S+)$',
                      body, re.M)
    return found.group(1) if found else None


def served(host: lab.Host, since: float) -> int:
    """Chat completions the host's gate passed since ``since`` (epoch seconds; the hosts share
    this machine's clock): its journal's lines (templates/gate-nginx.conf.j2 log_format)."""
    return int(host.ssh(f"journalctl -t sglang_gate --since @{int(since)} -o cat --no-pager | "
                        "grep -c '\"POST /v1/chat/completions\" 200' || true").strip() or 0)


def start_client(fleet) -> None:
    """tests/e2e/test_router.py's client on the router host, through the router's gate (bound
    on the lab switch) with the router's client key, until :func:`client_result` stops it."""
    from tests.e2e.test_router import CLIENT

    gate = f"http://{fleet['switch'][ROUTER_HOST]}:8100"
    fleet["hosts"][ROUTER_HOST].ssh(
        f"rm -f /tmp/client.stop /tmp/client.out; cat > /tmp/client.py <<'EOF'\n{CLIENT}\n"
        f"EOF\nnohup python3 /tmp/client.py {gate} $(cat {lab.ROUTER_KEY_FILE}) "
        "1000000 900 0.1 > /tmp/client.out 2>&1 &")


def client_result(fleet) -> dict:
    """The client's count once stopped: ``{"ok": n, "failed": n, "errors": [...]}``."""
    router = fleet["hosts"][ROUTER_HOST]
    router.ssh("touch /tmp/client.stop")
    wait_for("the client's count", lambda: router.ssh("cat /tmp/client.out",
                                                      check=False).strip(), 60, pause=1)
    result = json.loads(router.ssh("cat /tmp/client.out").strip().splitlines()[-1])
    print(f"the client through the router: {result}")
    return result


def test_a_failed_gpu_fires_its_alerts_and_status_names_the_host(fleet):
    """gpu2's stand-in GPUs told to fail as sandbox/standins/nvidia/nvidia-smi says: GPU 7 gone
    from the driver's list with an Xid 79 in the kernel log, GPU 2's link at x8, while a client
    sends requests through the router. smg's health checks mark gpu2 unhealthy (its gate
    answers /health 503 while its own GPU verdict is failed) and gpu1 serves every request;
    Prometheus has the series and fires GPUHostFailed, GPUFatalXid and GPUMissing for gpu2
    alone (GPULinkDegraded pending: it waits 5 minutes), status.py says gpu2's GPUs FAILED and
    why, gpu1's healthy; a deploy that would restart gpu2's server is refused and leaves it
    running; cleared (as a reboot clears the kernel log), the alerts resolve and gpu2 serves
    through the router again. The client: 0 failed requests."""
    from urllib.parse import quote

    def query(q):
        return api(fleet, "/api/v1/query?query=" + quote(q))["result"]

    gpu1, gpu2 = fleet["hosts"]["gpu1"], fleet["hosts"]["gpu2"]
    router = fleet["hosts"][ROUTER_HOST]
    worker2 = f"http://{fleet['switch']['gpu2']}:8000"
    assert smg_health(router, worker2) == "1"
    hw = json.loads(gpu2.ssh("cat /etc/gpuhost-sandbox/hardware.json"))
    bus = hw["gpus"][7]["pci_bus_id"]
    key = f"{int(bus[:8], 16):04x}:{bus[9:11].lower()}:{bus[12:14].lower()}"
    faults = {"gpus": {"7": {"gone": True}, "2": {"pcie_width_current": 8}},
              "xids": [{"bus": key, "code": 79, "text": "GPU has fallen off the bus."}]}
    start_client(fleet)
    unit = gpu2.ssh("md5sum /etc/systemd/system/sglang.service")
    pid = gpu2.main_pid()
    try:
        gpu2.ssh("mkdir -p /run/gpuhost-sandbox && cat > /run/gpuhost-sandbox/gpu-faults.json "
                 f"<<'EOF'\n{json.dumps(faults)}\nEOF")
        started = time.monotonic()
        try:
            wait_for("smg marks gpu2 unhealthy", lambda: smg_health(router, worker2) == "0",
                     timeout=120, pause=1)
            out_at = time.time()
            print(f"gpu2 out of the router {time.monotonic() - started:.0f} s after the fault")
            # the reading that took it out may have read nvidia-smi just before the faults were
            # written and the kernel log just after (the Xid alone fails it): the next one
            # names both, the missing GPU first
            wait_for("gpu2's verdict names the missing GPU",
                     lambda: gpu2.ssh("cat /run/gpuhost-gpu-health/failed").startswith(
                         "failed: 7 of 8 GPUs seen by the driver"), timeout=60, pause=1)
            xid = wait_for("GPUFatalXid firing", lambda: firing(fleet, "GPUFatalXid"),
                           timeout=180)
            print(f"GPUFatalXid firing {time.monotonic() - started:.0f} s after the fault")
            assert [(a["labels"]["host"], a["labels"]["xid"], a["labels"]["pci_bus_id"])
                    for a in xid] == [("gpu2", "79", bus)]
            missing = wait_for("GPUMissing firing", lambda: firing(fleet, "GPUMissing"), 60)
            assert [a["labels"]["host"] for a in missing] == ["gpu2"]
            # the alert that says the host is out of the router, which host and why
            out = wait_for("GPUHostFailed firing", lambda: firing(fleet, "GPUHostFailed"), 60)
            assert [a["labels"]["host"] for a in out] == ["gpu2"]
            assert out[0]["annotations"]["summary"] == \
                "gpu2 is out of the router: its GPUs failed"
            assert f"Xid 79 (the GPU fell off the bus) x1 on GPU {bus}: reboot the host" in \
                out[0]["annotations"]["description"]
            assert {r["metric"]["host"]: r["value"][1] for r in query("DCGM_FI_DEV_COUNT")} == \
                {"gpu1": "8", "gpu2": "7"}
            assert [(r["metric"]["host"], r["metric"]["gpu"]) for r in query(
                "DCGM_FI_DEV_PCIE_LINK_WIDTH < DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH")] == \
                [("gpu2", "2")]
            link = [a for a in api(fleet, "/api/v1/alerts")["alerts"]
                    if a["labels"]["alertname"] == "GPULinkDegraded"]
            assert [(a["labels"]["host"], a["state"]) for a in link] == [("gpu2", "pending")]
            run = lab.deploy(inventory=fleet["inventory"], deploy_file="status.py")
            assert run.returncode == 0, run.output[-6000:]
            lines = {line.split(":", 1)[0]: line for line in run.output.splitlines()
                     if re.match(r"^gpu\d: ", line)}
            print(lines["gpu2"])
            assert "; GPUs FAILED: 7 of 8 GPUs seen by the driver" in lines["gpu2"]
            assert f"Xid 79 (the GPU fell off the bus) x1 on GPU {bus}: reboot the host" in \
                lines["gpu2"]
            assert "a PCIe link at x8 of x16" in lines["gpu2"]
            assert "; GPUs healthy" in lines["gpu1"], lines["gpu1"]
            # a deploy that would restart gpu2's server (another --max-running-requests)
            refused = lab.deploy("--limit", "gpu2", "--data", "gpuhost_max_running_requests=32",
                                 inventory=fleet["inventory"])
            said = [line for line in refused.output.splitlines()
                    if "SGLang server: refused: gpu2's GPUs failed" in line]
            print("\n".join(said))
            assert refused.returncode != 0 and len(said) == 1, refused.output[-6000:]
            assert ("gpu2's GPUs failed, so its server is not restarted: 7 of 8 GPUs seen by "
                    "the driver: reboot the host") in said[0]
            assert f"Xid 79 (the GPU fell off the bus) x1 on GPU {bus}: reboot the host" \
                in said[0]
            assert "nvidia-smi -r" in said[0]
            assert gpu2.main_pid() == pid
            assert gpu2.ssh("md5sum /etc/systemd/system/sglang.service") == unit
            # every request since gpu2 left the router went to gpu1
            assert served(gpu2, out_at + 2) == 0
            assert served(gpu1, out_at + 2) > 0
        finally:
            gpu2.ssh("rm -f /run/gpuhost-sandbox/gpu-faults.json")
        cleared = time.monotonic()
        wait_for("the GPU alerts resolved", lambda: not firing(fleet, "GPUFatalXid")
                 and not firing(fleet, "GPUMissing") and not firing(fleet, "GPUHostFailed"),
                 timeout=180)
        wait_for("smg takes gpu2 back", lambda: smg_health(router, worker2) == "1", timeout=120,
                 pause=1)
        back_at = time.time()
        print(f"gpu2 back in the router {time.monotonic() - cleared:.0f} s after the clearing")
        assert gpu2.ssh("ls /run/gpuhost-gpu-health/").strip() == ""
        wait_for("gpu2 serves through the router again", lambda: served(gpu2, back_at) > 0,
                 timeout=120, pause=2)
    finally:
        result = client_result(fleet)
    assert result["failed"] == 0 and result["ok"] >= 100, result


def test_an_uncorrectable_ecc_error_and_a_failed_remap_take_the_host_out_until_cleared(fleet):
    """The failures a GPU on the bus reports itself: gpu1's stand-in GPU 3 with 2 uncorrectable
    (double bit) volatile ECC errors and GPU 5's row remapping failed, as
    sandbox/standins/nvidia/nvidia-smi prints them, while a client sends requests through the
    router. smg marks gpu1 unhealthy (its gate's /health 503) and gpu2 serves every request;
    GPUUncorrectableECC and GPURowRemapFailed fire for those GPUs, GPUHostFailed and status.py
    say gpu1, the GPUs and why; cleared (a GPU reset clears the volatile count), the alerts
    resolve and gpu1 serves through the router again. The client: 0 failed requests."""
    gpu1, gpu2 = fleet["hosts"]["gpu1"], fleet["hosts"]["gpu2"]
    router = fleet["hosts"][ROUTER_HOST]
    worker1 = f"http://{fleet['switch']['gpu1']}:8000"
    assert smg_health(router, worker1) == "1"
    faults = {"gpus": {"3": {"volatile_ecc_errors": 2}, "5": {"remapped_rows_failure": "Yes"}}}
    start_client(fleet)
    try:
        try:
            gpu1.ssh("mkdir -p /run/gpuhost-sandbox && cat > /run/gpuhost-sandbox/gpu-faults.json"
                     f" <<'EOF'\n{json.dumps(faults)}\nEOF")
            started = time.monotonic()
            wait_for("smg marks gpu1 unhealthy", lambda: smg_health(router, worker1) == "0",
                     timeout=120, pause=1)
            out_at = time.time()
            print(f"gpu1 out of the router {time.monotonic() - started:.0f} s after the fault")
            reason = gpu1.ssh("cat /run/gpuhost-gpu-health/failed")
            assert reason.startswith("failed: 2 uncorrectable ECC error(s) on GPU 3"), reason
            ecc = wait_for("GPUUncorrectableECC firing",
                           lambda: firing(fleet, "GPUUncorrectableECC"), timeout=180)
            assert [(a["labels"]["host"], a["labels"]["gpu"]) for a in ecc] == [("gpu1", "3")]
            remap = wait_for("GPURowRemapFailed firing",
                             lambda: firing(fleet, "GPURowRemapFailed"), timeout=60)
            assert [(a["labels"]["host"], a["labels"]["gpu"]) for a in remap] == \
                [("gpu1", "5")]
            out = wait_for("GPUHostFailed firing", lambda: firing(fleet, "GPUHostFailed"), 60)
            assert [a["labels"]["host"] for a in out] == ["gpu1"]
            description = out[0]["annotations"]["description"]
            assert "2 uncorrectable ECC error(s) on GPU 3" in description, description
            assert "a row remapping failed on GPU 5" in description, description
            run = lab.deploy(inventory=fleet["inventory"], deploy_file="status.py")
            assert run.returncode == 0, run.output[-6000:]
            line = next(line for line in run.output.splitlines() if line.startswith("gpu1: "))
            print(line)
            assert "; GPUs FAILED: 2 uncorrectable ECC error(s) on GPU 3 (" in line, line
            assert "a row remapping failed on GPU 5 (" in line, line
            # every request since gpu1 left the router went to gpu2
            assert served(gpu1, out_at + 2) == 0
            assert served(gpu2, out_at + 2) > 0
        finally:
            gpu1.ssh("rm -f /run/gpuhost-sandbox/gpu-faults.json")
        wait_for("the GPU alerts resolved", lambda: not firing(fleet, "GPUUncorrectableECC")
                 and not firing(fleet, "GPURowRemapFailed")
                 and not firing(fleet, "GPUHostFailed"), timeout=180)
        wait_for("smg takes gpu1 back", lambda: smg_health(router, worker1) == "1",
                 timeout=120, pause=1)
        back_at = time.time()
        assert gpu1.ssh("ls /run/gpuhost-gpu-health/").strip() == ""
        wait_for("gpu1 serves through the router again", lambda: served(gpu1, back_at) > 0,
                 timeout=120, pause=2)
    finally:
        result = client_result(fleet)
    assert result["failed"] == 0 and result["ok"] >= 50, result


#: Alerts posted to Alertmanager's own API (api/v2/alerts, a JSON list of postable alerts) on
#: the router host's loopback: argv[1] the JSON, ends in 5 minutes or (argv[2] "end") now.
POST_ALERTS = ("import datetime as d, json, sys, urllib.request as u\n"
               "end = d.datetime.now(d.timezone.utc) + d.timedelta(\n"
               "    minutes=0 if sys.argv[2:] == ['end'] else 5)\n"
               "alerts = [{'labels': a, 'endsAt': end.isoformat()}\n"
               "          for a in json.loads(sys.argv[1])]\n"
               "r = u.Request('http://127.0.0.1:9093/api/v2/alerts',\n"
               "              json.dumps(alerts).encode(), {'Content-Type': 'application/json'})\n"
               "print(u.urlopen(r, timeout=10).status)\n")


def test_a_host_whose_gpus_failed_pages_once_not_again_as_missing_from_the_router(fleet):
    """templates/gpuhost-alertmanager.yml.j2's inhibit rule, in the fleet's real Alertmanager:
    GPUHostFailed and HostMissingFromRouter of one host (the host left the router because its
    GPUs failed) leave HostMissingFromRouter suppressed, inhibited by GPUHostFailed; another
    host's HostMissingFromRouter (no GPU fault) stays active. Hosts gpu8 and gpu9 are names no
    other test uses; the alerts are ended after."""
    router = fleet["hosts"][ROUTER_HOST]
    alerts = [{"alertname": "GPUHostFailed", "host": "gpu9", "severity": "critical"},
              {"alertname": "HostMissingFromRouter", "host": "gpu9", "severity": "critical",
               "worker_url": "http://10.0.0.9:8000"},
              {"alertname": "HostMissingFromRouter", "host": "gpu8", "severity": "critical",
               "worker_url": "http://10.0.0.8:8000"}]
    post = f"cd / && python3 - {shlex.quote(json.dumps(alerts))}"
    assert router.ssh(f"{post} <<'EOF'\n{POST_ALERTS}EOF").strip() == "200"
    try:
        def states():
            status, body = get(router, "http://127.0.0.1:9093/api/v2/alerts")
            assert status == "200", (status, body)
            return {(a["labels"]["alertname"], a["labels"]["host"]):
                    (a["status"]["state"], len(a["status"]["inhibitedBy"]))
                    for a in json.loads(body) if a["labels"]["host"] in ("gpu8", "gpu9")}
        seen = wait_for("the three alerts in Alertmanager", lambda: len(states()) == 3 and
                        states(), timeout=30, pause=1)
        assert seen == {("GPUHostFailed", "gpu9"): ("active", 0),
                        ("HostMissingFromRouter", "gpu9"): ("suppressed", 1),
                        ("HostMissingFromRouter", "gpu8"): ("active", 0)}, seen
    finally:
        router.ssh(f"{post} end <<'EOF'\n{POST_ALERTS}EOF", check=False)
