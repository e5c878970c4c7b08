"""The fleet bench's planning (operations/stages/bench_fleet.py): which host loads the router's
endpoint and how, which hosts send no load of their own, what is refused; its command line and
its report's words."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from operations.plans.settings import from_host_data
from operations.reports import bench_report
from operations.stages import bench_fleet, fleet
from operations.stages.bench import _run_argv
from tests.test_bench import raw_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operations" / "files"))
import bench_run  # noqa: E402

KEYS = {"gpuhost_api_key_file": "/root/key", "gpuhost_fleet_key_file": "/root/fleet.key"}


def hosts(target_on: dict[str, str] | None = None):
    """gpu1 (the router, gated at 10.0.0.1:8100), gpu2, gpu3: settings and inventory rows."""
    target_on = target_on or {}
    out = {}
    for n in (1, 2, 3):
        data = {**KEYS, "gpuhost_server_host": f"10.0.0.{n}",
                "gpuhost_fleet_address": f"10.0.0.{n}"}
        if n == 1:
            data.update(gpuhost_router_host="10.0.0.1", gpuhost_router_port=8100,
                        gpuhost_router_api_key_file="/root/router.key")
        if f"gpu{n}" in target_on:
            data["gpuhost_bench_target"] = target_on[f"gpu{n}"]
        out[f"gpu{n}"] = from_host_data(f"gpu{n}", data)
    rows = [("gpu1", ["lab", fleet.ROUTER_GROUP]), ("gpu2", ["lab"]), ("gpu3", ["lab"])]
    return out, rows


def test_the_router_host_loads_the_fleet_and_its_workers_send_none():
    s, rows = hosts({"gpu1": "router"})  # on the router host only (its host data, its group)
    the_fleet = fleet.plan(rows, s)
    active = {"gpu1", "gpu2", "gpu3"}
    assert bench_fleet.part(the_fleet, s, "gpu1", active) == ("router", "")
    assert bench_fleet.part(the_fleet, s, "gpu2", active) == ("worker", "gpu1")
    assert bench_fleet.part(the_fleet, s, "gpu3", active) == ("worker", "gpu1")


def test_without_a_fleet_bench_every_host_benches_its_own_server():
    s, rows = hosts()
    the_fleet = fleet.plan(rows, s)
    assert [bench_fleet.part(the_fleet, s, n, set(s)) for n in s] == [None, None, None]


def test_a_fleet_bench_without_its_router_host_in_the_run_is_refused():
    s, rows = hosts({"gpu1": "router", "gpu2": "router", "gpu3": "router"})  # --data
    the_fleet = fleet.plan(rows, s)
    what, why = bench_fleet.part(the_fleet, s, "gpu2", {"gpu2"})  # --limit gpu2
    assert what == "refused"
    assert "gpuhost_bench_target = 'router'" in why and "router hosts: gpu1" in why \
        and "--limit" in why
    # asked on a worker only: the router host benches its own server, so does gpu3
    s, rows = hosts({"gpu2": "router"})
    the_fleet = fleet.plan(rows, s)
    assert bench_fleet.part(the_fleet, s, "gpu2", set(s))[0] == "refused"
    assert bench_fleet.part(the_fleet, s, "gpu1", set(s)) is None


def test_a_fleet_bench_without_a_router_in_the_inventory_ends_the_run():
    s, _ = hosts({"gpu2": "router"})
    inventory = [SimpleNamespace(name=n, groups=["lab"]) for n in s]
    with pytest.raises(SystemExit) as ended:
        bench_fleet.plan(inventory, s)
    assert "no host was touched" in str(ended.value)
    assert "host gpu2: gpuhost_bench_target = 'router' is not allowed: 'host', or 'router' " \
        "with a router in the inventory (the gpuhost_router group is empty)" in str(ended.value)
    assert bench_fleet.plan(inventory, hosts()[0]) is None


def test_the_fleet_is_loaded_at_the_routers_public_endpoint_with_its_key_and_native_backend():
    s, _ = hosts({"gpu1": "router"})
    url, key_file = bench_fleet.endpoint(s["gpu1"])
    assert (url, key_file) == ("http://10.0.0.1:8100", "/root/router.key")
    argv = _run_argv(s["gpu1"], (url, key_file, bench_fleet.BACKEND))
    assert argv[argv.index("--url") + 1] == "http://10.0.0.1:8100"
    assert argv[argv.index("--api-key-file") + 1] == "/root/router.key"  # not the server's
    assert argv[argv.index("--backend") + 1] == "sglang"
    own = _run_argv(s["gpu1"])
    assert "--backend" not in own and own[own.index("--api-key-file") + 1] == "/root/key"
    loopback = from_host_data("gpu1", {"gpuhost_router_port": 8100,
                                       "gpuhost_router_api_key_file": "/root/router.key"})
    # smg itself, its generation paths behind the client key (never open, even there)
    assert bench_fleet.endpoint(loopback) == ("http://127.0.0.1:8100", "/root/router.key")


def test_bench_serving_is_given_the_native_backend():
    args = SimpleNamespace(python="/v/bin/python", url="http://10.0.0.1:8100", tokenizer="/m/x",
                           model="glm-5", input_len=100, output_len=20, prompts=64,
                           backend="sglang")
    cmd = bench_run.bench_command(args, 16, "/out/level-16.json")
    assert cmd[cmd.index("--backend") + 1] == "sglang"
    assert cmd[cmd.index("--base-url") + 1] == "http://10.0.0.1:8100"


def test_the_report_says_it_measured_the_fleet_endpoint_and_its_workers(tmp_path):
    raw = raw_run(tmp_path)
    about = {"kind": "router", "url": "http://10.0.0.1:8100", "router": "gpu1",
             "policy": "cache_aware", "backend": "sglang", "workers": ["gpu1", "gpu2", "gpu3"],
             "worker_urls": ["http://127.0.0.1:30000", "http://10.0.0.2:8000",
                             "http://10.0.0.3:8000"]}
    results, text = bench_report.write(raw, tmp_path, "gpu1", endpoint=about)
    assert json.loads((tmp_path / "results.json").read_text())["endpoint"] == about
    assert "Fleet endpoint http://10.0.0.1:8100: the router on gpu1 (policy cache_aware) with " \
        "3 workers listed healthy (gpu1, gpu2, gpu3)" in text
    assert "the GPU figures are gpu1's own GPUs only" in text
    _, own = bench_report.write(raw, tmp_path, "h200")
    assert "Fleet endpoint" not in own
    assert json.loads((tmp_path / "results.json").read_text())["endpoint"] == {
        "kind": "host", "host": "h200"}


def test_a_router_host_that_serves_no_model_cannot_load_the_fleet():
    """The load comes from the router host's ML venv and model folder: a CPU-only router host
    asking for the fleet bench is refused, and its workers bench as usual."""
    s, rows = hosts({})
    s["router"] = from_host_data("router", {
        "gpuhost_serving": False, "gpuhost_fleet_address": "10.0.0.9",
        "gpuhost_bench_target": "router", "gpuhost_router_api_key_file": "/root/router.key",
        "gpuhost_fleet_key_file": "/root/fleet.key"})
    rows = [(n, ["lab"]) for n, _ in rows] + [("router", ["lab", fleet.ROUTER_GROUP])]
    the_fleet = fleet.plan(rows, s)
    what, why = bench_fleet.part(the_fleet, s, "router", set(s))
    assert what == "refused" and "which serves no model (gpuhost_serving = False)" in why
    assert [bench_fleet.part(the_fleet, s, n, set(s)) for n in ("gpu1", "gpu2")] == [None, None]
