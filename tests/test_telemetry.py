"""Telemetry parsers and figures on real H200 captures (tests/fixtures/h200-device/telemetry:
idle, large bf16 GEMMs, many tiny GEMMs) and on lines in the same format with missing fields."""

import json
from datetime import datetime

import pytest

from operations.facts import telemetry

DIR = "h200-device/telemetry"


def phases(fixture_text) -> dict[str, tuple[datetime, datetime]]:
    """The workload's phases as naive local times (that machine's clock is UTC)."""
    record = json.loads(fixture_text(f"{DIR}/phases.json"))
    def naive(text):
        return datetime.fromisoformat(text).replace(tzinfo=None)
    return {p["phase"]: (naive(p["start"]), naive(p["end"])) for p in record["phases"]}


@pytest.fixture
def captured(fixture_text):
    samples = telemetry.parse_query(fixture_text(f"{DIR}/query.csv"))
    dmon = telemetry.parse_dmon(fixture_text(f"{DIR}/dmon-DT.csv"))
    links = {0: telemetry.parse_links("0, 5, 16")[0]}
    return samples, dmon, links, phases(fixture_text)


def test_query_fields_are_the_captured_ones(fixture_text):
    command = fixture_text(f"{DIR}/cmdlines.txt").split("--query-gpu=")[-1].split(" ")[0]
    assert tuple(command.split(",")) == telemetry.QUERY_FIELDS


def test_query_real_capture(fixture_text):
    samples = telemetry.parse_query(fixture_text(f"{DIR}/query.csv"))
    assert len(samples) > 90
    first = samples[0]
    assert first.index == 0 and first.power_limit_w == 700.0 and first.max_sm_clock_mhz == 1980
    assert first.reasons == {"gpu_idle"}
    assert any(s.reasons == {"sw_power_cap"} for s in samples)


def test_query_missing_fields_are_none():
    line = ("2026/12/01 17:47:27.830, 0, [N/A], 700.00, [Not Supported], 1980, 3201, 0, 0, 35, "
            "[N/A]" + ", [Not Supported]" * len(telemetry.REASONS))
    (sample,) = telemetry.parse_query(line)
    assert sample.power_w is None and sample.sm_clock_mhz is None and sample.reasons is None
    assert sample.power_limit_w == 700.0


def test_query_bad_line_named_truncated_last_line_skipped():
    good = "2026/12/01 17:47:27.830, 0, 76.15, 700.00, 345, 1980, 3201, 0, 0, 35, 0x1" + \
        ", Not Active" * len(telemetry.REASONS)
    assert len(telemetry.parse_query(f"{good}\n{good[:30]}")) == 1
    with pytest.raises(telemetry.TelemetryError, match="query line 1"):
        telemetry.parse_query(f"{good[:30]}\n{good}")


@pytest.mark.parametrize("name", ["dmon.txt", "dmon-T.txt", "dmon-DT.csv"])
def test_dmon_real_captures(fixture_text, name):
    rows = telemetry.parse_dmon(fixture_text(f"{DIR}/{name}"))
    assert len(rows) > 45
    assert rows[0].index == 0 and rows[0].power_w == 76
    assert max(r.rx_mbps for r in rows) > 200  # the tiny GEMMs' launches cross PCIe
    assert (rows[0].time is None) == (name == "dmon.txt")


def test_dmon_date_and_missing():
    text = ("#Date, Time, gpu, pwr, gtemp, mtemp, sm, mem, enc, dec, jpg, ofa, mclk, pclk, "
            "rxpci, txpci\n 20261201, 17:47:27, 0, 76, 35, -, -, 0, 0, 0, 0, 0, 3201, 345, -, 3\n")
    (row,) = telemetry.parse_dmon(text)
    assert row.time == datetime(2026, 12, 1, 17, 47, 27)
    assert row.sm_pct is None and row.rx_mbps is None and row.tx_mbps == 3


def test_links_real_static(fixture_text):
    header, line, _ = fixture_text(f"{DIR}/static.txt").splitlines()
    cells = dict(zip([h.strip() for h in header.split(",")], [c.strip() for c in line.split(",")]))
    text = f"0, {cells['pcie.link.gen.max']}, {cells['pcie.link.width.max']}"
    assert telemetry.parse_links(text)[0] == pytest.approx(63015, rel=1e-3)
    assert telemetry.parse_links("0, [N/A], 16") == {0: None}


def test_figures_large_gemm_is_power_capped(captured):
    samples, dmon, links, times = captured
    (gpu,) = telemetry.figures(samples, dmon, links, *times["large-gemm"])
    assert gpu.power_mean_pct > 90 and gpu.util_gpu_mean_pct > 95
    assert 70 < gpu.sm_clock_mean_pct < 85
    assert gpu.reasons["sw_power_cap"] > 90


def test_figures_idle_and_tiny_gemms(captured):
    samples, dmon, links, times = captured
    (idle,) = telemetry.figures(samples, dmon, links, *times["idle"])
    (tiny,) = telemetry.figures(samples, dmon, links, *times["tiny-gemm"])
    assert idle.util_gpu_mean_pct < 5 and idle.power_mean_pct < 20
    assert 10 < tiny.util_gpu_mean_pct < 40 and tiny.sm_clock_mean_pct > 95
    assert tiny.reasons.get("sw_power_cap", 0) < 10  # the first sample, as the phase turns
    assert tiny.pcie_peak_pct < 1 and tiny.pcie_peak_mbps > 200
