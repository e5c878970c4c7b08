"""The fleet's state from its Prometheus, as status.py prints it: one line per host and one for
the fleet. Nothing on any host changes: the Prometheus host is asked through its HTTP API on its
loopback (``/api/v1/query``, one instant query per figure), with the host's python3.

Figures, each per host (the ``host`` label every target has, operations/stages/observability.py):
serving (``up`` of the server's target), the server's sglang version (``gpuhost_server_info``, the
deploy's info series in the node exporter's textfile collector, operations/stages/observability.py),
its uptime (the node exporter's
``node_systemd_unit_start_time_seconds`` of sglang.service), requests and output tokens per
second over the last 5 minutes (sglang's ``num_requests_total`` and ``generation_tokens_total``),
the GPUs' power against their limit (DCGM_FI_DEV_POWER_USAGE over DCGM_FI_DEV_POWER_MGMT_LIMIT,
all GPUs of the host together), the clock event reasons seen on any GPU (NVML's bits), and
whether the router answers (``up`` of smg's target, on the Prometheus host), and the GPUs' verdict
(healthy, degraded or failed, with the reasons: operations/files/gpu_health.py ``verdict``) from
the GPU metrics script's health series (the worst GPU of the host for each).
Beside them, from the controller's bench-results/ (bench.py), the host's last bench: its best
level's output tokens per second, p99 time to first token and power against the limit.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from pyinfra.api import FactBase
from typing_extensions import override

from operations.files.gpu_health import WHERE, Verdict, failed_where, verdict

#: NVML's clock event reason bits (nvmlClocksEventReasons; DCGM_FI_DEV_CLOCKS_EVENT_REASONS),
#: gpu_idle (0x1) left out: an idle GPU is not held back.
REASON_BITS: Final = {
    "applications_clocks_setting": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8,
    "sync_boost": 0x10, "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
}

#: name -> PromQL, one value per host.
QUERIES: Final = {
    "up": 'max by (host) (up{job="sglang"})',
    "uptime_s": 'max by (host) (time() - node_systemd_unit_start_time_seconds'
                '{name="sglang.service"} > 0)',
    "requests_per_s": "sum by (host) (rate(sglang:num_requests_total[5m]))",
    "tokens_per_s": "sum by (host) (rate(sglang:generation_tokens_total[5m]))",
    "power_w": "sum by (host) (DCGM_FI_DEV_POWER_USAGE)",
    "power_limit_w": "sum by (host) (DCGM_FI_DEV_POWER_MGMT_LIMIT)",
    "gpus": "count by (host) (DCGM_FI_DEV_POWER_USAGE)",
    "running": "sum by (host) (sglang:num_running_reqs)",
    "queued": "sum by (host) (sglang:num_queue_reqs)",
    **{f"reason_{name}": f"max by (host) (floor(DCGM_FI_DEV_CLOCKS_EVENT_REASONS / {bit}) % 2)"
       for name, bit in REASON_BITS.items()},
    "version": "max by (host, sglang) (gpuhost_server_info)",
    # smg's own metrics, scraped on the Prometheus host's loopback, labelled with that host
    # (operations/stages/observability.py scrape_targets, job "smg")
    "router_up": 'max by (host) (up{job="smg"})',
    # the GPUs' health (operations/files/gpu_health.py), each the host's worst GPU
    "gpu_metrics_ok": "min by (host) (gpuhost_gpu_metrics_ok)",
    "gpus_seen": "max by (host) (DCGM_FI_DEV_COUNT)",
    "gpus_expected": "max by (host) (gpuhost_gpu_expected_count)",
    "xids": "sum by (host, xid) (gpuhost_gpu_xid_errors_total)",
    "ecc_uncorrected": "sum by (host) (DCGM_FI_DEV_ECC_DBE_VOL_TOTAL)",
    "remap_failure": "max by (host) (DCGM_FI_DEV_ROW_REMAP_FAILURE)",
    "remap_pending": "max by (host) (DCGM_FI_DEV_ROW_REMAP_PENDING)",
    "link_width": "min by (host) (DCGM_FI_DEV_PCIE_LINK_WIDTH)",
    "link_width_max": "max by (host) (DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH)",
    "link_gen_busy": "min by (host) (DCGM_FI_DEV_PCIE_LINK_GEN and DCGM_FI_DEV_GPU_UTIL > 0)",
    "link_gen_max": "max by (host) (DCGM_FI_DEV_PCIE_MAX_LINK_GEN)",
    "fb_used_pct": "max by (host) (100 * DCGM_FI_DEV_FB_USED "
                   "/ (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE))",
    # the GPUs a failure's reason names (gpu_health.WHERE): each sample's labels
    **{f"where_{key}": f"{series} > 0" for key, series in WHERE.items()},
}
#: Queries whose answer is a label's value, not the sample's: name -> label.
LABELS: Final = {"version": "sglang"}
#: Queries with one value per host and label: name -> label (``{host: {label value: value}}``).
BY_LABEL: Final = {"xids": "xid"}
#: Queries whose answer is each sample's labels (``{host: [labels, ...]}``).
SAMPLES: Final = tuple(f"where_{key}" for key in WHERE)

_SCRIPT: Final = """
import base64, json, sys, time, urllib.parse, urllib.request
base, window, user, secret, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], {}
now = time.time()
headers = {}
if secret:
    try:
        with open(secret) as f:
            pair = (user + ":" + f.read().strip()).encode()
        headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
    except OSError as exc:
        print(json.dumps({"up": {"error": "the password file: " + str(exc.strerror)}}))
        sys.exit(0)
for arg in sys.argv[5:]:
    name, _, query = arg.partition("=")
    if window:
        url = (base + "/api/v1/query_range?" + urllib.parse.urlencode(
            {"query": query, "start": now - window, "end": now, "step": max(window // 120, 1)}))
    else:
        url = base + "/api/v1/query?query=" + urllib.parse.quote(query)
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=10) as r:
            out[name] = json.load(r)["data"]["result"]
    except Exception as exc:
        out[name] = {"error": type(exc).__name__ + ": " + str(exc)}
print(json.dumps(out))
"""

#: name -> PromQL of the picture's series, one per host, over the last hour.
RANGES: Final = {
    "tokens_per_s": "sum by (host) (rate(sglang:generation_tokens_total[2m]))",
    "running": "sum by (host) (sglang:num_running_reqs)",
    "power_pct": "100 * sum by (host) (DCGM_FI_DEV_POWER_USAGE) "
                 "/ sum by (host) (DCGM_FI_DEV_POWER_MGMT_LIMIT)",
    "sm_clock_pct": "100 * avg by (host) (DCGM_FI_DEV_SM_CLOCK) "
                    "/ avg by (host) (DCGM_FI_DEV_MAX_SM_CLOCK)",
}
#: The picture's window (seconds): the last hour.
WINDOW_S: Final = 3600


class PrometheusAnswers(FactBase):
    """Each of QUERIES answered by the Prometheus on this host's loopback, asked with HTTP basic
    auth as ``user`` with the password in ``password_file`` (read on the host; none without
    one): ``{name: {host: value}}``, or ``{"error": "..."}`` where it does not answer.

    .. code:: python

        {"up": {"gpu1": 1.0, "gpu2": 0.0}, "tokens_per_s": {"gpu1": 221.4}, ...}
    """

    queries: Mapping[str, str] = QUERIES
    window = 0

    @override
    def command(self, port: int, user: str = "", password_file: str = "") -> str:
        args = [f"{name}={query}" for name, query in self.queries.items()]
        return " ".join(shlex.quote(a) for a in
                        ["python3", "-c", _SCRIPT, f"http://127.0.0.1:{port}", str(self.window),
                         user, password_file, *args])

    @override
    def process(self, output: Iterable[str]) -> dict[str, Any]:
        text = "\n".join(output)
        try:
            raw = json.loads(text)
        except ValueError:
            return {"error": f"no answer from Prometheus: {text[:200]}"}
        answers: dict[str, Any] = {}
        for name, result in raw.items():
            if isinstance(result, dict):
                return {"error": f"Prometheus did not answer {name}: {result.get('error')}"}
            if name in LABELS:
                answers[name] = {r["metric"].get("host", "?"): r["metric"].get(LABELS[name])
                                 for r in result}
                continue
            if name in SAMPLES:
                answers[name] = {}
                for r in result:
                    answers[name].setdefault(r["metric"].get("host", "?"), []).append(r["metric"])
                continue
            if name in BY_LABEL:
                answers[name] = {}
                for r in result:
                    answers[name].setdefault(r["metric"].get("host", "?"), {})[
                        r["metric"].get(BY_LABEL[name], "?")] = self._value(r)
                continue
            answers[name] = {r["metric"].get("host", "?"): self._value(r) for r in result}
        return answers

    @staticmethod
    def _value(result: dict) -> Any:
        return float(result["value"][1])


class PrometheusHour(PrometheusAnswers):
    """RANGES over the last hour (WINDOW_S): ``{name: {host: [(unix time, value), ...]}}``.

    .. code:: python

        {"tokens_per_s": {"gpu1": [(1764000000.0, 221.4), ...]}, ...}
    """

    queries = RANGES
    window = WINDOW_S

    @staticmethod
    def _value(result: dict) -> Any:
        return [(float(t), float(v)) for t, v in result["values"]]


def plot(hour: Mapping[str, Mapping[str, list[tuple[float, float]]]], dest: Path) -> None:
    """The last hour per host, in bench.png's style (operations/reports/bench_report.py:
    matplotlib's Agg, one panel per figure, a line per host): output tokens/s, requests running, GPU
    power and SM clock as % of limit and maximum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (key, label, the least top of the y axis): a flat line, zero most of all, keeps an axis
    # from 0 that says what it is (matplotlib's autoscale would spread 0 over -0.04..0.04)
    panels = [("tokens_per_s", "output tokens/s", 1.0), ("running", "requests running", 1.0),
              ("power_pct", "GPU power, % of limit", 100.0),
              ("sm_clock_pct", "SM clock, % of max", 100.0)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 10), sharex=True,
                             constrained_layout=True)
    start = min((p[0] for series in hour.values() for points in series.values()
                 for p in points[:1]), default=0.0)
    for ax, (key, label, least_top) in zip(axes, panels):
        for name, points in sorted(hour.get(key, {}).items()):
            ax.plot([(t - start) / 60 for t, _ in points], [v for _, v in points], label=name)
        ax.set_ylim(*y_limits([v for points in hour.get(key, {}).values() for _, v in points],
                              least_top))
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if hour.get(key):
            ax.legend(loc="upper left", fontsize="small")
    axes[-1].set_xlabel("minutes over the last hour")
    axes[0].set_title("The fleet over the last hour (Prometheus)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dest, dpi=100)
    plt.close(fig)


def y_limits(values: Sequence[float], least_top: float) -> tuple[float, float]:
    """A panel's y axis: from 0 (or the lowest value, where one is below 0) to 10 % above the
    highest value, and at least to ``least_top`` (1 for counts and rates, 100 for a percentage):
    a flat or empty line still reads against a scale that means something."""
    low = min(0.0, *values) if values else 0.0
    high = max(values, default=0.0)
    return low, max(least_top, high * 1.1)


def _duration(seconds: float) -> str:
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min"
    hours = minutes // 60
    return f"{hours} h {minutes % 60} min" if hours < 48 else f"{hours // 24} d {hours % 24} h"


def last_bench(root: Path, name: str) -> str | None:
    """The host's last bench, from the newest ``<root>/<name>/<UTC time>/results.json``
    (operations/reports/bench_report.py's; folders named by UTC time sort by it): its best level by
    output tokens per second, with its concurrency, p99 TTFT and the GPUs' mean power against
    their limit. None where the host has no readable bench."""
    runs = sorted((root / name).glob("*/results.json")) if (root / name).is_dir() else []
    for path in reversed(runs):
        try:
            results = json.loads(path.read_text())
            done = [lv for lv in results["levels"] if lv.get("bench")]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not done:
            continue
        best = max(done, key=lambda lv: lv["bench"].get("output_throughput") or 0.0)
        bench = best["bench"]
        line = (f"last bench {path.parent.name}: {bench.get('output_throughput') or 0:.1f} "
                f"output tok/s at {best['concurrency']} concurrent")
        if bench.get("p99_ttft_ms") is not None:
            line += f", p99 TTFT {bench['p99_ttft_ms']:.0f} ms"
        gpus = [g for g in best.get("gpus") or [] if g.get("power_mean_pct") is not None]
        if gpus:
            mean = sum(g["power_mean_pct"] for g in gpus) / len(gpus)
            line += f", power {mean:.0f} % of limit"
        return line
    return None


def duties(name: str, routers: Collection[str], prometheus: Collection[str],
           settings: Mapping[str, Any]) -> tuple[str, ...]:
    """What host ``name`` runs for the fleet besides a server: the router (smg) on a host of
    the ``gpuhost_router`` group (operations/stages/fleet.py), Prometheus where it runs
    (operations/stages/observability.py ``prometheus_hosts``), and Alertmanager beside it where its
    data names a webhook (``gpuhost_alert_webhook_url``)."""
    runs = ["the router"] if name in routers else []
    if name in prometheus:
        runs.append("Prometheus")
        if getattr(settings.get(name), "alert_webhook_url", None):
            runs.append("Alertmanager")
    return tuple(runs)


def gpu_verdict(name: str, answers: Mapping[str, Mapping[str, Any]]) -> Verdict | None:
    """Host ``name``'s GPU verdict from :class:`PrometheusAnswers`; None where Prometheus holds
    no GPU reading of it (a CPU-only host)."""
    def get(key: str) -> Any:
        return answers.get(key, {}).get(name)

    if get("gpu_metrics_ok") is None:
        return None
    xids = {int(code): n for code, n in (get("xids") or {}).items() if code.isdigit()}
    thermal = get("reason_sw_thermal_slowdown") == 1 or get("reason_hw_thermal_slowdown") == 1
    return verdict(xids=xids, gpus_seen=get("gpus_seen"), gpus_expected=get("gpus_expected"),
                   ecc_uncorrected=get("ecc_uncorrected"), remap_failure=get("remap_failure"),
                   remap_pending=get("remap_pending"), link_width=get("link_width"),
                   link_width_max=get("link_width_max"), link_gen=get("link_gen_busy"),
                   link_gen_max=get("link_gen_max"), busy=get("link_gen_busy") is not None,
                   fb_used_pct=get("fb_used_pct"), serving=get("up"), thermal=thermal,
                   reading_ok=get("gpu_metrics_ok"),
                   where=failed_where({key: get(f"where_{key}") or [] for key in WHERE}))


def host_line(name: str, answers: Mapping[str, Mapping[str, Any]],
              bench: str | None = None, runs: Sequence[str] = ()) -> str:
    """One host's line, from :class:`PrometheusAnswers` (and :func:`last_bench`'s words); a
    host without a server target says what it runs instead (:func:`duties`)."""
    def get(key: str) -> Any:
        return answers.get(key, {}).get(name)

    up = get("up")
    parts = [f"{name}:"]
    if up is None and runs:
        listed = ", ".join(runs[:-1]) + " and " + runs[-1] if len(runs) > 1 else runs[0]
        parts.append(f"runs {listed}, no server")
    elif up is None:
        parts.append("no server target")
    else:
        parts.append("serving" if up == 1 else "NOT SERVING")
        if get("version"):
            parts.append(f"sglang {get('version')}")
        uptime = get("uptime_s")
        if uptime is not None and up == 1:
            parts.append(f"up {_duration(uptime)}")
        rps, tps = get("requests_per_s"), get("tokens_per_s")
        if rps is not None or tps is not None:
            parts.append(f"{rps or 0:.2f} req/s, {tps or 0:.1f} output tok/s (5 min)")
        running, queued = get("running"), get("queued")
        if running is not None:
            parts.append(f"{running:.0f} running, {queued or 0:.0f} queued")
    router = get("router_up")
    if router is not None:
        parts.append("router up" if router == 1 else "ROUTER DOWN")
    power, limit, gpus = get("power_w"), get("power_limit_w"), get("gpus")
    if power is not None and limit:
        parts.append(f"{gpus or 0:.0f} GPUs at {power:.0f} W of {limit:.0f} W "
                     f"({100 * power / limit:.0f} %)")
    held = [r for r in REASON_BITS if get(f"reason_{r}") == 1]
    if power is not None:
        parts.append("held back: " + ", ".join(held) if held else "no throttling")
    health = gpu_verdict(name, answers)
    if health is not None:
        parts.append("GPUs " + (health.words() if health.state != "failed"
                                else "FAILED" + health.words()[len("failed"):]))
    if bench:
        parts.append(bench)
    return " ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if parts[2:] else "")


def fleet_line(hosts: Iterable[str], answers: Mapping[str, Mapping[str, float]]) -> str:
    """The fleet's line: hosts serving out of those with a server, the fleet's throughput."""
    names = list(hosts)
    up = answers.get("up", {})
    with_server = [n for n in names if n in up]
    serving = [n for n in with_server if up[n] == 1]
    rps = sum(answers.get("requests_per_s", {}).get(n, 0.0) for n in names)
    tps = sum(answers.get("tokens_per_s", {}).get(n, 0.0) for n in names)
    power = sum(answers.get("power_w", {}).get(n, 0.0) for n in names)
    limit = sum(answers.get("power_limit_w", {}).get(n, 0.0) for n in names)
    line = (f"fleet: {len(serving)} of {len(with_server)} server(s) serving; {rps:.2f} req/s, "
            f"{tps:.1f} output tok/s (5 min)")
    if limit:
        line += f"; GPUs at {power:.0f} W of {limit:.0f} W ({100 * power / limit:.0f} %)"
    return line
