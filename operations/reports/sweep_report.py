"""A bench.py sweep's report on the controller: the run-to-run spread it measured, each level's
values ranked and the winner beyond that spread, and its summary.md, results.json and bench.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from operations.reports.bench_report import (
    PREFIX_KEY,
    failed_words,
    fmt,
    plot,
    stand_in_line,
    summary,
)


def _output_tok_s(results: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """Each level of a run: concurrency -> the level (only levels bench_serving reported)."""
    return {lv["concurrency"]: lv for lv in (results or {}).get("levels", []) if lv.get("bench")}


def spread(outcomes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run-to-run spread the sweep measured: the value whose levels ran twice back to back
    on the same server (``repeat`` in its outcome), and per level the difference of the two
    runs' output tok/s as % of their mean; None when no value was repeated."""
    for o in outcomes:
        if not o.get("repeat"):
            continue
        first, second = _output_tok_s(o["results"]), _output_tok_s(o["repeat"])
        pct = {}
        for n in sorted(set(first) & set(second)):
            a = first[n]["bench"]["output_throughput"]
            b = second[n]["bench"]["output_throughput"]
            if a is not None and b is not None and a + b > 0:
                pct[n] = 100 * abs(a - b) / ((a + b) / 2)
        return {"value": o["value"], "pct": pct}
    return None


def sweep_verdict(key: str, configured: Any, outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per level: the values ranked (those whose level completed every request, by output
    tok/s), those left out and why, the best, what it is compared with (the configured value,
    else the runner-up), its gain in %, the run-to-run spread, and the winner: the best only
    where its gain exceeds the spread (else None: "within noise"). ``overall``: the value that
    wins most levels, None when no level has a winner."""
    noise = spread(outcomes)
    levels = sorted({n for o in outcomes for n in _output_tok_s(o.get("results"))})
    rows = []
    for n in levels:
        ranked, left_out = {}, {}
        for o in outcomes:
            level = _output_tok_s(o.get("results")).get(n)
            if o["status"] != "ok" and level is None:
                left_out[o["value"]] = "failed (below)"
            elif level is None:
                left_out[o["value"]] = "no result at this level"
            elif not level.get("complete", True) or failed_words(level):
                left_out[o["value"]] = failed_words(level) or "failed"
            else:
                ranked[o["value"]] = level["bench"]["output_throughput"]
        row: dict[str, Any] = {"concurrency": n, "ranked": ranked, "left_out": left_out,
                               "best": None, "against": None, "gain_pct": None,
                               "spread_pct": (noise or {}).get("pct", {}).get(n),
                               "winner": None}
        if ranked:
            best = max(ranked, key=ranked.get)
            others = {v: t for v, t in ranked.items() if v != best}
            against = configured if configured in others else (
                max(others, key=others.get) if others else None)
            gain = (100 * (ranked[best] / others[against] - 1)
                    if against is not None and others[against] else None)
            row.update(best=best, against=against, gain_pct=gain)
            if gain is not None and row["spread_pct"] is not None and gain > row["spread_pct"]:
                row["winner"] = best
        rows.append(row)
    wins = [r["winner"] for r in rows if r["winner"] is not None]
    overall = max(set(wins), key=wins.count) if wins else None
    return {"key": key, "configured": configured, "spread": noise, "levels": rows,
            "overall": overall}


def sweep_summary(host: str, key: str, configured: Any, outcomes: list[dict[str, Any]]) -> str:
    """The sweep's verdict (:func:`sweep_verdict`): a table of output tok/s per value and level
    (a level that failed requests marked), per level the winner and by how much, or "within
    noise", with the spread measured; the host data line to set a winner; each failed value
    with why."""
    verdict = sweep_verdict(key, configured, outcomes)
    warning = next((stand_in_line(o["results"]) for o in outcomes
                    if o.get("results") and stand_in_line(o["results"])), None)
    lines = [f"# Sweep of {key} on {host} (configured: {configured})", "",
             *([f"**{warning}**", ""] if warning else []),
             "| concurrency | " + " | ".join(
                 f"{o['value']}{' (configured)' if o['value'] == configured else ''} output tok/s"
                 for o in outcomes)
             + " | best | run-to-run spread |", "|---|" + "---|" * (len(outcomes) + 2)]
    for row in verdict["levels"]:
        n = row["concurrency"]
        cells = []
        for o in outcomes:
            level = _output_tok_s(o.get("results")).get(n)
            if level is None:
                cells.append("failed")
            elif o["value"] in row["left_out"]:
                cells.append(f"{fmt(level['bench']['output_throughput'])} "
                             f"(FAILED: {row['left_out'][o['value']]})")
            else:
                cells.append(fmt(level["bench"]["output_throughput"]))
        best = row["winner"] or ("within noise" if row["best"] is not None else "-")
        noise = "not measured" if row["spread_pct"] is None else f"{row['spread_pct']:.1f} %"
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {best} | {noise} |")
    lines.append("")
    noise = verdict["spread"]
    if noise is None:
        lines.append("No value was run twice: the run-to-run spread is not measured, so no "
                     "difference is called a win.")
    else:
        lines.append(f"Run-to-run spread: {noise['value']} ran its levels twice back to back; "
                     "a value wins a level only by more than the two runs differ there.")
    for row in verdict["levels"]:
        n = row["concurrency"]
        left = "".join(f"; {v} not ranked ({why})" for v, why in row["left_out"].items())
        if row["best"] is None:
            lines.append(f"- concurrency {n}: no value completed every request{left}")
            continue
        by = (f", {row['gain_pct']:+.1f} % output tok/s over {row['against']}"
              if row["gain_pct"] is not None else "")
        noise_pct = ("spread not measured" if row["spread_pct"] is None
                     else f"run-to-run spread {row['spread_pct']:.1f} %")
        if row["winner"] is not None:
            lines.append(f"- concurrency {n}: {row['winner']} wins{by} ({noise_pct}){left}")
        elif row["against"] is None:
            lines.append(f"- concurrency {n}: only {row['best']} completed every request: "
                         f"nothing to compare{left}")
        else:
            lines.append(f"- concurrency {n}: within noise: {row['best']}{by}, not more than "
                         f"the {noise_pct}: no winner{left}")
    overall = verdict["overall"]
    if overall is not None and overall == configured:
        lines += ["", f"The configured {key} ({configured}) wins: keep it."]
    elif overall is not None:
        lines += ["", f"To serve with {overall}: `--data {PREFIX_KEY}{key}={overall}` or, in the "
                  f"inventory, `\"{PREFIX_KEY}{key}\": {json.dumps(overall)}` "
                  "(the sweep never edits the inventory)."]
    else:
        lines += ["", f"No value of {key} wins beyond the run-to-run spread among those that "
                  f"completed every request: nothing to change ({configured} stays)."]
    for o in outcomes:
        if o["status"] != "ok":
            lines += ["", f"- {o['value']}: failed: {o['reason']}"]
            lines += [f"    {line}" for line in o.get("journal", [])[-10:]]
    return "\n".join(lines) + "\n"


def write_sweep(dest: Path, host: str, key: str, configured: Any,
                outcomes: list[dict[str, Any]]) -> str:
    """results.json (the sweep's outcome with every value's results and the verdict: each
    level's ranking, spread and winner), summary.md and bench.png (a line per value) in
    ``dest``; returns the summary's text."""
    text = sweep_summary(host, key, configured, outcomes)
    runs = [o["results"] for o in outcomes if o.get("results")]
    for o in outcomes:
        if o.get("results"):
            text += "\n" + summary(o["results"])
    (dest / "results.json").write_text(json.dumps(
        {"host": host, "sweep": {"key": key, "configured": configured, "outcomes": outcomes,
                                 "verdict": sweep_verdict(key, configured, outcomes)}},
        indent=1, default=str) + "\n")
    (dest / "summary.md").write_text(text)
    failed = [str(o["value"]) for o in outcomes if not o.get("results")]
    if runs:
        plot(runs, dest / "bench.png", f"not drawn, their servers failed (summary.md says why): "
             f"{', '.join(failed)}" if failed else None)
    return text
