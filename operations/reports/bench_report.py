"""The bench's results on the controller: results.json, summary.md and bench.png from the raw
outputs bench.py fetched (operations/files/bench_run.py wrote them on the host).

bench_serving's result fields are sglang 0.5.9's (its wheel's bench_serving.py, the ``result``
dict written to ``--output-file``: ``output_throughput``, ``total_throughput`` and
``request_throughput`` in tokens or requests per second; ``median_ttft_ms``, ``p99_ttft_ms``,
``median_tpot_ms``, ``p99_tpot_ms``, ``median_itl_ms``, ``p99_itl_ms`` in ms,
``max_output_tokens_per_s``, ``accept_length``). Each level's decode throughput at steady state
and the published figure beside it: operations/reports/bench_figures.py. Runs on the controller only
(matplotlib).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Final

from operations.facts import telemetry
from operations.reports import bench_figures, diagnosis
from operations.files import gpu_health

PREFIX_KEY: Final = "gpuhost_"

#: bench_serving's fields kept per level (name in results.json = its name in the tool's JSON).
BENCH_FIELDS: Final = (
    "completed", "duration", "total_input_tokens", "total_output_tokens",
    "output_throughput", "total_throughput", "request_throughput",
    "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
    "median_itl_ms", "p99_itl_ms", "max_concurrency", "max_output_tokens_per_s",
    "accept_length", "backend",
)
#: The server's flags kept from bench_serving's server_info (sglang's /get_server_info).
SERVER_FLAGS: Final = (
    "model_path", "served_model_name", "tp_size", "moe_runner_backend", "attention_backend",
    "quantization", "kv_cache_dtype", "mem_fraction_static", "max_running_requests",
    "cuda_graph_max_bs", "disable_custom_all_reduce", "nsa_decode_backend",
    "nsa_prefill_backend", "fp8_gemm_backend", "context_length", "speculative_algorithm",
    "speculative_num_steps", "speculative_num_draft_tokens", "speculative_eagle_topk",
)


class ReportError(ValueError):
    """Raw outputs that cannot be reported on: says which file and why."""


def _read(raw: Path, name: str) -> str:
    path = raw / name
    if not path.is_file():
        raise ReportError(f"{path} is missing")
    return path.read_text(errors="replace")


def _stamp(text: str) -> datetime:
    return datetime.strptime(text, "%Y/%m/%d %H:%M:%S.%f")


def requests(prompts: int, rc: int, bench: dict[str, Any] | None) -> dict[str, Any]:
    """A level's requests: ``prompts`` sent, ``completed`` (bench_serving's own count: the
    requests that answered without error) and ``failed`` (the rest); both None when
    bench_serving wrote no result (it exited ``rc``)."""
    completed = (bench or {}).get("completed")
    if rc != 0 or not isinstance(completed, int):
        return {"prompts": prompts, "completed": None, "failed": None}
    return {"prompts": prompts, "completed": completed, "failed": max(prompts - completed, 0)}


#: What a stand-in's package metadata says of it (the sandbox's stand-ins end their Summary
#: with "(gpuhost sandbox stand-in)": sandbox/pypi_index.py).
STAND_IN_WORDS: Final = "stand-in"


def stand_ins(summaries: dict[str, str]) -> list[str]:
    """The distributions whose own metadata Summary says they are stand-ins."""
    return sorted(name for name, text in summaries.items() if STAND_IN_WORDS in text.lower())


def stand_in_line(results: dict[str, Any]) -> str | None:
    """The warning that the figures are a stand-in's (None for real packages)."""
    names = results.get("stand_ins") or []
    if not names:
        return None
    says = ("says in its package metadata that it is a stand-in" if len(names) == 1 else
            "say in their package metadata that they are stand-ins")
    return (f"Figures from stand-ins, not a measurement: {', '.join(names)} {says} (the "
            "sandbox's); the server's pace and "
            "the GPUs' figures are the scenario's, so no figure here says anything about real "
            "hardware, and a difference between values is not a finding.")


def failed_words(level: dict[str, Any]) -> str | None:
    """"37 of 128 requests failed" (or bench_serving's exit), None for a level that completed
    every request."""
    r = level.get("requests") or {}
    if level.get("rc", 0) != 0:
        return f"bench_serving exited {level['rc']}: no result"
    if r.get("failed"):
        return f"{r['failed']} of {r['prompts']} requests failed"
    return None


def measured_window(level: dict[str, Any], bench: dict[str, Any] | None
                    ) -> tuple[datetime, datetime]:
    """The level's measured run in the host's clock: it ends at bench_serving's result header
    (meta.json's ``end``) and lasts bench_serving's own ``duration`` (seconds from its main
    run's first request to its last answer: sglang 0.5.9's benchmark() times it with
    perf_counter after the warm-up and the cache flush); without one, from the "Warmup
    completed" line (``start``). Never before ``start``: a slow client start-up (the tokenizer,
    torch) then falls outside the window."""
    start, end = _stamp(level["start"]), _stamp(level["end"])
    duration = (bench or {}).get("duration")
    if isinstance(duration, (int, float)) and 0 < duration:
        start = max(start, end - timedelta(seconds=duration))
    return start, end


def build(raw: Path, host: str, label: str | None = None,
          endpoint: dict[str, Any] | None = None, settings: Any = None) -> dict[str, Any]:
    """Every figure of one run, as results.json holds it: per level bench_serving's figures,
    the field's figures (``decode``: bench_figures.decode, the published figure beside them),
    each GPU's telemetry figures, the level's combined figures and its verdict; the server's
    flags and the versions. ``label`` names the run (a sweep's value); ``endpoint`` what was
    loaded when it was not the host's own server (operations/stages/bench_fleet.py: the fleet's
    router, its URL and workers); ``settings`` the host's, for what the server's own flags do
    not say (bench_figures.served)."""
    meta = json.loads(_read(raw, "meta.json"))
    samples = telemetry.parse_query(_read(raw, "telemetry.csv"))
    dmon = telemetry.parse_dmon(_read(raw, "dmon.csv"))
    links = telemetry.parse_links(_read(raw, "links.csv"))
    levels, server_info = [], {}
    for level in meta["levels"]:
        n = level["concurrency"]
        entry: dict[str, Any] = {"concurrency": n, "start": level["start"], "end": level["end"],
                                 "rc": level["rc"]}
        if level["rc"] == 0 and (raw / f"level-{n}.json").is_file():
            lines = _read(raw, f"level-{n}.json").strip().splitlines()
            result = json.loads(lines[-1])
            entry["bench"] = {k: result.get(k) for k in BENCH_FIELDS}
            server_info = result.get("server_info") or server_info
        entry["requests"] = requests(meta["prompts"], level["rc"], entry.get("bench"))
        entry["complete"] = entry["requests"]["failed"] == 0
        start, end = measured_window(level, entry.get("bench"))
        entry["start"] = start.strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        gpus = telemetry.figures(samples, dmon, links, start, end)
        combined = diagnosis.level_figures(gpus)
        verdict = diagnosis.diagnose(combined)
        entry["gpus"] = [asdict(g) for g in gpus]
        entry["figures"] = asdict(combined)
        entry["verdict"] = asdict(verdict)
        levels.append(entry)
    what = bench_figures.served(meta["versions"], server_info, settings)
    for entry in levels:
        entry["decode"] = bench_figures.decode(entry.get("bench"), entry["concurrency"],
                                               meta["prompts"], what,
                                               server_info.get("max_running_requests"))
    reading = raw / "gpu-health.prom"
    health = asdict(gpu_health.verdict(**{**gpu_health.readings(reading.read_text()),
                                          "serving": 1.0})) if reading.is_file() else None
    return {
        "host": host, "label": label, "started": meta["started"], "ended": meta["ended"],
        "utc_offset_s": meta["utc_offset_s"], "versions": meta["versions"],
        "input_len": meta["input_len"], "output_len": meta["output_len"],
        "prompts": meta["prompts"],
        "server": {k: server_info.get(k) for k in SERVER_FLAGS if k in server_info},
        "stand_ins": stand_ins(meta.get("summaries") or {}),
        "served": asdict(what),
        "levels": levels,
        "endpoint": endpoint or {"kind": "host", "host": host},
        # the host's GPUs at the bench's end (operations/files/gpu_health.py), None unread
        "gpu_health": health,
    }


def fmt(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _endpoint_lines(results: dict[str, Any]) -> list[str]:
    """The fleet's line (what was loaded, through which router, how many workers), or none."""
    e = results.get("endpoint") or {}
    if e.get("kind") != "router":
        return []
    return [f"Fleet endpoint {e['url']}: the router on {e['router']} (policy {e['policy']}) "
            f"with {len(e['workers'])} workers listed healthy ({', '.join(e['workers'])}), "
            f"bench_serving --backend {e['backend']} from {results['host']}; the GPU figures "
            f"are {results['host']}'s own GPUs only.", ""]


def summary(results: dict[str, Any]) -> str:
    """summary.md: one table per host, as the operator's notes (throughput and latency per
    level), then each level's GPU figures and verdict."""
    server, versions = results["server"], results["versions"]
    warning = stand_in_line(results)
    lines = [f"# Bench of {results['host']} ({results['started']} host time)", "",
             *([f"**{warning}**", ""] if warning else []),
             f"sglang {versions.get('sglang', '?')}, driver {versions.get('driver', '?')}, "
             f"{versions.get('gpu_count', '?')} x {versions.get('gpu', '?')}; MoE runner backend "
             f"{server.get('moe_runner_backend')}, TP {server.get('tp_size')}; "
             f"{results['input_len']} input / {results['output_len']} output tokens, "
             f"{results['prompts']} prompts per level", "",
             *_endpoint_lines(results),
             "| concurrency | requests completed | output tok/s | decode tok/s (steady state) | "
             "published tok/s (ours / theirs) | total tok/s | req/s | "
             "TTFT median / p99 ms | TPOT median / p99 ms | ITL median / p99 ms | "
             "power % of limit (mean / peak) | SM clock % of max | GPU util % | "
             "memory-copy util % | PCIe % of capacity (peak) | throttle reasons |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for level in results["levels"]:
        b = level.get("bench") or {}
        gpus = level["gpus"]
        peak = max((g["power_peak_pct"] for g in gpus if g["power_peak_pct"] is not None),
                   default=None)
        f = level["figures"]
        reasons = ", ".join(f"{n} {s:.0f} %" for n, s in sorted(f["reasons"].items())) or "none"
        r = level.get("requests") or {}
        done = "-" if r.get("completed") is None else f"{r['completed']} of {r['prompts']}"
        if failed_words(level):
            done = f"**{done} (FAILED: {failed_words(level)})**"
        d = level.get("decode") or {}
        p = d.get("published") or {}
        theirs = "-" if not p else (f"{p['tok_s']:.1f}" + (
            "" if p.get("ratio") is None else f" ({p['ratio']:.2f} x)"))
        lines.append(
            f"| {level['concurrency']} | {done} | {fmt(b.get('output_throughput'))} | "
            f"{fmt(d.get('tok_s'))} | {theirs} | "
            f"{fmt(b.get('total_throughput'))} | {fmt(b.get('request_throughput'), 2)} | "
            f"{fmt(b.get('median_ttft_ms'))} / {fmt(b.get('p99_ttft_ms'))} | "
            f"{fmt(b.get('median_tpot_ms'))} / {fmt(b.get('p99_tpot_ms'))} | "
            f"{fmt(b.get('median_itl_ms'))} / {fmt(b.get('p99_itl_ms'))} | "
            f"{fmt(f['power_pct'], 0)} / {fmt(peak, 0)} | {fmt(f['sm_clock_pct'], 0)} | "
            f"{fmt(f['util_pct'], 0)} | {fmt(f.get('util_mem_pct'), 0)} | "
            f"{fmt(f['pcie_peak_pct'], 2)} | {reasons} |")
    lines.append("")
    for level in results["levels"]:
        failed = failed_words(level)
        failed = f" ({failed}: its figures are of the requests that completed)" if failed \
            and level.get("rc", 0) == 0 else f" ({failed})" if failed else ""
        lines.append(f"- concurrency {level['concurrency']}{failed}: "
                     f"{level['verdict']['text']}")
    compared = [line for line in map(bench_figures.published_line, results["levels"]) if line]
    if compared:
        lines += ["", "Beside the published figures for this card, model, tensor parallel size "
                  "and speculative decoding (decode tok/s at steady state, docs/bench.md):", "",
                  *(f"- {line}" for line in compared)]
    health = results.get("gpu_health")
    if health:
        words = "; ".join(health["reasons"])
        lines.extend(["", f"GPU health at the end: {health['state']}"
                      + (f" ({words})" if words else "")])
    return "\n".join(lines) + "\n"


#: The time panels' lines: (series key, label, line style); every GPU's mean.
TIME_LINES: Final = (
    ("power_pct", "power % of limit", "-"),
    ("sm_clock_pct", "SM clock % of max", ":"),
    ("util_gpu_pct", "GPU util % (a kernel running)", "--"),
    ("util_mem_pct", "memory-copy util % (utilization.memory)", "-."),
)
#: Seconds shown before and after each level's measured window in its time panel.
TIME_MARGIN_S: Final = 3.0


def _run_label(results: dict[str, Any]) -> str:
    return results.get("label") or results["server"].get("moe_runner_backend") or "served"


def _concurrency_axis(ax, levels: list[int]) -> None:
    """Concurrency on a log2 scale, ticked and labelled with the levels themselves."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(levels))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(n) for n in levels])
    if len(levels) == 1:
        ax.set_xlim(levels[0] / 2, levels[0] * 2)
    ax.set_xlabel("concurrent requests")


def _per_level(ax, runs, y_of, name: str, second_of=None, labels=("", ""),
               legend: bool = True) -> None:
    """One line per run against concurrency (``y_of(level)``; ``second_of``: a second figure,
    dashed in the same colour; ``labels``: the two lines' legend names for a single run); a
    level that failed requests gets a red cross (in the legend once, only when drawn)."""
    crossed = False
    for results in runs:
        done = [lv for lv in results["levels"] if lv.get("bench") and y_of(lv) is not None]
        if not done:
            continue
        xs = [lv["concurrency"] for lv in done]
        label = _run_label(results) if len(runs) > 1 else labels[0] or None
        line, = ax.plot(xs, [y_of(lv) for lv in done], marker="o", label=label)
        if second_of is not None:
            ax.plot(xs, [second_of(lv) for lv in done], marker="^", linestyle="--",
                    color=line.get_color(), label=labels[1] if len(runs) == 1 else None)
        for lv in done:
            if failed_words(lv):
                ax.plot([lv["concurrency"]], [y_of(lv)], marker="X", markersize=12,
                        color="red", linestyle="none",
                        label=None if crossed else "level with failed requests")
                crossed = True
    ax.set_title(name, fontsize=10)
    ax.margins(x=0.1, y=0.1)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _decode_lines(ax, runs) -> None:
    """On the throughput panel: a single run's decode tok/s at steady state (green squares,
    dotted; a sweep's lines stay its values' output tok/s, which it ranks) and the published
    figures that match a level (black stars, once in the legend, with their source's name;
    one run: ours / theirs written beside each)."""
    done = [lv for lv in runs[0]["levels"] if (lv.get("decode") or {}).get("tok_s")]
    if len(runs) == 1 and done:
        ax.plot([lv["concurrency"] for lv in done], [lv["decode"]["tok_s"] for lv in done],
                marker="s", linestyle=":", color="C2", label="decode (steady state)")
    tables: dict[str, dict[int, dict[str, Any]]] = {}  # a sweep's values may match two
    for results in runs:
        for lv in results["levels"]:
            if (lv.get("decode") or {}).get("published"):
                row = lv["decode"]["published"]
                tables.setdefault(row["where"], {})[lv["concurrency"]] = row
    for i, shown in enumerate(tables.values()):
        xs = sorted(shown)
        source = shown[xs[0]]["source"].split("github.com/")[-1].split("/blob/")[0]
        ax.plot(xs, [shown[x]["tok_s"] for x in xs], marker="*" if i == 0 else "P",
                markersize=11, color="black", linestyle="none",
                label=f"published decode, {source}" + (
                    "" if len(tables) == 1 else f" ({shown[xs[0]]['speculative'] or 'no MTP'})"))
        if len(runs) == 1:  # ours / theirs beside each star
            for x in xs:
                if shown[x].get("ratio") is not None:
                    ax.annotate(f"{shown[x]['ratio']:.2f} x", (x, shown[x]["tok_s"]),
                                xytext=(6, -3), textcoords="offset points", fontsize=8)
    ax.set_autoscaley_on(True)  # _per_level's set_ylim fixed the top before these lines
    ax.relim()
    ax.autoscale_view()
    ax.set_ylim(bottom=0)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _time_cell(ax, samples: list[dict[str, Any]], level: dict[str, Any]) -> list:
    """One level's telemetry: seconds since its measured window began (shaded), the mean of
    the GPUs for each of TIME_LINES; returns the artists drawn, for the legend."""
    start, end = _stamp(level["start"]), _stamp(level["end"])
    length = (end - start).total_seconds()
    by_time: dict[float, list[dict[str, Any]]] = {}
    for sample in samples:
        x = (_stamp(sample["time"]) - start).total_seconds()
        if -TIME_MARGIN_S <= x <= length + TIME_MARGIN_S:
            by_time.setdefault(round(x, 1), []).append(sample)
    drawn = [ax.axvspan(0, length, color="0.85", zorder=0, label="measured window")]
    t = sorted(by_time)
    for (key, name, style), colour in zip(TIME_LINES, ("C3", "C1", "C0", "C2")):
        kept = [(x, v) for x, v in ((x, [s.get(key) for s in by_time[x]
                                         if s.get(key) is not None]) for x in t) if v]
        if kept:
            line, = ax.plot([x for x, _ in kept], [sum(v) / len(v) for _, v in kept],
                            linestyle=style, label=name, color=colour)
            drawn.append(line)
    ax.set_xlim(-TIME_MARGIN_S, length + TIME_MARGIN_S)
    ax.set_ylim(0, 105)
    ax.grid(True, alpha=0.3)
    verdict = level["verdict"]["name"]
    failed = failed_words(level)
    r = level.get("requests") or {}
    done = "" if r.get("completed") is None else f"{r['completed']} of {r['prompts']} done"
    ax.set_title(f"c={level['concurrency']}: {verdict}\n"
                 + (f"FAILED: {failed}" if failed else done),
                 fontsize=9, color="red" if failed else "black")
    return drawn


def plot(runs: list[dict[str, Any]], dest: Path, note: str | None = None) -> None:
    """bench.png: :func:`figure`, saved."""
    import matplotlib.pyplot as plt

    fig = figure(runs, note)
    fig.savefig(dest, dpi=100)
    plt.close(fig)


def figure(runs: list[dict[str, Any]], note: str | None = None):
    """bench.png's figure. Above, against concurrency (the levels as ticks, one line per run:
    a sweep's values): output throughput (one run: and decode at steady state, dotted), the
    published decode figures that match (black stars), TTFT and ITL (median, and p99 dashed);
    a level that failed requests has a red cross and its count. Below, one panel per level (a
    row per run), each on its own time axis so a short level reads as well as a long one:
    power as % of the limit,
    SM clock as % of maximum, GPU utilisation and memory-copy utilisation (each the mean of
    the GPUs), the measured window shaded, the verdict and the requests done in its title.
    Figures from stand-ins say so in the title, as does ``note`` (a sweep's values not drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = max(len(r["levels"]) for r in runs)
    fig = plt.figure(figsize=(max(12, 4 * columns), 4.2 + 2.8 * len(runs)),
                     layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[4.2, 2.8 * len(runs)])
    warning = next((stand_in_line(r) for r in runs if stand_in_line(r)), None)
    first = runs[0]
    title = (f"{first['host']}: bench, {first['prompts']} prompts per level, "
             f"{first['input_len']} input / {first['output_len']} output tokens each"
             if len(runs) == 1 else
             f"{first['host']}: sweep of {', '.join(_run_label(r) for r in runs)}")
    if note:
        title += f"\n{note}"
    if warning:
        title += "\nFIGURES FROM STAND-INS (the sandbox's), NOT A MEASUREMENT"
    top.suptitle(title, color="red" if warning else "black", fontsize=11)
    tput, ttft, itl = top.subplots(1, 3)
    levels = sorted({lv["concurrency"] for r in runs for lv in r["levels"]})

    def bench(name):
        return lambda lv: (lv.get("bench") or {}).get(name)

    single = len(runs) == 1
    _per_level(tput, runs, bench("output_throughput"), "tokens/s" if single else
               "output tokens/s", second_of=bench("total_throughput") if single else None,
               labels=("output", "input + output"))
    _decode_lines(tput, runs)
    _per_level(ttft, runs, bench("median_ttft_ms"), "TTFT ms: median (o), p99 (^, dashed)",
               second_of=bench("p99_ttft_ms"), labels=("median", "p99"), legend=single)
    _per_level(itl, runs, bench("median_itl_ms"), "ITL ms: median (o), p99 (^, dashed)",
               second_of=bench("p99_itl_ms"), labels=("median", "p99"), legend=single)
    for ax in (tput, ttft, itl):
        _concurrency_axis(ax, levels)

    cells = bottom.subplots(len(runs), columns, squeeze=False, sharey=True)
    drawn: list = []
    for row, results in zip(cells, runs):
        for col, ax in enumerate(row):
            if col >= len(results["levels"]):
                ax.set_visible(False)
                continue
            drawn = _time_cell(ax, results.get("series") or [], results["levels"][col]) or drawn
            if results is runs[-1]:
                ax.set_xlabel("s since the level's measured run began", fontsize=8)
        row[0].set_ylabel(f"{_run_label(results)}\n%" if len(runs) > 1 else "%")
    handles = [h for h in drawn if h.get_label() and not h.get_label().startswith("_")]
    gpus = len({s["index"] for r in runs for s in r.get("series") or []})
    bottom.suptitle(f"per level: mean of {gpus} GPU{'s' if gpus != 1 else ''}", fontsize=10)
    if handles:
        bottom.legend(handles, [h.get_label() for h in handles], loc="outside lower center",
                      ncols=len(handles), fontsize=8)
    return fig


def series(raw: Path) -> list[dict[str, Any]]:
    """Each sample's power and SM clock as percentages and its utilisations, for the plot
    (results.json keeps them)."""
    out = []
    for s in telemetry.parse_query(_read(raw, "telemetry.csv")):
        power = None if s.power_w is None or not s.power_limit_w else \
            100 * s.power_w / s.power_limit_w
        clock = None if s.sm_clock_mhz is None or not s.max_sm_clock_mhz else \
            100 * s.sm_clock_mhz / s.max_sm_clock_mhz
        out.append({"time": s.time.strftime("%Y/%m/%d %H:%M:%S.%f")[:-3], "index": s.index,
                    "power_pct": power, "sm_clock_pct": clock, "util_gpu_pct": s.util_gpu_pct,
                    "util_mem_pct": s.util_mem_pct})
    return out


def write(raw: Path, dest: Path, host: str, label: str | None = None,
          endpoint: dict[str, Any] | None = None, settings: Any = None) -> tuple[dict, str]:
    """Write results.json, summary.md and bench.png into ``dest`` from ``raw`` (``settings``:
    the host's, see :func:`build`); returns the results and the summary's text."""
    results = build(raw, host, label, endpoint, settings)
    results["series"] = series(raw)
    text = summary(results)
    (dest / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (dest / "summary.md").write_text(text)
    plot([results], dest / "bench.png")
    return results, text
