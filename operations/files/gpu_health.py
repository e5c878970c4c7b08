"""GPU health readings (framebuffer, ECC, remapped rows, the PCIe link and its replays, Xids, the
GPU count) under NVIDIA DCGM exporter's names, and a host's verdict from them.

Runs on the GPU host beside gpu_metrics.py (standard library only) and on the controller
(status.py, the bench's diagnosis), which read the same series back.

Sources:

- The series' names, types and help texts: NVIDIA/dcgm-exporter etc/default-counters.csv
  (DCGM_FI_DEV_FB_FREE/FB_USED in MiB, DCGM_FI_DEV_XID_ERRORS "Value of the last XID error
  encountered.", DCGM_FI_DEV_PCIE_REPLAY_COUNTER, the ECC totals DCGM_FI_DEV_ECC_{SBE,DBE}_
  {VOL,AGG}_TOTAL, the remapped-row counters and DCGM_FI_DEV_ROW_REMAP_FAILURE); the PCIe link
  fields (DCGM_FI_DEV_PCIE_LINK_GEN/WIDTH, DCGM_FI_DEV_PCIE_MAX_LINK_GEN/WIDTH),
  DCGM_FI_DEV_ROW_REMAP_PENDING and DCGM_FI_DEV_COUNT from DCGM's dcgm_fields.h. DCGM has no
  count of Xids by code: that one is ours, ``gpuhost_gpu_xid_errors_total{xid="<code>"}``.
- nvidia-smi's field names: ``nvidia-smi --help-query-gpu`` on driver 580
  (tests/fixtures/h200-device/telemetry/help-query-gpu.txt): memory.used/free, ecc.mode.current,
  ecc.errors.{corrected,uncorrected}.{volatile,aggregate}.total, remapped_rows.{correctable,
  uncorrectable,pending,failure}, pcie.link.gen.gpucurrent ("pcie.link.gen.current" is
  deprecated), pcie.link.gen.max and pcie.link.width.max ("possible with this GPU and system
  configuration"), count. The PCIe replay counter has no query field: ``nvidia-smi -q`` prints
  it per GPU, ``Replays Since Reset : N`` under the ``GPU 00000000:01:00.0`` section (older
  drivers: ``Replays since reset``), as public captures of -q show.
- The kernel log's Xid lines, as NVIDIA's driver prints them (public reports):
  ``NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.`` (open-gpu-kernel-modules#1151),
  ``NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset
  gpu to activate.`` (stas00/ml-engineering, compute/accelerator/nvidia/debug.md), and older
  drivers' ``NVRM: Xid (0000:03:00): 14, Channel 00000001`` (leptonai/gpud's xid parser). The
  kernel's ring buffer holds them since boot (unless it wrapped): ``dmesg`` reads it.
- FATAL_XIDS: the classes issue #44 names from NVIDIA's Xid catalog
  (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, "Resolution Bucket (Immediate
  Action)": a GPU reset or more); their words from NVIDIA's dynamic page retirement and row
  remapping pages (48 a double bit ECC error, 63 a row or page marked for remapping that a reset
  activates, 64 a remapping that failed) and the catalog (74 NVLink, 79 fallen off the bus, 94
  and 95 contained and uncontained ECC errors). NVIDIA's health validation checks
  (docs.nvidia.com/health-validation/reference/checks/xid) call 48 CRITICAL: drain, reset_gpu.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

#: Asked of ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits``, in this order.
HEALTH_FIELDS = (
    "index", "count", "memory.used", "memory.free", "ecc.mode.current",
    "ecc.errors.corrected.volatile.total", "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.corrected.aggregate.total", "ecc.errors.uncorrected.aggregate.total",
    "remapped_rows.correctable", "remapped_rows.uncorrectable", "remapped_rows.pending",
    "remapped_rows.failure", "pcie.link.gen.gpucurrent", "pcie.link.gen.max",
    "pcie.link.width.current", "pcie.link.width.max",
)

#: (DCGM exporter's name, type, help, the HEALTH_FIELDS field) of each GPU's series.
FAMILIES = (
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", "memory.free"),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", "memory.used"),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter",
     "Total number of single-bit volatile ECC errors.", "ecc.errors.corrected.volatile.total"),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter",
     "Total number of double-bit volatile ECC errors.", "ecc.errors.uncorrected.volatile.total"),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "counter",
     "Total number of single-bit persistent ECC errors.", "ecc.errors.corrected.aggregate.total"),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter",
     "Total number of double-bit persistent ECC errors.",
     "ecc.errors.uncorrected.aggregate.total"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
     "Number of remapped rows for correctable errors", "remapped_rows.correctable"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
     "Number of remapped rows for uncorrectable errors", "remapped_rows.uncorrectable"),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Whether remapping of rows is pending",
     "remapped_rows.pending"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed",
     "remapped_rows.failure"),
    ("DCGM_FI_DEV_PCIE_LINK_GEN", "gauge", "PCIe current link generation.",
     "pcie.link.gen.gpucurrent"),
    ("DCGM_FI_DEV_PCIE_MAX_LINK_GEN", "gauge", "PCIe max link generation.", "pcie.link.gen.max"),
    ("DCGM_FI_DEV_PCIE_LINK_WIDTH", "gauge", "PCIe current link width.",
     "pcie.link.width.current"),
    ("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", "gauge", "PCIe max link width.", "pcie.link.width.max"),
)
REPLAYS = ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.")
LAST_XID = ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.")
XID_COUNT = ("gpuhost_gpu_xid_errors_total", "counter",
             "Xid errors of this code in the kernel log since boot.")
COUNT = ("DCGM_FI_DEV_COUNT", "gauge", "Number of Devices on the node.")
EXPECTED = ("gpuhost_gpu_expected_count", "gauge", "GPUs the host data says this host has.")
KERNEL_LOG_OK = ("gpuhost_gpu_kernel_log_ok", "gauge",
                 "1 when the kernel log was read for Xid lines, else 0.")

#: Xid -> (what it is, what to do): the classes that take a host out of service.
FATAL_XIDS = {
    48: ("a double bit ECC error", "reset the GPU; replace it if it comes back"),
    63: ("a memory row marked for remapping", "reset the GPU to activate the remapping"),
    64: ("a memory row remapping that failed", "reset the GPU; replace it if it comes back"),
    74: ("an NVLink error", "reset the GPU; check the NVLink bridge if it comes back"),
    79: ("the GPU fell off the bus", "reboot the host; reseat or replace the GPU if it recurs"),
    94: ("a contained ECC error", "restart the server; reset the GPU if it comes back"),
    95: ("an uncontained ECC error", "reset the GPU; replace it if it comes back"),
}

_MISSING = ("", "-", "N/A", "[N/A]", "[Not Supported]", "Not Supported", "[Unknown Error]")
_YES_NO = {"yes": 1, "no": 0, "true": 1, "false": 0, "1": 1, "0": 0}
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})"
                  r"(?:\.[0-7])?\): (\d+),")
_QGPU = re.compile(r"^GPU ([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s*$")
_REPLAYS = re.compile(r"^\s+Replays [Ss]ince [Rr]eset\s*:\s*(\S+)\s*$")


class HealthError(ValueError):
    """An output that does not parse: says which output and which line."""


def bus_key(bus_id: str) -> str:
    """``0000:2b:00`` from nvidia-smi's ``00000000:2B:00.0`` or the kernel log's
    ``0000:2b:00`` / ``0000:2b:00.0``: domain (4 digits), bus and device, lower case."""
    parts = bus_id.strip().lower().split(".")[0].split(":")
    if len(parts) != 3:
        raise HealthError(f"PCI bus id {bus_id!r}: expected domain:bus:device")
    return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"


def _value(name: str, text: str) -> float | None:
    text = text.strip()
    if text in _MISSING:
        return None
    if name in ("remapped_rows.pending", "remapped_rows.failure"):
        if text.lower() not in _YES_NO:
            raise HealthError(f"{name}: {text!r} is neither Yes nor No")
        return float(_YES_NO[text.lower()])
    if name == "ecc.mode.current":
        return 1.0 if text == "Enabled" else 0.0
    try:
        return float(text)
    except ValueError:
        raise HealthError(f"{name}: {text!r} is not a number") from None


def parse_health(text: str) -> dict[int, dict[str, float | None]]:
    """Each GPU's HEALTH_FIELDS (``ecc.mode.current``: 1 Enabled, else 0; the remapped rows'
    pending and failure: 1 Yes, 0 No), by index; a field the GPU does not support is None."""
    out: dict[int, dict[str, float | None]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(HEALTH_FIELDS):
            raise HealthError(f"health line: {len(cells)} fields, expected "
                              f"{len(HEALTH_FIELDS)}: {line!r}")
        values = {f: _value(f, c) for f, c in zip(HEALTH_FIELDS, cells)}
        index = values.pop("index")
        if index is None:
            raise HealthError(f"health line without an index: {line!r}")
        out[int(index)] = values
    return out


def parse_replays(text: str) -> dict[str, int]:
    """Each GPU's PCIe replays since reset from ``nvidia-smi -q``, by bus_key."""
    out: dict[str, int] = {}
    current = None
    for line in text.splitlines():
        gpu = _QGPU.match(line)
        if gpu:
            current = bus_key(gpu.group(1))
            continue
        replays = _REPLAYS.match(line)
        if replays and current is not None and replays.group(1) not in _MISSING:
            out[current] = int(replays.group(1))
    return out


def parse_xids(text: str) -> list[tuple[str, int]]:
    """Every Xid line of the kernel log, in order: (bus_key, code)."""
    return [(f"{int(m.group(1), 16):04x}:{m.group(2).lower()}:{m.group(3).lower()}",
             int(m.group(4))) for m in map(_XID.search, text.splitlines()) if m]


@dataclass(frozen=True)
class Verdict:
    """A host's GPU health: ``state`` is healthy, degraded or failed; ``reasons`` say why and
    what to do, worst first."""

    state: str
    reasons: tuple[str, ...] = field(default=())

    def words(self) -> str:
        return self.state + (": " + "; ".join(self.reasons) if self.reasons else "")


def verdict(*, xids: Mapping[int, float] | None = None, gpus_seen: float | None = None,
            gpus_expected: float | None = None, ecc_uncorrected: float | None = None,
            remap_failure: float | None = None, remap_pending: float | None = None,
            link_width: float | None = None, link_width_max: float | None = None,
            link_gen: float | None = None, link_gen_max: float | None = None,
            busy: float | None = None, fb_used_pct: float | None = None,
            serving: float | None = None, thermal: float | None = None,
            reading_ok: float | None = None,
            where: Mapping[str, Sequence[str]] | None = None) -> Verdict:
    """The host's verdict from its readings (each the worst over its GPUs; None: not read).
    ``where``: the GPUs of a failure where known (:func:`readings`), by ``xid <code>``,
    ``ecc`` and ``remap``: named in its reason.

    failed: a FATAL_XIDS Xid since boot, fewer GPUs than the host data says, an uncorrectable
    (double bit) volatile ECC error, a failed row remapping, or no reading at all. degraded: a
    row remapping pending (a reset activates it), a link narrower than its maximum, a link
    generation below its maximum while the GPU is busy (NVIDIA: the generation "may be reduced
    when the GPU is not in use"), another Xid, thermal slowdown, the framebuffer above 95 % with
    no server running. healthy otherwise.
    """
    failed: list[str] = []
    degraded: list[str] = []

    def on(key: str) -> str:
        gpus = (where or {}).get(key)
        return f" on {', '.join(gpus)}" if gpus else ""

    if reading_ok == 0:
        failed.append("nvidia-smi gives no reading: see journalctl -u gpuhost-gpu-metrics")
    if gpus_seen is not None and gpus_expected is not None and gpus_seen < gpus_expected:
        failed.append(f"{gpus_seen:.0f} of {gpus_expected:.0f} GPUs seen by the driver: "
                      "reboot the host; reseat or replace the missing GPU")
    for code, count in sorted((xids or {}).items()):
        if not count:
            continue
        if code in FATAL_XIDS:
            what, todo = FATAL_XIDS[code]
            failed.append(f"Xid {code} ({what}) x{count:.0f}{on(f'xid {code}')}: {todo}")
        else:
            degraded.append(f"Xid {code} x{count:.0f} (NVIDIA's Xid catalog says what it is)")
    if ecc_uncorrected:
        failed.append(f"{ecc_uncorrected:.0f} uncorrectable ECC error(s){on('ecc')}: reset the "
                      "GPU (nvidia-smi -r)")
    if remap_failure:
        failed.append(f"a row remapping failed{on('remap')}: replace the GPU")
    if remap_pending:
        degraded.append("a row remapping is pending: reset the GPU to activate it")
    if link_width is not None and link_width_max and link_width < link_width_max:
        degraded.append(f"a PCIe link at x{link_width:.0f} of x{link_width_max:.0f}: reseat "
                        "the GPU or check its riser")
    if link_gen is not None and link_gen_max and link_gen < link_gen_max and busy:
        degraded.append(f"a busy GPU's PCIe link at gen {link_gen:.0f} of {link_gen_max:.0f}")
    if thermal:
        degraded.append("thermal slowdown: check the cooling")
    if fb_used_pct is not None and fb_used_pct > 95 and not serving:
        degraded.append(f"GPU memory {fb_used_pct:.0f} % used with no server running: "
                        "a process outside the server holds it (nvidia-smi lists it)")
    if failed:
        return Verdict("failed", tuple(failed + degraded))
    if degraded:
        return Verdict("degraded", tuple(degraded))
    return Verdict("healthy")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def render(health_text: str, q_text: str, kernel_log: str | None,
           labels: Mapping[int, Mapping[str, str]], expected: int | None) -> list[str]:
    """The exposition lines of the health series. ``labels`` are each GPU's (gpu, UUID, device,
    pci_bus_id, modelName) by index; ``kernel_log`` None where it could not be read."""
    health = parse_health(health_text)
    replays = parse_replays(q_text)
    by_bus = {bus_key(str(lab["pci_bus_id"])): i for i, lab in labels.items()
              if lab.get("pci_bus_id")}
    lines: list[str] = []

    def head(name: str, kind: str, doc: str) -> None:
        lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}"])

    def gpu_labels(index: int, extra: Iterable[tuple[str, str]] = ()) -> str:
        pairs = [*labels.get(index, {"gpu": str(index)}).items(), *extra]
        return ",".join(f'{k}="{_label(str(v))}"' for k, v in pairs)

    for name, kind, doc, source in FAMILIES:
        known = {i: v[source] for i, v in sorted(health.items()) if v[source] is not None}
        if source.startswith("ecc.errors."):  # counted only where the GPU has ECC on
            known = {i: v for i, v in known.items() if health[i]["ecc.mode.current"]}
        if known:
            head(name, kind, doc)
            lines.extend(f"{name}{{{gpu_labels(i)}}} {v:g}" for i, v in known.items())
    counted = {by_bus[b]: n for b, n in replays.items() if b in by_bus}
    if counted:
        head(*REPLAYS)
        lines.extend(f"{REPLAYS[0]}{{{gpu_labels(i)}}} {n}" for i, n in sorted(counted.items()))
    seen = {v["count"] for v in health.values() if v["count"] is not None}
    if health:  # none: nvidia-smi did not answer, the count is not known
        head(*COUNT)
        lines.append(f"{COUNT[0]} {int(max(seen)) if seen else len(health)}")
    if expected is not None:
        head(*EXPECTED)
        lines.append(f"{EXPECTED[0]} {expected}")
    head(*KERNEL_LOG_OK)
    lines.append(f"{KERNEL_LOG_OK[0]} {0 if kernel_log is None else 1}")
    if kernel_log is None:
        return lines
    xids = parse_xids(kernel_log)
    last: dict[str, int] = {}
    counts: dict[tuple[str, int], int] = {}
    for bus, code in xids:
        last[bus] = code
        counts[bus, code] = counts.get((bus, code), 0) + 1

    def xid_labels(bus: str, extra: Iterable[tuple[str, str]] = ()) -> str:
        if bus in by_bus:
            return gpu_labels(by_bus[bus], extra)
        # a GPU the driver no longer lists (fallen off the bus): its bus id alone
        pairs = [("pci_bus_id", f"{int(bus[:4], 16):08X}:{bus[5:7].upper()}:"
                                f"{bus[8:10].upper()}.0"), *extra]
        return ",".join(f'{k}="{_label(v)}"' for k, v in pairs)

    head(*LAST_XID)
    buses = sorted({*by_bus, *last}, key=lambda b: (b not in by_bus, by_bus.get(b, 0), b))
    lines.extend(f"{LAST_XID[0]}{{{xid_labels(b)}}} {last.get(b, 0)}" for b in buses)
    if counts:
        head(*XID_COUNT)
        lines.extend(f"{XID_COUNT[0]}{{{xid_labels(b, [('xid', str(c))])}}} {n}"
                     for (b, c), n in sorted(counts.items()))
    return lines


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_PAIR = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
#: NVML's thermal clock event reason bits (sw_thermal_slowdown 0x20, hw_thermal_slowdown 0x40).
THERMAL_BITS = 0x20 | 0x40


def gpu_name(labels: Mapping[str, str]) -> str:
    """A GPU as a failure's reason names it: by index and PCI bus id from a series' labels, by
    the bus id alone for one the driver no longer lists (an Xid's series)."""
    if "gpu" in labels:
        bus = labels.get("pci_bus_id")
        return f"GPU {labels['gpu']}" + (f" ({bus})" if bus else "")
    return f"GPU {labels.get('pci_bus_id', '?')}"


#: The series whose GPUs a failure's reason names: :func:`verdict`'s ``where`` key -> series
#: (an Xid's key is ``xid <code>``, from its sample's label).
WHERE = {"ecc": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "remap": "DCGM_FI_DEV_ROW_REMAP_FAILURE",
         "xid": XID_COUNT[0]}


def failed_where(samples: Mapping[str, Iterable[Mapping[str, str]]]) -> dict[str, list[str]]:
    """:func:`verdict`'s ``where`` from the labels of the samples that count (a nonzero value)
    of each :data:`WHERE` series, by its key."""
    where: dict[str, list[str]] = {}
    for key, labelled in samples.items():
        for labels in labelled:
            name = f"xid {labels['xid']}" if key == "xid" else key
            where.setdefault(name, []).append(gpu_name(labels))
    return where


def readings(text: str) -> dict[str, object]:
    """:func:`verdict`'s keyword arguments from the GPU metrics script's textfile (the same
    series Prometheus scrapes), each the worst GPU's: for a host's own reading, as the bench
    fetches it."""
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            series.setdefault(m.group(1), []).append(
                (dict(_PAIR.findall(m.group(2) or "")), float(m.group(3))))

    def values(name: str) -> list[float]:
        return [v for _, v in series.get(name, [])]

    def per_gpu(name: str) -> dict[str, float]:
        return {lab.get("gpu", lab.get("pci_bus_id", "")): v for lab, v in series.get(name, [])}

    xids: dict[int, float] = {}
    for lab, v in series.get(XID_COUNT[0], []):
        xids[int(lab["xid"])] = xids.get(int(lab["xid"]), 0) + v
    where = failed_where({key: [lab for lab, v in series.get(name, []) if v]
                          for key, name in WHERE.items()})
    used, free = per_gpu("DCGM_FI_DEV_FB_USED"), per_gpu("DCGM_FI_DEV_FB_FREE")
    fb = [100 * used[g] / (used[g] + free[g]) for g in used if g in free and used[g] + free[g]]
    util = per_gpu("DCGM_FI_DEV_GPU_UTIL")
    busy_gen = [v for g, v in per_gpu("DCGM_FI_DEV_PCIE_LINK_GEN").items() if util.get(g)]
    reasons = values("DCGM_FI_DEV_CLOCKS_EVENT_REASONS")
    return {
        "reading_ok": min(values("gpuhost_gpu_metrics_ok"), default=None),
        "gpus_seen": max(values(COUNT[0]), default=None),
        "gpus_expected": max(values(EXPECTED[0]), default=None),
        "xids": xids,
        "ecc_uncorrected": sum(values("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL")) or None,
        "remap_failure": max(values("DCGM_FI_DEV_ROW_REMAP_FAILURE"), default=None),
        "remap_pending": max(values("DCGM_FI_DEV_ROW_REMAP_PENDING"), default=None),
        "link_width": min(values("DCGM_FI_DEV_PCIE_LINK_WIDTH"), default=None),
        "link_width_max": max(values("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH"), default=None),
        "link_gen": min(busy_gen, default=None),
        "link_gen_max": max(values("DCGM_FI_DEV_PCIE_MAX_LINK_GEN"), default=None),
        "busy": 1.0 if busy_gen else None,
        "fb_used_pct": max(fb, default=None),
        "thermal": 1.0 if any(int(r) & THERMAL_BITS for r in reasons) else None,
        "where": where,
    }


def gpu_faults(text: str) -> Verdict:
    """The verdict of a host's own GPU metrics textfile (:func:`readings`) on its GPUs alone:
    what takes the host out of the router (the worker's gate fails the router's health checks,
    operations/stages/gate.py) and stops a deploy's restart of its server
    (operations/plans/gpu_verdict.py). A reading that failed alone does not count (a driver/library
    mismatch after an upgrade, which the NVIDIA stage's reboot ends, while the server runs on): the
    kernel log's Xids are read without nvidia-smi, so a GPU fallen off the bus still fails the
    host."""
    return verdict(**{**readings(text), "reading_ok": None})
