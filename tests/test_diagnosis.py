"""Each diagnosis rule on the real H200 capture's phases and on made-up scenario figures
(the reference lab's decode: busy GPUs at 55 % of the power limit, clocks at maximum)."""

import pytest

from operations.facts import telemetry
from operations.reports import diagnosis
from operations.reports.diagnosis import LevelFigures
from tests.test_telemetry import DIR, phases


def real_phase(fixture_text, name: str) -> LevelFigures:
    samples = telemetry.parse_query(fixture_text(f"{DIR}/query.csv"))
    dmon = telemetry.parse_dmon(fixture_text(f"{DIR}/dmon-DT.csv"))
    links = telemetry.parse_links("0, 5, 16")
    gpus = telemetry.figures(samples, dmon, links, *phases(fixture_text)[name])
    return diagnosis.level_figures(gpus)


def made_up(**overrides) -> LevelFigures:
    """The reference lab at 64 concurrent requests: 100 % busy, 325 W of 600 W, 2422 of 2430
    MHz, no throttle reason, PCIe nearly idle (../shared/reference-lab.md)."""
    base = dict(util_pct=100.0, power_pct=54.6, sm_clock_pct=99.7, temperature_peak_c=62.0,
                pcie_peak_pct=0.1, reasons={})
    return LevelFigures(**{**base, **overrides})


def test_real_large_gemms_power_capped(fixture_text):
    verdict = diagnosis.diagnose(real_phase(fixture_text, "large-gemm"))
    assert verdict.name == "power-capped"
    assert "SW power cap active in" in verdict.text and "clocks held at 7" in verdict.text
    assert verdict.figures["sw_power_cap"] > 90


@pytest.mark.parametrize("phase", ["idle", "tiny-gemm"])
def test_real_idle_and_tiny_gemms_server_bound(fixture_text, phase):
    verdict = diagnosis.diagnose(real_phase(fixture_text, phase))
    assert verdict.name == "server-bound"
    assert verdict.figures["util_pct"] < 40


def test_kernel_bound_reference_lab():
    verdict = diagnosis.diagnose(made_up())
    assert verdict.name == "kernel-bound"
    assert verdict.text.startswith("kernel-bound: GPUs busy 100 % of the time, 55 % of the power "
                                   "limit, clocks at 100 % of maximum, no throttle reason, PCIe "
                                   "at 0.1 % of capacity")
    assert "MoE runner backend" in verdict.text


def test_power_capped_made_up():
    verdict = diagnosis.diagnose(made_up(power_pct=98.0, sm_clock_pct=73.0,
                                         reasons={"sw_power_cap": 80.0}))
    assert verdict.name == "power-capped" and "clocks held at 73 % of maximum" in verdict.text


def test_thermal_before_power():
    verdict = diagnosis.diagnose(made_up(sm_clock_pct=60.0, temperature_peak_c=91.0,
                                         reasons={"sw_thermal_slowdown": 40.0,
                                                  "sw_power_cap": 50.0}))
    assert verdict.name == "thermal" and "up to 91 C" in verdict.text


def test_pcie_bound():
    verdict = diagnosis.diagnose(made_up(pcie_peak_pct=85.0, util_pct=70.0, power_pct=40.0))
    assert verdict.name == "PCIe-bound" and verdict.figures["pcie_peak_pct"] == 85.0


def test_server_bound_made_up():
    verdict = diagnosis.diagnose(made_up(util_pct=12.0, power_pct=20.0))
    assert verdict.name == "server-bound"
    assert "GPUs busy 12 % of the time" in verdict.text


def test_rare_reason_ignored_and_fallback():
    # a reason in 5 % of samples is noise; busy at 90 % power fits no rule
    verdict = diagnosis.diagnose(made_up(power_pct=90.0, reasons={"sw_power_cap": 5.0}))
    assert verdict.name == "no single limit" and "power at 90 %" in verdict.text


def test_no_telemetry():
    verdict = diagnosis.diagnose(made_up(util_pct=None, power_pct=None, sm_clock_pct=None))
    assert verdict.name == "no telemetry"


def test_level_figures_combine_gpus():
    def gpu(index, util, pcie, reasons):
        return telemetry.GpuFigures(index, 10, 50.0, 60.0, 300.0, 600.0, 99.0, 2422.0, 2430.0,
                                    util, 10.0, 60.0, reasons, pcie / 2, pcie, 100.0)
    level = diagnosis.level_figures([gpu(0, 100.0, 0.1, {}), gpu(1, 80.0, 2.0,
                                                             {"sw_power_cap": 30.0})])
    assert level.util_pct == 90.0 and level.pcie_peak_pct == 2.0
    assert level.reasons == {"sw_power_cap": 30.0}


def test_hw_slowdown_alone_is_not_heat():
    """nvidia-smi's hw_slowdown alone (help-query-gpu, driver 580) is the fast trigger or a
    P-state change; with hw_thermal_slowdown it is heat."""
    alone = diagnosis.diagnose(made_up(sm_clock_pct=45.0, reasons={"hw_slowdown": 30.0}))
    assert alone.name == "HW slowdown" and "no thermal or power-brake reason" in alone.text
    assert alone.figures["hw_slowdown"] == 30.0
    hot = diagnosis.diagnose(made_up(sm_clock_pct=45.0, temperature_peak_c=95.0,
                                     reasons={"hw_slowdown": 30.0, "hw_thermal_slowdown": 30.0}))
    assert hot.name == "thermal"
    braked = diagnosis.diagnose(made_up(reasons={"hw_slowdown": 30.0,
                                                 "hw_power_brake_slowdown": 30.0}))
    assert braked.name == "power-capped"


LOADS = "h200-bench-run-loads"


def fixture_loads() -> dict[int, dict]:
    """The real H200 under three known loads, as bench_run.py wrote them (README there), read
    by the product's own report."""
    from pathlib import Path

    from operations.reports import bench_report
    raw = Path(__file__).parent / "fixtures" / LOADS
    return {lv["concurrency"]: lv for lv in bench_report.build(raw, "h200")["levels"]}


def test_real_loads_each_give_their_own_verdict():
    levels = fixture_loads()
    assert levels[1]["verdict"]["name"] == "memory bandwidth"
    assert "memory bandwidth: GPUs busy 95 % of the time, device memory read or written 96 % " \
        "of the time, power at 67 % of the limit, clocks at 100 % of maximum" \
        in levels[1]["verdict"]["text"]
    assert levels[16]["verdict"]["name"] == "server-bound"
    assert levels[64]["verdict"]["name"] == "power-capped"


def test_real_loads_window_starts_with_the_load_not_the_client():
    """load.sh says "Warmup completed" and then torch takes ~5 s to start: the window is
    bench_serving's own duration (12 s) up to its result, so the idle start-up is left out."""
    for level in fixture_loads().values():
        assert level["gpus"][0]["samples"] in range(23, 26)
        assert "gpu_idle" not in level["figures"]["reasons"]


def test_memory_bandwidth_needs_busy_gpus_and_memory_traffic():
    assert diagnosis.diagnose(made_up(util_mem_pct=95.0)).name == "memory bandwidth"
    assert diagnosis.diagnose(made_up(util_mem_pct=35.0)).name == "kernel-bound"
    assert diagnosis.diagnose(made_up(util_pct=30.0, util_mem_pct=95.0)).name == "server-bound"
    assert diagnosis.diagnose(made_up(util_mem_pct=95.0, power_pct=98.0,
                                      reasons={"sw_power_cap": 80.0})).name == "power-capped"
