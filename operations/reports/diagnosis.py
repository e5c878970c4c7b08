"""What holds a concurrency level back, in the operator's terms, from one table of rules.

Each rule reads the level's figures over every GPU (:func:`level_figures`) and, when its
conditions hold, gives a verdict that names the figures it rests on. The first rule that holds
wins (RULES' order: a throttle explains low clocks before "kernel-bound" could). Thresholds are
this module's constants, documented in docs/bench.md ("Verdicts").

Sources: NVIDIA's nvidia-smi documentation for the clock event reasons (``sw_power_cap``: "the
clocks have been lowered ... to stay under the power limit"; ``hw_thermal_slowdown`` /
``sw_thermal_slowdown``: heat) and ``utilization.gpu`` ("percent of time over the past sample
period during which one or more kernels was executing": a busy GPU is not a busy SM, see
../shared/reference-lab.md) and ``utilization.memory`` ("percent of time over the past sample
period during which global (device) memory was being read or written", nvidia-smi
--help-query-gpu on driver 580, tests/fixtures/h200-device/telemetry/help-query-gpu.txt); the
real H200 under three known loads (../shared/fixtures/h200-bench-run-loads: back-to-back 1 GiB
copies read utilization.memory 100 % at 66 % of the power limit and clocks at maximum); the
real H200 capture (tests/fixtures/h200-device/telemetry): big
GEMMs hold the power cap at ~99 % of the limit and clocks at ~75 %, tiny GEMMs leave the GPU
~20 % busy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from operations.facts.telemetry import GpuFigures

#: Throttle reasons that mean heat (nvidia-smi's clocks_event_reasons).
THERMAL_REASONS: Final = ("hw_thermal_slowdown", "sw_thermal_slowdown")
#: Throttle reasons that mean the power limit.
POWER_REASONS: Final = ("sw_power_cap", "hw_power_brake_slowdown")
#: The umbrella hardware reason: nvidia-smi --help-query-gpu (driver 580, captured in
#: tests/fixtures/h200-device/telemetry/help-query-gpu.txt) says it indicates HW thermal
#: slowdown, HW power brake slowdown, or "Power draw is too high and Fast Trigger protection is
#: reducing the clocks", and "May be also reported during PState or clock change". Alone (neither
#: specific bit seen) it is none of heat or the power brake, so it has its own rule.
HW_SLOWDOWN: Final = "hw_slowdown"
#: A reason counts as seen when active in at least this share of a level's samples (%).
REASON_SHARE_PCT: Final = 10.0
#: GPU utilisation (mean over GPUs, %) below which the GPUs wait on the server.
IDLE_BELOW_PCT: Final = 50.0
#: GPU utilisation (%) from which the GPUs count as busy.
BUSY_FROM_PCT: Final = 80.0
#: Power (mean, % of the enforced limit) below which busy GPUs leave power unused.
POWER_UNUSED_BELOW_PCT: Final = 75.0
#: SM clock (mean, % of maximum) from which the clocks count as at maximum.
CLOCKS_AT_MAX_FROM_PCT: Final = 90.0
#: PCIe throughput (peak, % of the link's capacity per direction) from which PCIe is the limit.
PCIE_BOUND_FROM_PCT: Final = 70.0
#: Memory-copy utilisation (mean over GPUs, %: utilization.memory) from which busy GPUs are held
#: by memory bandwidth (the H200's back-to-back copies: 100 %; its big GEMMs: 21 %; the
#: reference lab's decode in the sandbox's scenario: 15 to 35 %).
MEMORY_BOUND_FROM_PCT: Final = 70.0


@dataclass(frozen=True)
class LevelFigures:
    """One level's figures over every GPU: means are over GPUs, ``reasons`` the highest share
    (%) of samples any GPU had each throttle reason in, ``pcie_peak_pct`` the highest of any
    GPU, ``util_mem_pct`` the memory-copy utilisation (utilization.memory); None where no GPU
    reported the figure."""

    util_pct: float | None
    power_pct: float | None
    sm_clock_pct: float | None
    temperature_peak_c: float | None
    pcie_peak_pct: float | None
    reasons: dict[str, float]
    util_mem_pct: float | None = None


@dataclass(frozen=True)
class Verdict:
    """``name`` is a rule's name; ``text`` the sentence for the operator; ``figures`` the
    figures the verdict rests on (name -> value, rounded as shown)."""

    name: str
    text: str
    figures: dict[str, float | None]


def level_figures(gpus: Sequence[GpuFigures]) -> LevelFigures:
    """Combine the GPUs' figures of one level (telemetry.figures)."""
    def mean(values):
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None

    peaks = [g.pcie_peak_pct for g in gpus if g.pcie_peak_pct is not None]
    temps = [g.temperature_peak_c for g in gpus if g.temperature_peak_c is not None]
    reasons: dict[str, float] = {}
    for g in gpus:
        for name, share in g.reasons.items():
            reasons[name] = max(reasons.get(name, 0.0), share)
    return LevelFigures(
        util_pct=mean(g.util_gpu_mean_pct for g in gpus),
        power_pct=mean(g.power_mean_pct for g in gpus),
        sm_clock_pct=mean(g.sm_clock_mean_pct for g in gpus),
        temperature_peak_c=max(temps) if temps else None,
        pcie_peak_pct=max(peaks) if peaks else None,
        reasons=reasons,
        util_mem_pct=mean(g.util_mem_mean_pct for g in gpus),
    )


def _pct(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f} %"


def _seen(f: LevelFigures, names: Sequence[str]) -> list[str]:
    return [n for n in names if f.reasons.get(n, 0.0) >= REASON_SHARE_PCT]


def _throttles(f: LevelFigures) -> list[str]:
    return _seen(f, (*THERMAL_REASONS, *POWER_REASONS, HW_SLOWDOWN))


def _ge(value: float | None, bound: float) -> bool:
    return value is not None and value >= bound


def _lt(value: float | None, bound: float) -> bool:
    return value is not None and value < bound


def _reason_words(f: LevelFigures, names: list[str]) -> str:
    return ", ".join(f"{n.replace('_', ' ').replace('sw ', 'SW ').replace('hw ', 'HW ')} "
                     f"active in {f.reasons[n]:.0f} % of samples" for n in names)


def _thermal(f: LevelFigures) -> Verdict | None:
    names = _seen(f, THERMAL_REASONS)
    if not names:
        return None
    return Verdict("thermal", f"thermal: {_reason_words(f, names)}, up to "
                   f"{'n/a' if f.temperature_peak_c is None else f'{f.temperature_peak_c:.0f} C'}"
                   f", clocks at {_pct(f.sm_clock_pct)} of maximum: the GPUs slow down for "
                   "heat; check cooling and airflow",
                   {"temperature_peak_c": f.temperature_peak_c, "sm_clock_pct": f.sm_clock_pct,
                    **{n: f.reasons[n] for n in names}})


def _power_capped(f: LevelFigures) -> Verdict | None:
    names = _seen(f, POWER_REASONS)
    if not names:
        return None
    return Verdict("power-capped", f"power-capped: {_reason_words(f, names)}, power at "
                   f"{_pct(f.power_pct)} of the limit, clocks held at {_pct(f.sm_clock_pct)} "
                   "of maximum: the GPUs run at their power limit",
                   {"power_pct": f.power_pct, "sm_clock_pct": f.sm_clock_pct,
                    **{n: f.reasons[n] for n in names}})


def _hw_slowdown(f: LevelFigures) -> Verdict | None:
    names = _seen(f, (HW_SLOWDOWN,))
    if not names:
        return None
    return Verdict("HW slowdown", f"HW slowdown: {_reason_words(f, names)} with no thermal or "
                   f"power-brake reason, clocks at {_pct(f.sm_clock_pct)} of maximum, power at "
                   f"{_pct(f.power_pct)} of the limit: power draw too high for the GPU's fast "
                   "trigger protection, or P-state changes; check the power supply and the "
                   "power limit", {"sm_clock_pct": f.sm_clock_pct, "power_pct": f.power_pct,
                                   HW_SLOWDOWN: f.reasons[HW_SLOWDOWN]})


def _pcie_bound(f: LevelFigures) -> Verdict | None:
    if not _ge(f.pcie_peak_pct, PCIE_BOUND_FROM_PCT):
        return None
    return Verdict("PCIe-bound", f"PCIe-bound: PCIe at {_pct(f.pcie_peak_pct)} of capacity at "
                   f"peak, GPUs busy {_pct(f.util_pct)} of the time: transfers between the GPUs "
                   "(through host memory without P2P) or the host hold them back",
                   {"pcie_peak_pct": f.pcie_peak_pct, "util_pct": f.util_pct})


def _server_bound(f: LevelFigures) -> Verdict | None:
    if not _lt(f.util_pct, IDLE_BELOW_PCT):
        return None
    return Verdict("server-bound", f"server-bound: GPUs busy {_pct(f.util_pct)} of the time, "
                   f"power at {_pct(f.power_pct)} of the limit: GPUs idle most of the time "
                   "(queueing, CPU, or too little concurrency)",
                   {"util_pct": f.util_pct, "power_pct": f.power_pct})


def _memory_bound(f: LevelFigures) -> Verdict | None:
    if not (_ge(f.util_pct, BUSY_FROM_PCT) and _ge(f.util_mem_pct, MEMORY_BOUND_FROM_PCT)
            and not _throttles(f)):
        return None
    return Verdict("memory bandwidth", f"memory bandwidth: GPUs busy {_pct(f.util_pct)} of the "
                   f"time, device memory read or written {_pct(f.util_mem_pct)} of the time, "
                   f"power at {_pct(f.power_pct)} of the limit, clocks at {_pct(f.sm_clock_pct)} "
                   "of maximum, no throttle reason: the kernels wait on memory bandwidth, not on "
                   "compute; larger batches (more concurrency) or a smaller KV cache and weight "
                   "format move fewer bytes per token",
                   {"util_pct": f.util_pct, "util_mem_pct": f.util_mem_pct,
                    "power_pct": f.power_pct, "sm_clock_pct": f.sm_clock_pct})


def _kernel_bound(f: LevelFigures) -> Verdict | None:
    if not (_ge(f.util_pct, BUSY_FROM_PCT) and _lt(f.power_pct, POWER_UNUSED_BELOW_PCT)
            and _ge(f.sm_clock_pct, CLOCKS_AT_MAX_FROM_PCT) and not _throttles(f)):
        return None
    pcie = _pct(f.pcie_peak_pct, 1)
    return Verdict("kernel-bound", f"kernel-bound: GPUs busy {_pct(f.util_pct)} of the time, "
                   f"{_pct(f.power_pct)} of the power limit, clocks at {_pct(f.sm_clock_pct)} "
                   f"of maximum, no throttle reason, PCIe at {pcie} of capacity: small decode "
                   "GEMMs leave the tensor cores underused; try another MoE runner backend",
                   {"util_pct": f.util_pct, "power_pct": f.power_pct,
                    "sm_clock_pct": f.sm_clock_pct, "pcie_peak_pct": f.pcie_peak_pct})


def _no_single_limit(f: LevelFigures) -> Verdict:
    return Verdict("no single limit", f"no single limit: GPUs busy {_pct(f.util_pct)} of the "
                   f"time, power at {_pct(f.power_pct)} of the limit, clocks at "
                   f"{_pct(f.sm_clock_pct)} of maximum, PCIe at {_pct(f.pcie_peak_pct, 1)} "
                   "of capacity", {"util_pct": f.util_pct, "power_pct": f.power_pct,
                                   "sm_clock_pct": f.sm_clock_pct,
                                   "pcie_peak_pct": f.pcie_peak_pct})


#: The rules, in the order they are tried: (name, what it checks, the rule).
RULES: Final[tuple[tuple[str, str, Callable[[LevelFigures], Verdict | None]], ...]] = (
    ("thermal", f"a thermal reason ({', '.join(THERMAL_REASONS)}) active in >= "
     f"{REASON_SHARE_PCT:.0f} % of samples", _thermal),
    ("power-capped", f"a power reason ({', '.join(POWER_REASONS)}) active in >= "
     f"{REASON_SHARE_PCT:.0f} % of samples", _power_capped),
    ("HW slowdown", f"{HW_SLOWDOWN} active in >= {REASON_SHARE_PCT:.0f} % of samples, no "
     "thermal or power reason", _hw_slowdown),
    ("PCIe-bound", f"PCIe peak >= {PCIE_BOUND_FROM_PCT:.0f} % of the link's capacity",
     _pcie_bound),
    ("server-bound", f"GPU utilisation < {IDLE_BELOW_PCT:.0f} %", _server_bound),
    ("memory bandwidth", f"GPU utilisation >= {BUSY_FROM_PCT:.0f} %, memory-copy utilisation "
     f"(utilization.memory) >= {MEMORY_BOUND_FROM_PCT:.0f} %, no throttle reason",
     _memory_bound),
    ("kernel-bound", f"GPU utilisation >= {BUSY_FROM_PCT:.0f} %, power < "
     f"{POWER_UNUSED_BELOW_PCT:.0f} % of the limit, SM clock >= {CLOCKS_AT_MAX_FROM_PCT:.0f} % "
     "of maximum, no throttle reason", _kernel_bound),
)


def diagnose(figures: LevelFigures) -> Verdict:
    """The first rule of RULES that holds, else "no single limit" with the figures; a level
    with no telemetry at all gets "no telemetry"."""
    if figures.util_pct is None and figures.power_pct is None:
        return Verdict("no telemetry", "no telemetry: nvidia-smi reported no samples for this "
                       "level", {})
    for _name, _what, rule in RULES:
        verdict = rule(figures)
        if verdict is not None:
            return verdict
    return _no_single_limit(figures)
