"""operations/reports/status.py: the lines status.py prints, from Prometheus' answers; the fact's
command is the query script, run here against a stand-in of Prometheus' /api/v1/query."""

from __future__ import annotations

import base64
import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from operations.reports import status

ANSWERS = {
    "up": {"gpu1": 1.0, "gpu2": 0.0},
    "uptime_s": {"gpu1": 7500.0},
    "requests_per_s": {"gpu1": 1.5, "gpu2": 0.0},
    "tokens_per_s": {"gpu1": 225.0, "gpu2": 0.0},
    "running": {"gpu1": 64.0, "gpu2": 0.0},
    "queued": {"gpu1": 3.0},
    "power_w": {"gpu1": 2620.0, "gpu2": 640.0},
    "power_limit_w": {"gpu1": 4800.0, "gpu2": 4800.0},
    "gpus": {"gpu1": 8.0, "gpu2": 8.0},
    "reason_sw_power_cap": {"gpu1": 0.0, "gpu2": 1.0},
    "reason_hw_thermal_slowdown": {"gpu1": 0.0, "gpu2": 0.0},
    "version": {"gpu1": "0.5.9"},
}


def test_host_and_fleet_lines():
    assert status.host_line("gpu1", ANSWERS) == (
        "gpu1: serving; sglang 0.5.9; up 2 h 5 min; 1.50 req/s, 225.0 output tok/s (5 min); "
        "64 running, 3 queued; 8 GPUs at 2620 W of 4800 W (55 %); no throttling")
    assert status.host_line("gpu2", ANSWERS).startswith("gpu2: NOT SERVING; 0.00 req/s")
    assert status.host_line("gpu2", ANSWERS).endswith("held back: sw_power_cap")
    assert status.host_line("r1", ANSWERS) == "r1: no server target"
    assert status.host_line("gpu2", ANSWERS, "last bench T: 1.0 output tok/s").endswith(
        "held back: sw_power_cap; last bench T: 1.0 output tok/s")
    assert status.fleet_line(["gpu1", "gpu2", "r1"], ANSWERS) == (
        "fleet: 1 of 2 server(s) serving; 1.50 req/s, 225.0 output tok/s (5 min); "
        "GPUs at 3260 W of 9600 W (34 %)")


def test_a_cpu_only_router_host_says_what_it_runs():
    """A router host with gpuhost_serving = False has no server target: its line says what it
    runs instead, and whether its router answers Prometheus' scrape (job smg)."""
    from types import SimpleNamespace

    settings = {"r1": SimpleNamespace(alert_webhook_url="http://127.0.0.1:9999/hook"),
                "r2": SimpleNamespace(alert_webhook_url=None),
                "gpu1": SimpleNamespace(alert_webhook_url=None)}
    routers, prometheus = ("r1", "r2"), ("r1",)
    assert status.duties("r1", routers, prometheus, settings) == (
        "the router", "Prometheus", "Alertmanager")
    assert status.duties("r2", routers, prometheus, settings) == ("the router",)
    assert status.duties("gpu1", routers, prometheus, settings) == ()
    answers = {**ANSWERS, "router_up": {"r1": 1.0}}
    assert status.host_line("r1", answers, None, ("the router", "Prometheus")) == (
        "r1: runs the router and Prometheus, no server; router up")
    assert status.host_line("r1", answers, None, ("the router", "Prometheus",
                                                  "Alertmanager")) == (
        "r1: runs the router, Prometheus and Alertmanager, no server; router up")
    assert status.host_line("r1", {"router_up": {"r1": 0.0}}, None, ("the router",)) == (
        "r1: runs the router, no server; ROUTER DOWN")
    assert status.host_line("r2", answers, None, ("the router",)) == (
        "r2: runs the router, no server")
    assert status.host_line("gpu1", answers, None, ()) == status.host_line("gpu1", ANSWERS)
    assert status.fleet_line(["gpu1", "gpu2", "r1"], answers).startswith(
        "fleet: 1 of 2 server(s) serving; ")


def test_a_serving_router_host_says_its_router_too():
    answers = {**ANSWERS, "router_up": {"gpu1": 0.0}}
    assert status.host_line("gpu1", answers, None, ("the router", "Prometheus")) == (
        "gpu1: serving; sglang 0.5.9; up 2 h 5 min; 1.50 req/s, 225.0 output tok/s (5 min); "
        "64 running, 3 queued; ROUTER DOWN; 8 GPUs at 2620 W of 4800 W (55 %); no throttling")


class _Prometheus(BaseHTTPRequestHandler):
    """/api/v1/query as Prometheus answers an instant query (its HTTP API docs); with
    ``password`` set, 401 without that basic auth (its --web.config.file)."""

    password = ""

    def do_GET(self):
        wanted = "Basic " + base64.b64encode(f"prometheus:{self.password}".encode()).decode()
        if self.password and self.headers.get("Authorization") != wanted:
            self.send_response(401)
            self.end_headers()
            return
        query = parse_qs(urlsplit(self.path).query)["query"][0]
        result = [{"metric": {"host": "gpu1"}, "value": [1764000000.0, "1"]}] \
            if "up{" in query else \
            [{"metric": {"host": "gpu1", "sglang": "0.5.9"}, "value": [1764000000.0, "1"]}] \
            if "gpuhost_server_info" in query else \
            [{"metric": {"host": "gpu1", "xid": "79"}, "value": [1764000000.0, "2"]},
             {"metric": {"host": "gpu1", "xid": "13"}, "value": [1764000000.0, "1"]}] \
            if "gpuhost_gpu_xid_errors_total" in query else []
        body = json.dumps({"status": "success",
                           "data": {"resultType": "vector", "result": result}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _results(levels):
    return {"levels": [
        {"concurrency": c, "bench": {"output_throughput": tps, "p99_ttft_ms": ttft},
         "gpus": [{"power_mean_pct": p} for p in power]} for c, tps, ttft, power in levels]}


def test_the_last_bench_is_the_newest_results_best_level(tmp_path):
    assert status.last_bench(tmp_path, "gpu1") is None
    old = tmp_path / "gpu1" / "2026-12-03T11-47-16Z"
    new = tmp_path / "gpu1" / "2026-12-03T12-22-06Z"
    for folder in (old, new, tmp_path / "gpu1" / "2026-12-03T12-30-00Z"):
        folder.mkdir(parents=True)
    (old / "results.json").write_text(json.dumps(_results([(1, 500.0, 1.0, [90])])))
    (new / "results.json").write_text(json.dumps(_results(
        [(1, 10.8, 99.54, [40, 40]), (4, 63.6, 95.7, [44, 46]), (16, 50.0, 300.0, [50])])))
    # the newest folder has no results (a bench that failed): the one before it counts
    assert status.last_bench(tmp_path, "gpu1") == (
        "last bench 2026-12-03T12-22-06Z: 63.6 output tok/s at 4 concurrent, p99 TTFT 96 ms, "
        "power 45 % of limit")
    assert status.last_bench(tmp_path, "gpu2") is None


def test_the_fact_asks_every_query_and_reads_the_answers():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Prometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fact = status.PrometheusAnswers()
        command = fact.command(port=server.server_address[1])
        out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60,
                             check=True)
        answers = fact.process(out.stdout.splitlines())
    finally:
        server.shutdown()
    assert set(answers) == set(status.QUERIES)
    assert answers["up"] == {"gpu1": 1.0} and answers["tokens_per_s"] == {}
    assert answers["version"] == {"gpu1": "0.5.9"}
    assert answers["xids"] == {"gpu1": {"79": 2.0, "13": 1.0}}
    # the GPUs a failure names: each sample's labels
    assert answers["where_xid"] == {"gpu1": [{"host": "gpu1", "xid": "79"},
                                             {"host": "gpu1", "xid": "13"}]}
    assert answers["where_ecc"] == {}


def test_the_fact_sends_the_password_from_its_file(tmp_path):
    class Locked(_Prometheus):
        password = "derived-password"

    server = ThreadingHTTPServer(("127.0.0.1", 0), Locked)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "pw").write_text("derived-password\n")
    try:
        fact = status.PrometheusAnswers()
        port = server.server_address[1]
        asked = fact.command(port=port, user="prometheus", password_file=str(tmp_path / "pw"))
        assert "derived-password" not in asked  # read on the host, never on the command line
        found = fact.process(subprocess.run(["sh", "-c", asked], capture_output=True, text=True,
                                            timeout=60, check=True).stdout.splitlines())
        refused = fact.process(subprocess.run(["sh", "-c", fact.command(port=port)],
                                              capture_output=True, text=True, timeout=60,
                                              check=True).stdout.splitlines())
    finally:
        server.shutdown()
    assert found["up"] == {"gpu1": 1.0}
    assert refused["error"].startswith("Prometheus did not answer up: HTTPError: HTTP Error 401")


def test_no_prometheus_says_so():
    fact = status.PrometheusAnswers()
    out = subprocess.run(["sh", "-c", fact.command(port=1)], capture_output=True, text=True,
                         timeout=60, check=True)
    assert fact.process(out.stdout.splitlines())["error"].startswith(
        "Prometheus did not answer up: URLError")


def test_the_picture_of_the_last_hour(tmp_path):
    start = 1764000000.0
    hour = {"tokens_per_s": {"gpu1": [(start + 60 * i, 200.0 + i) for i in range(60)],
                             "gpu2": [(start + 60 * i, 0.0) for i in range(60)]},
            "running": {"gpu1": [(start, 64.0), (start + 60, 64.0)]},
            "power_pct": {}, "sm_clock_pct": {"gpu1": [(start, 99.6)]}}
    dest = tmp_path / "status-results" / "fleet.png"
    status.plot(hour, dest)
    assert dest.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and dest.stat().st_size > 10000


def test_a_flat_line_reads_against_a_scale_from_zero(tmp_path, monkeypatch):
    """Issue 42: a flat line of 0 tok/s was scaled to -0.04..0.04; its axis now runs from 0 to
    at least 1 (a count or rate) or 100 (a percentage), and 10 % above the highest value."""
    assert status.y_limits([0.0, 0.0], 1.0) == (0.0, 1.0)
    assert status.y_limits([], 100.0) == (0.0, 100.0)
    assert status.y_limits([50.0], 100.0) == (0.0, 100.0)
    assert status.y_limits([200.0, 259.0], 1.0) == (0.0, 259.0 * 1.1)
    assert status.y_limits([-2.0, 3.0], 1.0) == (-2.0, 3.3000000000000003)
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: saved.extend(ax.get_ylim() for ax in fig.axes))
    start = 1764000000.0
    flat = [(start + 60 * i, 0.0) for i in range(60)]
    status.plot({"tokens_per_s": {"gpu1": flat}, "running": {"gpu1": flat},
                 "power_pct": {"gpu1": [(start, 12.0)]}, "sm_clock_pct": {}},
                tmp_path / "fleet.png")
    assert saved == [(0.0, 1.0), (0.0, 1.0), (0.0, 100.0), (0.0, 100.0)]


def test_the_hour_fact_reads_ranges():
    fact = status.PrometheusHour()
    assert " 3600 " in fact.command(port=9090) and "generation_tokens_total" in \
        fact.command(port=9090)
    out = [json.dumps({"tokens_per_s": [{"metric": {"host": "gpu1"},
                                         "values": [[1764000000, "1.5"], [1764000060, "2"]]}]})]
    assert fact.process(out) == {"tokens_per_s": {"gpu1": [(1764000000.0, 1.5),
                                                           (1764000060.0, 2.0)]}}


#: A host's GPU health series as status.py reads them: gpu1 healthy, gpu2 with a GPU fallen off
#: the bus (Xid 79 in the kernel log, 7 of 8 GPUs seen), gpu3 with a link at x8.
HEALTH = {
    "gpu_metrics_ok": {"gpu1": 1.0, "gpu2": 1.0, "gpu3": 1.0},
    "gpus_seen": {"gpu1": 8.0, "gpu2": 7.0, "gpu3": 8.0},
    "gpus_expected": {"gpu1": 8.0, "gpu2": 8.0, "gpu3": 8.0},
    "xids": {"gpu2": {"79": 1.0}},
    # Prometheus' labels of the samples (gpu_health's series; an Xid's GPU by its bus id)
    "where_xid": {"gpu2": [{"host": "gpu2", "xid": "79", "pci_bus_id": "00000000:0A:00.0"}]},
    "link_width": {"gpu1": 16.0, "gpu2": 16.0, "gpu3": 8.0},
    "link_width_max": {"gpu1": 16.0, "gpu2": 16.0, "gpu3": 16.0},
    "fb_used_pct": {"gpu1": 92.0, "gpu2": 0.0, "gpu3": 92.0},
}


def test_each_gpu_host_has_a_verdict():
    answers = {**ANSWERS, **HEALTH, "up": {"gpu1": 1.0, "gpu2": 0.0, "gpu3": 1.0}}
    assert status.host_line("gpu1", answers).endswith("; no throttling; GPUs healthy")
    assert status.host_line("gpu2", answers).endswith(
        "; GPUs FAILED: 7 of 8 GPUs seen by the driver: reboot the host; reseat or replace the "
        "missing GPU; Xid 79 (the GPU fell off the bus) x1 on GPU 00000000:0A:00.0: reboot the "
        "host; reseat or replace the GPU if it recurs")
    assert "; GPUs degraded: a PCIe link at x8 of x16" in status.host_line("gpu3", answers)
    # no GPU series (a CPU-only router host): no verdict
    assert "GPUs" not in status.host_line("r1", answers, None, ("the router",))
    assert status.gpu_verdict("gpu2", answers).state == "failed"
    # an uncorrectable ECC error and a failed row remap, each named by its GPU
    sick = {**answers, "ecc_uncorrected": {"gpu1": 2.0}, "remap_failure": {"gpu1": 1.0},
            "where_ecc": {"gpu1": [{"host": "gpu1", "gpu": "3",
                                    "pci_bus_id": "00000000:0D:00.0"}]},
            "where_remap": {"gpu1": [{"host": "gpu1", "gpu": "5"}]}}
    assert status.host_line("gpu1", sick).endswith(
        "; GPUs FAILED: 2 uncorrectable ECC error(s) on GPU 3 (00000000:0D:00.0): reset the GPU "
        "(nvidia-smi -r); a row remapping failed on GPU 5: replace the GPU")
