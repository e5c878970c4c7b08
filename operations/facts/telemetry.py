"""GPU telemetry: nvidia-smi's query and dmon outputs, parsed, and their figures over a window.

Formats are the real tool's, captured on an H200 with driver 580.159.04 while torch ran known
phases (tests/fixtures/h200-device/telemetry/, README there): ``--query-gpu=QUERY_FIELDS
--format=csv,noheader,nounits -lms 500`` and ``dmon -s puct -d 1`` (with ``-o T``, ``-o DT``,
``--format csv``). A field the GPU does not support (``[N/A]``, ``[Not Supported]``, dmon's
``-``) is kept as missing (None), never a crash. Standard library only: the host-side bench
script ships this module too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from statistics import fmean
from typing import Final

#: Throttle reasons, as ``clocks_event_reasons.<name>`` (nvidia-smi --help-query-gpu on driver
#: 580, fixture help-query-gpu.txt); the names summaries and verdicts use.
REASONS: Final = (
    "applications_clocks_setting",
    "gpu_idle",
    "hw_power_brake_slowdown",
    "hw_slowdown",
    "hw_thermal_slowdown",
    "sw_power_cap",
    "sw_thermal_slowdown",
    "sync_boost",
)

#: Fields asked of ``nvidia-smi --query-gpu`` while a bench runs, in this order.
QUERY_FIELDS: Final = (
    "timestamp", "index", "power.draw", "enforced.power.limit", "clocks.sm", "clocks.max.sm",
    "clocks.mem", "utilization.gpu", "utilization.memory", "temperature.gpu",
    "clocks_event_reasons.active", *(f"clocks_event_reasons.{r}" for r in REASONS),
)

#: The link's fields, asked once (``--query-gpu=LINK_FIELDS --format=csv,noheader,nounits``):
#: the generation and width the GPU and the system allow (fixture static.txt).
LINK_FIELDS: Final = ("index", "pcie.link.gen.max", "pcie.link.width.max")

#: PCIe transfer rate (GT/s) and line-code efficiency per generation (PCI-SIG's base
#: specifications: 8b/10b up to gen 2, 128b/130b for gens 3 to 5, FLIT 242/256 from gen 6).
PCIE_GENERATIONS: Final = {1: (2.5, 0.8), 2: (5.0, 0.8), 3: (8.0, 128 / 130),
                           4: (16.0, 128 / 130), 5: (32.0, 128 / 130), 6: (64.0, 242 / 256)}

_MISSING: Final = ("", "-", "N/A", "[N/A]", "[Not Supported]", "Not Supported", "[Unknown Error]")


class TelemetryError(ValueError):
    """An output that does not parse: says which output and which line."""


@dataclass(frozen=True)
class Sample:
    """One line of the query output: one GPU at one time. Units: W, MHz, %, degrees C.

    ``reasons`` holds the names from REASONS that were "Active"; None where the GPU reported
    none of them (every field missing)."""

    time: datetime
    index: int
    power_w: float | None
    power_limit_w: float | None
    sm_clock_mhz: float | None
    max_sm_clock_mhz: float | None
    mem_clock_mhz: float | None
    util_gpu_pct: float | None
    util_mem_pct: float | None
    temperature_c: float | None
    reasons: frozenset[str] | None
    #: ``clocks_event_reasons.active``: NVML's bit mask of every reason (the value DCGM calls
    #: DCGM_FI_DEV_CLOCKS_EVENT_REASONS); None where not asked for or not reported
    reasons_active: int | None = None


@dataclass(frozen=True)
class DmonSample:
    """One line of ``dmon -s puct``: ``rx_mbps``/``tx_mbps`` are PCIe throughput in MB/s;
    ``time`` is None without ``-o T``/``-o DT`` (``-o T`` alone gives no date: today's)."""

    time: datetime | None
    index: int
    power_w: float | None
    sm_pct: float | None
    rx_mbps: float | None
    tx_mbps: float | None


def _number(text: str) -> float | None:
    text = text.strip()
    if text in _MISSING:
        return None
    return float(text.split()[0])  # "76.15 W" when units are kept


def _mask(text: str) -> int | None:
    text = text.strip()
    return None if text in _MISSING else int(text, 16)


def parse_query(text: str, fields: tuple[str, ...] = QUERY_FIELDS) -> list[Sample]:
    """Parse ``--query-gpu=<fields> --format=csv,noheader,nounits`` lines (``-lms`` repeats
    them). ``fields`` must hold at least timestamp and index; times are the host's local time
    (nvidia-smi's "YYYY/MM/DD HH:MM:SS.mmm"). A truncated last line (the sampler stopped
    mid-write) is skipped; any other bad line raises TelemetryError."""
    samples = []
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    for number, line in enumerate(lines, 1):
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(fields):
            if number == len(lines):
                break
            raise TelemetryError(f"query line {number}: {len(cells)} fields, expected "
                                 f"{len(fields)}: {line!r}")
        row = dict(zip(fields, cells))
        try:
            when = datetime.strptime(row["timestamp"], "%Y/%m/%d %H:%M:%S.%f")
            reasons = {r: row.get(f"clocks_event_reasons.{r}", "") for r in REASONS}
            known = {r: v for r, v in reasons.items() if v not in _MISSING}
            samples.append(Sample(
                time=when, index=int(row["index"]),
                power_w=_number(row.get("power.draw", "")),
                power_limit_w=_number(row.get("enforced.power.limit", "")),
                sm_clock_mhz=_number(row.get("clocks.sm", "")),
                max_sm_clock_mhz=_number(row.get("clocks.max.sm", "")),
                mem_clock_mhz=_number(row.get("clocks.mem", "")),
                util_gpu_pct=_number(row.get("utilization.gpu", "")),
                util_mem_pct=_number(row.get("utilization.memory", "")),
                temperature_c=_number(row.get("temperature.gpu", "")),
                reasons=frozenset(r for r, v in known.items() if v == "Active")
                if known else None,
                reasons_active=_mask(row.get("clocks_event_reasons.active", "")),
            ))
        except (ValueError, KeyError) as exc:
            if number == len(lines):
                break
            raise TelemetryError(f"query line {number}: {exc}: {line!r}") from None
    return samples


def parse_dmon(text: str) -> list[DmonSample]:
    """Parse ``nvidia-smi dmon -s puct`` in its plain or ``--format csv`` form, with or without
    ``-o T``/``-o DT``: columns are found by the header line ("# gpu pwr ... rxpci txpci",
    repeated now and then); a line cut short at the end is skipped."""
    columns: list[str] | None = None
    samples = []
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        cells = [c for c in re.split(r"[,\s]+", line.strip().lstrip("#").strip()) if c]
        if line.startswith("#"):
            if "gpu" in (c.lower() for c in cells):
                columns = [c.lower() for c in cells]
            continue
        if columns is None:
            raise TelemetryError(f"dmon line {number}: data before a header: {line!r}")
        if len(cells) != len(columns):
            if number == len(lines):
                break
            raise TelemetryError(f"dmon line {number}: {len(cells)} columns, expected "
                                 f"{len(columns)}: {line!r}")
        row = dict(zip(columns, cells))
        when = None
        if "time" in row:
            day = row.get("date") or datetime.now().strftime("%Y%m%d")
            when = datetime.strptime(f"{day} {row['time']}", "%Y%m%d %H:%M:%S")
        samples.append(DmonSample(
            time=when, index=int(row["gpu"]), power_w=_number(row.get("pwr", "")),
            sm_pct=_number(row.get("sm", "")), rx_mbps=_number(row.get("rxpci", "")),
            tx_mbps=_number(row.get("txpci", ""))))
    return samples


def parse_links(text: str) -> dict[int, float | None]:
    """Each GPU's PCIe capacity per direction in MB/s, from ``--query-gpu=LINK_FIELDS
    --format=csv,noheader,nounits``: lanes x transfer rate x line-code efficiency / 8
    (PCIE_GENERATIONS; gen 5 x16: 63015 MB/s). None where the generation or width is missing
    or unknown."""
    links: dict[int, float | None] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(LINK_FIELDS) or line.startswith("#"):
            continue
        gen, width = _number(cells[1]), _number(cells[2])
        rate = PCIE_GENERATIONS.get(int(gen)) if gen is not None else None
        links[int(cells[0])] = (width * rate[0] * rate[1] / 8 * 1000
                                if rate and width is not None else None)
    return links


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return fmean(known) if known else None


def _peak(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _ratio_pct(part: float | None, whole: float | None) -> float | None:
    return None if part is None or not whole else 100.0 * part / whole


@dataclass(frozen=True)
class GpuFigures:
    """One GPU over a window (a concurrency level). Percentages are of the enforced power
    limit, of the maximum SM clock, of the link's capacity per direction; ``reasons`` maps each
    throttle reason seen to the share of samples (%) it was active in; None = not reported."""

    index: int
    samples: int
    power_mean_pct: float | None
    power_peak_pct: float | None
    power_mean_w: float | None
    power_limit_w: float | None
    sm_clock_mean_pct: float | None
    sm_clock_mean_mhz: float | None
    max_sm_clock_mhz: float | None
    util_gpu_mean_pct: float | None
    util_mem_mean_pct: float | None
    temperature_peak_c: float | None
    reasons: dict[str, float] = field(default_factory=dict)
    pcie_mean_pct: float | None = None
    pcie_peak_pct: float | None = None
    pcie_peak_mbps: float | None = None


def figures(samples: list[Sample], dmon: list[DmonSample], links: dict[int, float | None],
            start: datetime, end: datetime) -> list[GpuFigures]:
    """Every GPU's figures over [start, end] (the samples' clock: the host's local time).
    dmon lines without a time are ignored here."""
    out = []
    window = [s for s in samples if start <= s.time <= end]
    dmon_window = [d for d in dmon if d.time is not None
                   and start - timedelta(seconds=1) < d.time <= end]
    for index in sorted({s.index for s in window}):
        mine = [s for s in window if s.index == index]
        power = [_ratio_pct(s.power_w, s.power_limit_w) for s in mine]
        clock = [_ratio_pct(s.sm_clock_mhz, s.max_sm_clock_mhz) for s in mine]
        reported = [s.reasons for s in mine if s.reasons is not None]
        reasons = {r: 100.0 * sum(r in seen for seen in reported) / len(reported)
                   for r in REASONS if any(r in seen for seen in reported)}
        capacity = links.get(index)
        pcie = [max(d.rx_mbps or 0.0, d.tx_mbps or 0.0) for d in dmon_window
                if d.index == index and (d.rx_mbps is not None or d.tx_mbps is not None)]
        out.append(GpuFigures(
            index=index, samples=len(mine),
            power_mean_pct=_mean(power), power_peak_pct=_peak(power),
            power_mean_w=_mean([s.power_w for s in mine]),
            power_limit_w=_peak([s.power_limit_w for s in mine]),
            sm_clock_mean_pct=_mean(clock),
            sm_clock_mean_mhz=_mean([s.sm_clock_mhz for s in mine]),
            max_sm_clock_mhz=_peak([s.max_sm_clock_mhz for s in mine]),
            util_gpu_mean_pct=_mean([s.util_gpu_pct for s in mine]),
            util_mem_mean_pct=_mean([s.util_mem_pct for s in mine]),
            temperature_peak_c=_peak([s.temperature_c for s in mine]),
            reasons=reasons,
            pcie_mean_pct=_ratio_pct(_mean(pcie), capacity) if pcie else None,
            pcie_peak_pct=_ratio_pct(_peak(pcie), capacity) if pcie else None,
            pcie_peak_mbps=_peak(pcie) if pcie else None,
        ))
    return out
