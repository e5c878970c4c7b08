"""GPU metrics for the node exporter's textfile collector, under NVIDIA DCGM exporter's names,
read from nvidia-smi: one reading, written whole (a temporary file renamed over the last one, as
the node exporter's textfile collector asks: it would otherwise read a file half written).

Why nvidia-smi and not DCGM: NVIDIA's DCGM exporter needs DCGM (datacenter-gpu-manager), a
package of NVIDIA's repository that the hosts' driver packages do not bring, and a container or a
Go build of its own; nvidia-smi comes with the driver on every GPU host, and the bench already
parses its output (telemetry.py, shipped beside this script). The names are DCGM exporter's, so
that dashboards and rules made for it read these unchanged:

| DCGM exporter's name | nvidia-smi's reading | unit |
|---|---|---|
| DCGM_FI_DEV_POWER_USAGE | power.draw | W |
| DCGM_FI_DEV_POWER_MGMT_LIMIT | power.limit | W |
| DCGM_FI_DEV_ENFORCED_POWER_LIMIT | enforced.power.limit | W |
| DCGM_FI_DEV_SM_CLOCK | clocks.sm | MHz |
| DCGM_FI_DEV_MEM_CLOCK | clocks.mem | MHz |
| DCGM_FI_DEV_MAX_SM_CLOCK | clocks.max.sm | MHz |
| DCGM_FI_DEV_GPU_UTIL | utilization.gpu | % |
| DCGM_FI_DEV_MEM_COPY_UTIL | utilization.memory | % |
| DCGM_FI_DEV_GPU_TEMP | temperature.gpu | degrees C |
| DCGM_FI_DEV_CLOCKS_EVENT_REASONS | clocks_event_reasons.active | NVML's bit mask |
| DCGM_FI_PROF_PCIE_TX_BYTES | dmon -s t: txpci | bytes/s |
| DCGM_FI_PROF_PCIE_RX_BYTES | dmon -s t: rxpci | bytes/s |

Sources: NVIDIA/dcgm-exporter etc/default-counters.csv (the clocks, temperature, power usage and
utilisation names, their types and help texts) and etc/dcp-metrics-included.csv (the PCIe bytes
as gauges in bytes per second); the field names and meanings of the power limits, the maximum SM
clock and the clock event reasons from NVIDIA/go-dcgm pkg/dcgm/const_fields.go
(DCGM_FI_DEV_CLOCKS_EVENT_REASONS: "Current clock event reasons (bitmask of
DCGM_CLOCKS_EVENT_REASON_*)", NVML's nvmlClocksEventReasons bits: 0x4 sw_power_cap, 0x8
hw_slowdown, 0x20 sw_thermal_slowdown, 0x40 hw_thermal_slowdown, 0x80 hw_power_brake_slowdown).
The labels are DCGM exporter's: gpu (the index), UUID, device (nvidia<index>), pci_bus_id,
modelName. dmon's PCIe figures are MB/s (1 MB = 10^6 bytes: NVML's KB/s over 1000), whole
numbers: the rate is known to 1 MB/s.

A reading that fails (no driver, a driver/library mismatch, a GPU lost) writes
``gpuhost_gpu_metrics_ok 0`` and the kernel log's Xid series alone (and exits 1, the journal says
why): the other GPU series then go stale in Prometheus, and the alert on this gauge says where
to look. The health series (framebuffer, ECC, remapped rows, the PCIe link and replays, Xids,
the GPU count) are gpu_health.py's. After each reading, the host's own verdict on its GPUs
(gpu_health.gpu_faults) is the ``gpuhost_gpu_failed`` series (its reasons in a label) and, with
``--failed-file``, a file that exists while it is failed (the worker's gate reads it:
operations/plans/gpu_verdict.py).

Runs on the GPU host with the system python3 (standard library only, Python 3.10 and newer),
from gpuhost-gpu-metrics.service (a oneshot, started by its timer).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from gpu_health import HEALTH_FIELDS, HealthError, gpu_faults
from gpu_health import render as render_health
from telemetry import QUERY_FIELDS, TelemetryError, parse_dmon, parse_query

#: Each GPU's identity and power management limit, asked beside QUERY_FIELDS (name last: a
#: product name may hold commas).
IDENTITY_FIELDS = ("index", "uuid", "pci.bus_id", "power.limit", "name")

#: (DCGM exporter's name, help text, the Sample attribute it is read from); all gauges.
GAUGES = (
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "sm_clock_mhz"),
    ("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", "mem_clock_mhz"),
    ("DCGM_FI_DEV_MAX_SM_CLOCK", "Maximum supported SM clock for the device (in MHz).",
     "max_sm_clock_mhz"),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temperature_c"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w"),
    ("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "Effective power limit that the driver enforces "
     "(in W).", "power_limit_w"),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "util_gpu_pct"),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "util_mem_pct"),
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "Current clock event reasons (bitmask of "
     "DCGM_CLOCKS_EVENT_REASON_*).", "reasons_active"),
)
PCIE = (
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "The rate of data transmitted over the PCIe bus - including "
     "both protocol headers and data payloads - in bytes per second.", "tx_mbps"),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "The rate of data received over the PCIe bus - including "
     "both protocol headers and data payloads - in bytes per second.", "rx_mbps"),
)
POWER_LIMIT = ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "Current power limit for the device (in W).")
OK = ("gpuhost_gpu_metrics_ok", "1 when nvidia-smi answered the last reading, else 0.")
FAILED = ("gpuhost_gpu_failed", "1 while the host's GPUs failed (gpu_health.gpu_faults: a fatal "
          "Xid, a GPU missing, an uncorrectable ECC error, a failed row remapping), the reasons "
          "in its label; else 0.")


class ReadingError(RuntimeError):
    """nvidia-smi did not answer, or answered something that does not parse."""


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False,
                              env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ReadingError(f"{argv[0]}: {exc}") from None
    if done.returncode != 0:
        said = (done.stdout + done.stderr).strip().splitlines()
        raise ReadingError(f"{' '.join(argv[:2])} exited {done.returncode}: "
                           f"{said[0] if said else 'no output'}")
    return done.stdout


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def parse_identity(text: str) -> dict[int, dict[str, str | float | None]]:
    """Each GPU's labels and power management limit, from ``--query-gpu=IDENTITY_FIELDS
    --format=csv,noheader,nounits``."""
    out: dict[int, dict[str, str | float | None]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",", len(IDENTITY_FIELDS) - 1)]
        if len(cells) != len(IDENTITY_FIELDS):
            raise ReadingError(f"identity line: {len(cells)} fields, expected "
                               f"{len(IDENTITY_FIELDS)}: {line!r}")
        index, uuid, bus_id, limit, name = cells
        try:
            power_limit: float | None = float(limit)
        except ValueError:
            power_limit = None
        out[int(index)] = {"UUID": uuid, "pci_bus_id": bus_id, "modelName": name,
                           "power_limit": power_limit}
    return out


def _label_pairs(index: int, ident: dict) -> dict[str, str]:
    pairs = [("gpu", str(index)), ("UUID", ident.get("UUID")), ("device", f"nvidia{index}"),
             ("pci_bus_id", ident.get("pci_bus_id")), ("modelName", ident.get("modelName"))]
    return {k: str(v) for k, v in pairs if v is not None}


def render(identity_text: str, query_text: str, dmon_text: str, health_text: str | None = None,
           q_text: str = "", kernel_log: str | None = None, expected: int | None = None) -> str:
    """The textfile's content (Prometheus' text format 0.0.4) from the outputs: the identity,
    telemetry and dmon readings, and (where ``health_text`` is given) the health readings of
    gpu_health.py: ``--query-gpu=HEALTH_FIELDS``, ``-q`` and the kernel log (None: unread)."""
    identity = parse_identity(identity_text)
    try:
        samples = {s.index: s for s in parse_query(query_text)}
        pcie = {d.index: d for d in parse_dmon(dmon_text)}
    except TelemetryError as exc:
        raise ReadingError(str(exc)) from None

    def labels(index: int) -> str:
        pairs = _label_pairs(index, identity.get(index, {}))
        return ",".join(f'{k}="{_label(v)}"' for k, v in pairs.items())

    lines: list[str] = []

    def family(name: str, doc: str, values: dict[int, float | int | None]) -> None:
        known = {i: v for i, v in values.items() if v is not None}
        if not known:
            return
        lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} gauge"])
        lines.extend(f"{name}{{{labels(i)}}} {v:g}" if isinstance(v, float)
                     else f"{name}{{{labels(i)}}} {v}" for i, v in sorted(known.items()))

    for name, doc, attr in GAUGES:
        family(name, doc, {i: getattr(s, attr) for i, s in samples.items()})
    limits = {i: ident["power_limit"] for i, ident in identity.items()}
    family(*POWER_LIMIT, limits)  # type: ignore[arg-type]
    for name, doc, attr in PCIE:
        family(name, doc, {i: None if getattr(d, attr) is None else int(getattr(d, attr) * 1e6)
                           for i, d in pcie.items()})
    if health_text is not None:
        try:
            lines.extend(render_health(
                health_text, q_text, kernel_log,
                {i: _label_pairs(i, ident) for i, ident in identity.items()}, expected))
        except HealthError as exc:
            raise ReadingError(str(exc)) from None
    lines.extend([f"# HELP {OK[0]} {OK[1]}", f"# TYPE {OK[0]} gauge", f"{OK[0]} 1"])
    return "\n".join(lines) + "\n"


def kernel_log(dmesg: str = "dmesg") -> str | None:
    """The kernel's ring buffer (``dmesg``, as root: Ubuntu's kernel.dmesg_restrict), or None
    where it cannot be read (the journal says why)."""
    try:
        return _run([dmesg])
    except ReadingError as exc:
        print(f"gpu_metrics: no kernel log, so no Xid series: {exc}", file=sys.stderr)
        return None


def read(nvidia_smi: str = "nvidia-smi", dmesg: str = "dmesg",
         expected: int | None = None) -> str:
    """One reading of every GPU, rendered."""
    fmt = "--format=csv,noheader,nounits"
    identity = _run([nvidia_smi, f"--query-gpu={','.join(IDENTITY_FIELDS)}", fmt])
    query = _run([nvidia_smi, f"--query-gpu={','.join(QUERY_FIELDS)}", fmt])
    dmon = _run([nvidia_smi, "dmon", "-s", "puct", "-c", "1"])
    health = _run([nvidia_smi, f"--query-gpu={','.join(HEALTH_FIELDS)}", fmt])
    return render(identity, query, dmon, health, _run([nvidia_smi, "-q"]), kernel_log(dmesg),
                  expected)


def write_whole(path: str, text: str) -> None:
    """``text`` to ``path``, renamed over it from a temporary file in the same folder."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".gpu_metrics.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def with_verdict(text: str, failed_file: str | None) -> str:
    """``text`` and its :data:`FAILED` series; where ``failed_file`` is given, that file holds
    the verdict's words while the host's GPUs failed and is removed otherwise (the worker's gate
    answers the router's health checks 503 while it exists: operations/stages/gate.py)."""
    faults = gpu_faults(text)
    failed = faults.state == "failed"
    if failed_file:
        if failed:
            write_whole(failed_file, faults.words() + "\n")
        elif os.path.lexists(failed_file):
            os.unlink(failed_file)
    sample = (f'{FAILED[0]}{{reason="{_label("; ".join(faults.reasons))}"}} 1' if failed
              else f"{FAILED[0]} 0")
    return text + f"# HELP {FAILED[0]} {FAILED[1]}\n# TYPE {FAILED[0]} gauge\n{sample}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True,
                        help="the .prom file in the node exporter's textfile directory")
    parser.add_argument("--nvidia-smi", default="nvidia-smi")
    parser.add_argument("--dmesg", default="dmesg")
    parser.add_argument("--expected-gpus", type=int, default=None,
                        help="the GPUs host data says the host has (gpuhost_gpu_count)")
    parser.add_argument("--failed-file", default=None,
                        help="written with the verdict while the host's GPUs failed, else "
                             "removed (the worker's gate reads it)")
    args = parser.parse_args(argv)
    try:
        text = read(args.nvidia_smi, args.dmesg, args.expected_gpus)
    except ReadingError as exc:
        print(f"gpu_metrics: no reading: {exc}", file=sys.stderr)
        # the kernel log's Xids still (a GPU fallen off the bus can stop nvidia-smi answering)
        try:
            xids = render_health("", "", kernel_log(args.dmesg), {}, args.expected_gpus)
        except HealthError:
            xids = []
        write_whole(args.output, with_verdict(
            "".join(line + "\n" for line in xids)
            + f"# HELP {OK[0]} {OK[1]}\n# TYPE {OK[0]} gauge\n{OK[0]} 0\n", args.failed_file))
        return 1
    write_whole(args.output, with_verdict(text, args.failed_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
