"""The bench's stand-ins against the real H200 telemetry captures
(tests/fixtures/h200-device/telemetry): the nvidia-smi stand-in's query and dmon formats, their
figures following the sglang stand-in's load, and the bench_serving stand-in's metrics."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from operations.facts import telemetry
from sandbox import nvidia_repo, scenarios

CAPTURE = Path(__file__).resolve().parents[1] / "fixtures" / "h200-device" / "telemetry"
STANDINS = Path(__file__).resolve().parents[2] / "sandbox" / "standins"
FIELDS = ",".join(telemetry.QUERY_FIELDS)


@pytest.fixture
def smi(tmp_path):
    """Run the nvidia-smi stand-in on the 1-GPU H200 scenario with ``active`` generations."""
    script = tmp_path / "nvidia-smi"
    script.write_text(nvidia_repo.render("nvidia-smi", VERSION="580.159.04"))
    (tmp_path / "hardware.json").write_text(scenarios.hardware_json("single-gpu"))
    (tmp_path / "loaded-version").write_text("580.159.04\n")

    def run(*args, active=0, lines=None, load=None):
        """The tool's output; a loop (-lms, dmon) is stopped once it printed ``lines`` lines
        (a deadline in seconds would give fewer lines on a loaded machine)."""
        load = load or {"active": active, "time": time.time()}
        (tmp_path / "load.json").write_text(json.dumps(load))
        env = dict(os.environ, GPUHOST_SANDBOX_HARDWARE=str(tmp_path / "hardware.json"),
                   GPUHOST_SANDBOX_LOADED=str(tmp_path / "loaded-version"),
                   GPUHOST_SANDBOX_LOAD=str(tmp_path / "load.json"))
        argv = [sys.executable, str(script), *args]
        if lines is None:
            return subprocess.run(argv, capture_output=True, text=True, env=env,
                                  timeout=60).stdout
        out = []
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env) as proc:
            stuck = threading.Timer(60, proc.kill)  # a tool that stops printing: EOF
            stuck.start()
            try:
                while len(out) < lines:
                    line = proc.stdout.readline()
                    if not line:
                        break
                    out.append(line)
            finally:
                stuck.cancel()
                proc.kill()
        return "".join(out)

    return run


def test_query_header_is_the_real_one(smi):
    real = (CAPTURE / "query-header.txt").read_text().splitlines()[0]
    assert smi(f"--query-gpu={FIELDS}", "--format=csv").splitlines()[0] == real


def test_query_idle_and_under_load(smi):
    (idle,) = telemetry.parse_query(smi(f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits"))
    assert idle.reasons == {"gpu_idle"} and idle.util_gpu_pct == 0
    (busy,) = telemetry.parse_query(smi(f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                                        active=64))
    default = scenarios.SERVING_DEFAULT["load"]["64"]
    assert busy.reasons == frozenset() and busy.util_gpu_pct == default["utilization_gpu_pct"]
    assert 100 * busy.power_w / busy.power_limit_w == pytest.approx(default["power_pct"])


@pytest.mark.parametrize("ended_s_ago, util", [(0.2, 100), (5.0, 0)])
def test_generations_that_ended_within_the_sample_period_still_count(smi, ended_s_ago, util):
    """NVML's utilisation covers the past sample period (up to 1 s): a sample taken between two
    requests of a level is busy, one taken seconds after the last is idle."""
    ended = time.time() - ended_s_ago
    (sample,) = telemetry.parse_query(smi(
        f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
        load={"active": 0, "time": ended, "busy": 64, "busy_time": ended}))
    busy = scenarios.SERVING_DEFAULT["load"]["64"]["utilization_gpu_pct"]
    assert sample.util_gpu_pct == (busy if util else 0)


def test_query_loop(smi):
    text = smi(f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "200",
               active=1, lines=3)
    assert len(telemetry.parse_query(text)) >= 3


@pytest.mark.parametrize("options, capture", [([], "dmon.txt"), (["-o", "T"], "dmon-T.txt"),
                                              (["-o", "DT", "--format", "csv"], "dmon-DT.csv")])
def test_dmon_formats_are_the_real_ones(smi, options, capture):
    text = smi("dmon", "-s", "puct", "-d", "0.3", *options, active=16, lines=4)
    real = (CAPTURE / capture).read_text().splitlines()
    assert text.splitlines()[:2] == real[:2]
    rows = telemetry.parse_dmon(text)
    assert rows and rows[0].sm_pct == 100 and rows[0].rx_mbps > 0


def test_dmon_refuses_what_was_not_captured(smi):
    assert "not recognized" in smi("dmon", "-s", "pucvmet")


def _bench_serving():
    path = STANDINS / "sglang" / "sglang" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving_standin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_serving_percentiles_are_numpys_linear():
    bench = _bench_serving()
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bench.percentile([float(v) for v in range(101)], 99) == pytest.approx(99.0)
    assert bench.percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_bench_serving_refuses_unknown_flags():
    with pytest.raises(SystemExit) as caught:
        _bench_serving().parser().parse_args(["--no-such-flag"])
    assert caught.value.code == 2


@pytest.mark.parametrize("load, verdict", [
    ({}, "kernel-bound"),  # the scenario default: the reference lab's figures
    ({"power_pct": 98.0, "sm_clock_pct": 73.0, "reasons": ["sw_power_cap"]}, "power-capped"),
    ({"sm_clock_pct": 60.0, "temperature_c": 92.0, "reasons": ["hw_thermal_slowdown"]},
     "thermal"),
    ({"pcie_mbps": 50000.0, "utilization_gpu_pct": 70.0}, "PCIe-bound"),
    ({"utilization_gpu_pct": 20.0, "power_pct": 15.0}, "server-bound"),
])
def test_diagnosis_rules_on_scenario_telemetry(smi, tmp_path, load, verdict):
    """Each rule on what the nvidia-smi stand-in reports for a scenario's serving load."""
    from datetime import datetime, timedelta

    from operations.reports import diagnosis

    hw = json.loads((tmp_path / "hardware.json").read_text())
    for level in hw["serving"]["load"].values():
        level.update(load)
    (tmp_path / "hardware.json").write_text(json.dumps(hw))
    begin = datetime.now() - timedelta(seconds=1)
    samples = telemetry.parse_query(smi(f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                                        "-lms", "200", active=16, lines=4))
    dmon = telemetry.parse_dmon(smi("dmon", "-s", "puct", "-d", "0.2", "-o", "DT", "--format",
                                    "csv", active=16, lines=5))
    links = telemetry.parse_links(smi("--query-gpu=" + ",".join(telemetry.LINK_FIELDS),
                                      "--format=csv,noheader,nounits"))
    gpus = telemetry.figures(samples, dmon, links, begin, datetime.now() + timedelta(seconds=1))
    assert diagnosis.diagnose(diagnosis.level_figures(gpus)).name == verdict


def test_the_standin_server_listens_with_uvicorns_backlog():
    """socketserver's backlog of 5 reset 3 of 16 connections of a bench at concurrency 16 on
    this busy machine ("Connection reset by peer"); the real server, uvicorn, listens with
    2048."""
    root = Path(__file__).resolve().parents[2] / "sandbox/standins/sglang"
    sys.path.insert(0, str(root))
    try:
        from sglang._standin import server
    finally:
        sys.path.remove(str(root))
    assert server.Server.request_queue_size == 2048
    assert issubclass(server.ThreadingHTTPServerV6, server.Server)
