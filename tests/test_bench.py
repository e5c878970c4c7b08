"""bench.py's pieces off the host: the bench settings, the host script's arguments and fields,
and the report (results.json, summary.md, bench.png) from raw outputs in the real formats (the
H200 capture's telemetry, a bench_serving JSON with sglang 0.5.9's result fields)."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from operations.facts import telemetry
from operations.plans.settings import SettingsError, from_host_data
from operations.reports import bench_report, sweep_report
from operations.stages.bench import context_length

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "h200-device" / "telemetry"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operations" / "files"))
import bench_run  # noqa: E402


def test_host_script_samples_the_captured_fields():
    assert tuple(bench_run.QUERY_FIELDS.split(",")) == telemetry.QUERY_FIELDS
    assert tuple(bench_run.LINK_FIELDS.split(",")) == telemetry.LINK_FIELDS


def test_bench_command_offline_fixed_lengths():
    args = type("A", (), dict(python="/v/bin/python", url="http://127.0.0.1:8000",
                              tokenizer="/m/x", model="glm-5", input_len=100, output_len=20,
                              prompts=64, backend="sglang-oai"))
    cmd = bench_run.bench_command(args, 16, "/out/level-16.json")
    joined = " ".join(cmd)
    assert cmd[:3] == ["/v/bin/python", "-m", "sglang.bench_serving"]
    for part in ("--backend sglang-oai", "--dataset-name random-ids",
                 "--random-range-ratio 1.0", "--tokenizer /m/x",
                 "--max-concurrency 16", "--num-prompts 64", "--output-file /out/level-16.json",
                 "--served-model-name glm-5", "--warmup-requests 4"):
        assert part in joined


@pytest.mark.parametrize("data, key", [
    ({"gpuhost_bench_levels": []}, "gpuhost_bench_levels"),
    ({"gpuhost_bench_levels": [0, 16]}, "gpuhost_bench_levels"),
    ({"gpuhost_bench_levels": [16, 16]}, "gpuhost_bench_levels"),
    ({"gpuhost_bench_levels": [1, 65]}, "gpuhost_bench_levels"),
    ({"gpuhost_bench_prompts": 10}, "gpuhost_bench_prompts"),
    ({"gpuhost_bench_input_len": 0}, "gpuhost_bench_input_len"),
    ({"gpuhost_bench_output_len": "64"}, "gpuhost_bench_output_len"),
    ({"gpuhost_bench_sweep": {"tp_size": [1, 2]}}, "one of moe_runner_backend"),
    ({"gpuhost_bench_sweep": {"moe_runner_backend": []}}, "non-empty list of distinct"),
    ({"gpuhost_bench_sweep": {"moe_runner_backend": ["cutlass", "cutlass"]}}, "distinct"),
    ({"gpuhost_bench_sweep": {"moe_runner_backend": ["cutlass", "nope"]}},
     "--moe-runner-backend nope: sglang 0.5.9 allows only auto"),
    ({"gpuhost_bench_sweep": {"mem_fraction_static": [0.9, 1.5]}}, "1.5 is not"),
    ({"gpuhost_bench_sweep": {"a": [1], "b": [2]}}, "gpuhost_bench_sweep"),
    ({"gpuhost_bench_target": "fleet"}, "gpuhost_bench_target = 'fleet' is not allowed: one of "
     "host, router"),
    ({"gpuhost_bench_target": "router", "gpuhost_bench_sweep": {"moe_runner_backend": ["cutlass"]}},
     "gpuhost_bench_target = 'router' is not allowed: 'host' with gpuhost_bench_sweep"),
])
def test_bad_bench_settings_refused(data, key):
    with pytest.raises(SettingsError) as caught:
        from_host_data("gpu1", data)
    assert key in str(caught.value) and "is not allowed" in str(caught.value)
    assert str(caught.value).count("\n") == 0  # one problem, one line


def test_bench_settings_default_and_given():
    assert from_host_data("gpu1", {}).bench_levels == (1, 16, 64)
    s = from_host_data("gpu1", {"gpuhost_bench_levels": [2, 8], "gpuhost_bench_prompts": 8})
    assert s.bench_levels == (2, 8) and s.bench_prompts == 8


def test_default_levels_follow_a_lower_max_running_requests():
    """A deploy with fewer concurrent requests, and no bench key set, must not be refused for
    the bench's default levels (test_server's run with 32 was)."""
    assert from_host_data("gpu1", {"gpuhost_max_running_requests": 32}).bench_levels == \
        (1, 16, 32)
    assert from_host_data("gpu1", {"gpuhost_max_running_requests": 8}).bench_levels == (1, 8)
    with pytest.raises(SettingsError, match="gpuhost_bench_levels"):
        from_host_data("gpu1", {"gpuhost_max_running_requests": 32,
                                "gpuhost_bench_levels": [1, 64]})


def test_context_length_extra_args_win():
    s = from_host_data("gpu1", {})
    assert context_length(s, 4096) == 4096
    s = from_host_data("gpu1", {"gpuhost_server_extra_args": ["--context-length", "2048"]})
    assert context_length(s, 4096) == 2048


def raw_run(tmp_path: Path) -> Path:
    """A raw folder as bench_run.py writes it, from the real H200 capture: the large-GEMM
    phase as level 64, the tiny-GEMM phase as level 1."""
    raw = tmp_path / "raw"
    raw.mkdir()
    shutil.copy(FIXTURES / "query.csv", raw / "telemetry.csv")
    shutil.copy(FIXTURES / "dmon-DT.csv", raw / "dmon.csv")
    (raw / "links.csv").write_text("0, 5, 16\n")
    phases = {p["phase"]: p for p in json.loads((FIXTURES / "phases.json").read_text())["phases"]}

    def stamp(iso):
        return iso[:23].replace("-", "/").replace("T", " ")

    levels = []
    for n, phase in ((1, "tiny-gemm"), (64, "large-gemm")):
        levels.append({"concurrency": n, "start": stamp(phases[phase]["start"]),
                       "end": stamp(phases[phase]["end"]), "rc": 0, "command": []})
        result = {"max_concurrency": n, "completed": 128, "duration": 15.0,
                  "output_throughput": 11.0 * n ** 0.8, "total_throughput": 25.0 * n ** 0.8,
                  "request_throughput": 0.1 * n, "median_ttft_ms": 50.0, "p99_ttft_ms": 90.0,
                  "median_tpot_ms": 80.0, "p99_tpot_ms": 99.0, "median_itl_ms": 79.0,
                  "p99_itl_ms": 120.0, "server_info": {"moe_runner_backend": "flashinfer_cutlass",
                                                       "tp_size": 1, "api_key": None}}
        (raw / f"level-{n}.json").write_text(json.dumps(result) + "\n")
    meta = {"utc_offset_s": 0, "started": stamp(phases["idle"]["start"]),
            "ended": stamp(phases["idle-after"]["end"]),
            "versions": {"sglang": "0.5.9", "driver": "580.159.04", "gpu": "NVIDIA H200",
                         "gpu_count": "1"},
            "levels": levels, "input_len": 1024, "output_len": 256, "prompts": 128}
    (raw / "meta.json").write_text(json.dumps(meta))
    return raw


def test_report_from_real_telemetry(tmp_path):
    raw = raw_run(tmp_path)
    results, text = bench_report.write(raw, tmp_path, "h200")
    by_level = {lv["concurrency"]: lv for lv in results["levels"]}
    assert by_level[64]["verdict"]["name"] == "power-capped"
    assert by_level[1]["verdict"]["name"] == "server-bound"
    assert by_level[64]["bench"]["output_throughput"] == pytest.approx(11.0 * 64 ** 0.8)
    assert by_level[64]["gpus"][0]["power_mean_pct"] > 90
    assert results["server"] == {"moe_runner_backend": "flashinfer_cutlass", "tp_size": 1}
    assert json.loads((tmp_path / "results.json").read_text())["host"] == "h200"
    assert "| 64 | 128 of 128 | 306.4 |" in text and "power-capped: SW power cap active" in text
    assert by_level[64]["requests"] == {"prompts": 128, "completed": 128, "failed": 0}
    assert by_level[64]["complete"] is True and results["stand_ins"] == []
    assert "stand-in" not in text
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_missing_file_named(tmp_path):
    raw = raw_run(tmp_path)
    (raw / "dmon.csv").unlink()
    with pytest.raises(bench_report.ReportError, match="dmon.csv is missing"):
        bench_report.write(raw, tmp_path, "h200")


def test_sweep_dropin_changes_one_flag_only():
    from operations.stages.server_unit import unit_context
    from operations.stages.sweep import dropin_text

    s = from_host_data("gpu1", {})
    text = dropin_text(s, "moe_runner_backend", "cutlass")
    lines = text.splitlines()
    assert lines[1:3] == ["[Service]", "ExecStart="]
    configured = unit_context(s)["exec_args"]
    assert lines[3].endswith("$GPUHOST_P2P_SERVER_ARGS")
    assert "--moe-runner-backend cutlass" in lines[3]
    assert lines[3].replace("--moe-runner-backend cutlass",
                            f"--moe-runner-backend {s.moe_runner_backend}").count(configured) == 1


def _scaled(results: dict, factor: float, completed: int | None = None) -> dict:
    out = json.loads(json.dumps(results))
    for level in out["levels"]:
        level["bench"]["output_throughput"] *= factor
        if completed is not None:
            level["bench"]["completed"] = completed
            level["requests"] = bench_report.requests(128, 0, level["bench"])
            level["complete"] = level["requests"]["failed"] == 0
    return out


def test_sweep_summary_ranks_and_records_failures(tmp_path):
    raw = raw_run(tmp_path)
    fast = bench_report.build(raw, "h200", "flashinfer_cutlass")
    outcomes = [
        {"value": "flashinfer_cutlass", "status": "ok", "results": fast,
         "repeat": _scaled(fast, 0.98)},
        {"value": "cutlass", "status": "failed", "reason": "the server failed the health gate",
         "journal": ["RuntimeError: CUDA error: an illegal memory access was encountered"]},
        {"value": "flashinfer_trtllm", "status": "ok", "results": _scaled(fast, 0.5)},
    ]
    text = sweep_report.sweep_summary("h200", "moe_runner_backend", "flashinfer_trtllm",
                                      outcomes)
    assert "- concurrency 64: flashinfer_cutlass wins, +100.0 % output tok/s over " \
           "flashinfer_trtllm (run-to-run spread 2.0 %)" in text
    assert "--data gpuhost_moe_runner_backend=flashinfer_cutlass" in text
    assert "- cutlass: failed: the server failed the health gate" in text
    assert "illegal memory access" in text
    assert "| 64 | 306.4 | failed | 153.2 | flashinfer_cutlass | 2.0 % |" in text


def test_sweep_ranks_only_values_that_completed(tmp_path):
    """The issue's sweep: 58, 22 and 53 of 64 requests completed; the one with 22 looked
    slowest and the configured one was declared the winner. Now none is ranked, none wins."""
    fast = bench_report.build(raw_run(tmp_path), "h200", "x")
    outcomes = [{"value": v, "status": "ok", "results": _scaled(fast, f, completed=c)}
                for v, f, c in (("flashinfer_cutlass", 1.0, 58), ("cutlass", 0.6, 22),
                                ("triton", 0.99, 53))]
    verdict = sweep_report.sweep_verdict("moe_runner_backend", "flashinfer_cutlass", outcomes)
    assert verdict["overall"] is None
    assert all(row["winner"] is None and row["ranked"] == {} for row in verdict["levels"])
    assert verdict["levels"][0]["left_out"]["cutlass"] == "106 of 128 requests failed"
    text = sweep_report.sweep_summary("h200", "moe_runner_backend", "flashinfer_cutlass",
                                      outcomes)
    assert "wins" not in text.replace("wins beyond", "")
    assert "no value completed every request; flashinfer_cutlass not ranked (70 of 128 " \
           "requests failed)" in text
    assert "(FAILED: 106 of 128 requests failed)" in text


def test_sweep_within_noise_names_no_winner(tmp_path):
    fast = bench_report.build(raw_run(tmp_path), "h200", "x")
    outcomes = [{"value": "flashinfer_cutlass", "status": "ok", "results": fast,
                 "repeat": _scaled(fast, 0.97)},
                {"value": "cutlass", "status": "ok", "results": _scaled(fast, 1.01)}]
    text = sweep_report.sweep_summary("h200", "moe_runner_backend", "flashinfer_cutlass",
                                      outcomes)
    assert "- concurrency 64: within noise: cutlass, +1.0 % output tok/s over " \
           "flashinfer_cutlass, not more than the run-to-run spread 3.0 %: no winner" in text
    assert "No value of moe_runner_backend wins beyond the run-to-run spread" in text
    assert "--data" not in text
    # without a repeat, no spread was measured: no difference is a win
    del outcomes[0]["repeat"]
    text = sweep_report.sweep_summary("h200", "moe_runner_backend", "flashinfer_cutlass",
                                      [{**o, "results": _scaled(o["results"], 2.0)}
                                       if o["value"] == "cutlass" else o for o in outcomes])
    assert "spread is not measured" in text and "--data" not in text


def test_level_with_failed_requests_is_marked(tmp_path):
    raw = raw_run(tmp_path)
    result = json.loads((raw / "level-64.json").read_text())
    (raw / "level-64.json").write_text(json.dumps({**result, "completed": 91}) + "\n")
    results, text = bench_report.write(raw, tmp_path, "h200")
    level = {lv["concurrency"]: lv for lv in results["levels"]}[64]
    assert level["requests"] == {"prompts": 128, "completed": 91, "failed": 37}
    assert level["complete"] is False
    assert json.loads((tmp_path / "results.json").read_text())["levels"][1]["complete"] is False
    assert "| 64 | **91 of 128 (FAILED: 37 of 128 requests failed)** |" in text
    assert "- concurrency 64 (37 of 128 requests failed: its figures are of the requests " \
           "that completed)" in text


def test_stand_ins_said_in_the_summary(tmp_path):
    raw = raw_run(tmp_path)
    meta = json.loads((raw / "meta.json").read_text())
    meta["summaries"] = {"sglang": "SGLang (gpuhost sandbox stand-in)",
                         "torch": "Tensors and Dynamic neural networks in Python with strong "
                                  "GPU acceleration"}
    (raw / "meta.json").write_text(json.dumps(meta))
    results, text = bench_report.write(raw, tmp_path, "h200")
    assert results["stand_ins"] == ["sglang"]
    assert "**Figures from stand-ins, not a measurement: sglang says in its package metadata " \
        "that it is a stand-in (the sandbox's)" in text


def test_model_context_length_fact():
    from operations.stages.bench import ModelContextLength

    fact = ModelContextLength()
    assert fact.process(['{"max_position_embeddings": 202752,', '"vocab_size": 154880}']) \
        == 202752
    assert fact.process([]) is None
    assert fact.process(['{"vocab_size": 1}']) is None
    assert "config.json" in fact.command("/opt/gpuhost/models/x")


def test_public_server_benched_through_the_gate_key_file_only():
    from operations.stages.bench import _gate_argv, _run_argv

    s = from_host_data("gpu1", {"gpuhost_server_host": "0.0.0.0",
                                "gpuhost_api_key_file": "/root/api_key"})
    run = _run_argv(s)
    assert run[run.index("--url") + 1] == "http://127.0.0.1:8000"  # the gate, from the host
    assert run[run.index("--api-key-file") + 1] == "/root/api_key"
    gate = _gate_argv(s)
    assert gate[gate.index("--public-url") + 1] == "http://127.0.0.1:8000"
    assert gate[gate.index("--url") + 1] == "http://127.0.0.1:30000"  # the server behind it
    assert "--keep-unit" in gate
    loopback = _run_argv(from_host_data("gpu1", {}))
    assert "--api-key-file" not in loopback
    assert loopback[loopback.index("--url") + 1] == "http://127.0.0.1:8000"


def test_report_on_the_host_script_run_on_a_real_h200(tmp_path):
    """bench_run.py's own outputs from the real H200 (fixture bench-run/, README there)."""
    raw = Path(__file__).resolve().parent / "fixtures" / "h200-device" / "bench-run"
    results, text = bench_report.write(raw, tmp_path, "h200")
    verdicts = {lv["concurrency"]: lv["verdict"]["name"] for lv in results["levels"]}
    assert verdicts == {1: "server-bound", 64: "power-capped"}
    (gpu,) = results["levels"][1]["gpus"]
    assert gpu["power_peak_pct"] > 95 and gpu["reasons"]["sw_power_cap"] > 50
    assert gpu["pcie_peak_pct"] is not None
    assert results["versions"]["driver"] == "580.159.04"
    assert len(results["series"]) > 60


FAKE_BENCH_SERVING = r"""#!/bin/bash
# bench_serving as bench_run.py sees it: warm-up lines, tqdm's redraws on stderr, the result
if [ "$1" = "-c" ]; then exec python3 "$@"; fi
out=""; n=0
while [ $# -gt 0 ]; do case "$1" in --output-file) out=$2; shift;; --num-prompts) n=$2; shift;; esac; shift; done
echo "Starting warmup with 1 sequences..."
echo "Warmup completed with 1 sequences. Starting main benchmark run..."
for i in $(seq 0 $n); do printf '\r%3d%%|          | %d/%d [00:00<?, ?it/s]' $((100*i/n)) $i $n >&2; done
echo >&2
echo "============ Serving Benchmark Result ============"
echo '{"completed": '$n', "duration": 0.5}' >> "$out"
"""


def test_host_script_says_prompts_done_of_total(tmp_path):
    """bench_run.py reads bench_serving's tqdm bar (its carriage-return redraws) and says the
    prompts done of the level's total; the bar's redraws stay out of the level's log."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "fake-python").write_text(FAKE_BENCH_SERVING)
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    out = subprocess.run(
        [sys.executable, bench_run.__file__, "--python", str(bin_dir / "fake-python"),
         "--url", "http://127.0.0.1:1", "--model", "m", "--tokenizer", str(tmp_path),
         "--levels", "1,4", "--input-len", "8", "--output-len", "8", "--prompts", "6",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "level 1: 0 of 6 prompts done; level 4 after it" in lines
    assert "level 1: 6 of 6 prompts done; level 4 after it" in lines
    assert "level 4: 6 of 6 prompts done" in lines
    log = (tmp_path / "run" / "level-1.log").read_text().splitlines()
    assert log.count("100%|          | 6/6 [00:00<?, ?it/s]") == 1
    assert not any("| 3/6 [" in line for line in log)


def test_progress_line_estimates_the_time_left():
    assert bench_run.progress_line(1, 4, 16, 20.0, [4, 16]) == \
        "level 1: 4 of 16 prompts done, about 60 s left in this level; levels 4, 16 after it"
    assert bench_run.progress_line(16, 0, 16, 3.0, []) == "level 16: 0 of 16 prompts done"


def test_standin_draws_tqdms_bar():
    """The sglang stand-in's bar is tqdm 4.67.1's format_meter, character for character (the
    expected strings are that wheel's output)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sandbox/standins/sglang"))
    try:
        from sglang.bench_serving import tqdm_bar
    finally:
        sys.path.pop(0)
    assert tqdm_bar(32, 128, 10.0) == " 25%|██▌       | 32/128 [00:10<00:30,  3.20it/s]"
    assert tqdm_bar(0, 128, 0.0) == "  0%|          | 0/128 [00:00<?, ?it/s]"
    assert tqdm_bar(128, 128, 40.0) == "100%|██████████| 128/128 [00:40<00:00,  3.20it/s]"
    assert tqdm_bar(5, 16, 12.3) == " 31%|███▏      | 5/16 [00:12<00:27,  2.46s/it]"


def sandbox_inventory(monkeypatch) -> dict:
    """inventory/sandbox.py's module, run on a made-up `sandbox status --json` of one host."""
    import runpy
    import subprocess

    host = {"name": "gpu1", "address": "10.213.1.2", "ssh_user": "root", "ssh_key": "k",
            "known_hosts": "kh", "cuda_repo_url": "http://10.213.1.1:8080/cuda",
            "cuda_keyring_sha256": "0" * 64, "pip_index_url": "http://10.213.1.1:8081/simple",
            "lock": "cu128", "switch_address": "10.214.0.2"}
    done = subprocess.CompletedProcess([], 0, json.dumps([host]), "")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: done)
    return runpy.run_path(str(Path(__file__).resolve().parents[1] / "inventory/sandbox.py"))


def test_sandbox_bench_ends_within_minutes(monkeypatch):
    """README's `pyinfra -y inventory/sandbox.py bench.py` must end in at most 3 minutes on this
    machine: at the stand-in server's pace (the reference lab scenario's rates, log-linear
    between levels, as the stand-in paces them), the sandbox's levels take well under two."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sandbox/standins/sglang"))
    try:
        from sglang._standin.server import rate_at
    finally:
        sys.path.pop(0)
    from sandbox.scenarios import SERVING_DEFAULT

    ((name, data),) = sandbox_inventory(monkeypatch)["sandbox"]
    s = from_host_data(name, {k: v for k, v in data.items() if k.startswith("gpuhost_bench")})
    table = SERVING_DEFAULT["output_tokens_per_s"]["default"]
    seconds = sum((s.bench_prompts * s.bench_output_len + min(n, 4) * 16) / rate_at(table, n)
                  for n in s.bench_levels)
    assert seconds < 90, seconds
    assert from_host_data("gpu1", {}).bench_prompts == 128  # a real lab's defaults stay


def _texts(fig):
    """Every text a drawn figure shows, with its box on the canvas: the titles, axis labels,
    the tick labels within each axis's view, the legends' texts."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    shown = []
    for sub in (fig, *fig.subfigs):
        shown += [t for t in (getattr(sub, "_suptitle", None),) if t is not None]
        shown += [t for legend in sub.legends for t in legend.get_texts()]
    for ax in fig.get_axes():
        if not ax.get_visible():
            continue
        shown += [ax.title, ax.xaxis.label, ax.yaxis.label]
        if ax.get_legend():
            shown += ax.get_legend().get_texts()
        for axis, (low, high) in ((ax.xaxis, sorted(ax.get_xlim())),
                                  (ax.yaxis, sorted(ax.get_ylim()))):
            for tick in axis.get_major_ticks():
                if low <= tick.get_loc() <= high and tick.label1.get_visible():
                    shown.append(tick.label1)
    return [(t.get_text(), t.get_window_extent(renderer)) for t in shown
            if t.get_visible() and t.get_text().strip()]


def _sweep_runs(tmp_path) -> list[dict]:
    raw = Path(__file__).resolve().parent / "fixtures" / "h200-bench-run-loads"
    base = bench_report.build(raw, "h200")
    base["series"] = bench_report.series(raw)
    runs = []
    for label, completed in (("flashinfer_cutlass c=16", 64), ("flashinfer_cutlass c=64", 22),
                             ("cutlass", 64)):
        run = json.loads(json.dumps(base))
        run["label"] = label
        for level in run["levels"]:
            level["bench"]["completed"] = completed
            level["requests"] = bench_report.requests(64, 0, level["bench"])
        runs.append(run)
    return runs


@pytest.mark.parametrize("runs", ["one", "sweep"])
def test_plot_reads_whatever_the_run(tmp_path, runs):
    """The fixture's three loads, alone and as a sweep of three values: the concurrency axes
    are labelled with the levels; each level has a time panel of its own (its own length) with
    utilisation and memory-copy utilisation beside power and clock; no two labels overlap; the
    legends name only what is drawn; failed levels are crossed out in red."""
    import matplotlib.pyplot as plt

    if runs == "one":
        raw = Path(__file__).resolve().parent / "fixtures" / "h200-bench-run-loads"
        one = bench_report.build(raw, "h200")
        one["series"] = bench_report.series(raw)
        runs = [one]
    else:
        runs = _sweep_runs(tmp_path)
    fig = bench_report.figure(runs)
    try:
        texts = _texts(fig)
        for i, (a, box_a) in enumerate(texts):
            for b, box_b in texts[i + 1:]:
                assert not box_a.overlaps(box_b) or box_a.width * box_b.width == 0, (a, b)
        axes = [ax for ax in fig.get_axes() if ax.get_visible()]
        top = [ax for ax in axes if ax.get_xlabel() == "concurrent requests"]
        assert len(top) == 3
        for ax in top:
            assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "16", "64"]
        cells = [ax for ax in axes if ax not in top]
        assert len(cells) == 3 * len(runs)
        for ax in cells:
            labels = {line.get_label() for line in ax.get_lines()}
            assert {"power % of limit", "SM clock % of max", "GPU util % (a kernel running)",
                    "memory-copy util % (utilization.memory)"} <= labels
            assert ax.get_xlim()[1] - ax.get_xlim()[0] < 20  # its own level, 12 s long
        for legend in [ax.get_legend() for ax in axes if ax.get_legend()] + fig.legends + [
                leg for sub in fig.subfigs for leg in sub.legends]:
            for handle, text in zip(legend.legend_handles, legend.get_texts()):
                assert text.get_text() in {a.get_label() for ax in axes
                                           for a in (*ax.get_lines(), *ax.patches)
                                           if a.get_visible()}, text.get_text()
        failed = [line for ax in top for line in ax.get_lines() if line.get_marker() == "X"]
        assert failed and all(line.get_color() == "red" for line in failed)
        if len(runs) > 1:
            assert sum(1 for ax in cells if ax.title.get_color() == "red") == 3
    finally:
        plt.close(fig)


def test_bench_commands_in_the_docs_copy_paste_complete():
    """Every bench.py command README, the manual (docs/) and bench.py show has -y (without it
    pyinfra waits for Enter, and dies on EOF without a terminal); results are said to go where
    the sweep writes them; nothing calls the sweep unbuilt."""
    import re

    root = Path(__file__).resolve().parents[1]
    paths = [root / "README.md", root / "bench.py", *sorted((root / "docs").glob("*.md"))]
    text = "\n".join(path.read_text() for path in paths)
    commands = [line for line in text.splitlines()
                if re.search(r"pyinfra .*bench\.py", line) and line.startswith("    ")]
    assert len(commands) >= 8
    assert all(" -y " in line for line in commands), [c for c in commands if " -y " not in c]
    assert "moe_runner_backend=cutlass/" in text
    assert "`<value>/`" not in text
    assert "not built yet" not in text


def test_the_bench_gives_the_hosts_gpu_verdict(tmp_path):
    """bench_run.py's copy of the GPU metrics script's reading (gpu-health.prom): here the real
    H100's health readings (tests/fixtures/h100-device/health) with an Xid 79 in its kernel log."""
    from tests.test_gpu_health import IDENTITY, XID_79, health_line, real
    import gpu_metrics

    raw = raw_run(tmp_path)
    assert bench_report.build(raw, "h200")["gpu_health"] is None  # no reading: no verdict
    query = (Path(__file__).resolve().parent / "fixtures/h200-device/telemetry/query.csv"
             ).read_text().splitlines()[0]
    (raw / "gpu-health.prom").write_text(gpu_metrics.render(
        IDENTITY, query + "\n", "", health_line(), real("q.txt"),
        real("dmesg-nvrm.txt") + XID_79 + "\n", 1))
    (tmp_path / "out").mkdir()
    results, text = bench_report.write(raw, tmp_path / "out", "h200")
    assert results["gpu_health"]["state"] == "failed"
    assert "GPU health at the end: failed (Xid 79 (the GPU fell off the bus) x1 on GPU 0 " \
           "(00000000:00:06.0): reboot the host" in text
    (raw / "gpu-health.prom").write_text(gpu_metrics.render(
        IDENTITY, query + "\n", "", health_line(), real("q.txt"), real("dmesg-nvrm.txt"), 1))
    assert bench_report.build(raw, "h200")["gpu_health"] == {"state": "healthy", "reasons": ()}


def test_an_mtp_sweep_value_adds_its_flags_and_spec_v2_and_off_is_a_value():
    """gpuhost_bench_sweep over speculative_algorithm (issue 39's sweep with MTP on and off):
    NEXTN's drop-in carries the speculative flags and SGLANG_ENABLE_SPEC_V2=True (without it
    sglang 0.5.9 turns NEXTN into EAGLE: operations/stages/server.py server_env), None the
    configured launch; None is a value for this key alone."""
    from operations.plans.settings import SettingsError
    from operations.stages.sweep import dropin_text

    s = from_host_data("gpu1", {"gpuhost_bench_sweep": {"speculative_algorithm": [None, "NEXTN"]}})
    on = dropin_text(s, "speculative_algorithm", "NEXTN").splitlines()
    assert on[1:4] == ["[Service]", "Environment=SGLANG_ENABLE_SPEC_V2=True", "ExecStart="]
    assert "--speculative-algorithm NEXTN --speculative-num-steps 4" in on[4]
    off = dropin_text(s, "speculative_algorithm", None).splitlines()
    assert off[1:3] == ["[Service]", "ExecStart="] and "--speculative" not in off[3]
    # host data with MTP on: its server.env has SPEC_V2 already, the drop-in adds nothing
    mtp = from_host_data("gpu1", {"gpuhost_speculative_algorithm": "NEXTN"})
    assert "Environment=" not in dropin_text(mtp, "speculative_algorithm", "NEXTN")
    with pytest.raises(SettingsError, match=r"values of moe_runner_backend each .*\(None is not\)"):
        from_host_data("gpu1", {"gpuhost_bench_sweep": {"moe_runner_backend": [None, "cutlass"]}})
    with pytest.raises(SettingsError, match=r"values of speculative_algorithm each one of NEXTN"):
        from_host_data("gpu1", {"gpuhost_bench_sweep": {"speculative_algorithm": ["EAGLE9"]}})


def test_a_sweeps_nextn_is_held_to_the_host_datas_step_counts_and_cuda_13_takes_nextn():
    """A sweep's NEXTN gets the checks host data's NEXTN gets (the step counts: sglang asserts
    them at start, after the sweep changed the host); sglang 0.5.17's parser takes any
    --speculative-algorithm text (choices null in its args.json), so NEXTN is allowed there."""
    from operations.plans.settings import SettingsError

    sweep = {"gpuhost_bench_sweep": {"speculative_algorithm": [None, "NEXTN"]}}
    with pytest.raises(SettingsError, match=r"gpuhost_bench_sweep = .* is not allowed: values "
                       r"whose NEXTN the host data allows \(gpuhost_speculative_eagle_topk = 1 "
                       r"is not allowed: None with gpuhost_speculative_num_steps None"):
        from_host_data("gpu1", {**sweep, "gpuhost_speculative_num_steps": None})
    cuda13 = {"gpuhost_cuda_toolkit": "13.0", "gpuhost_lock": "locks/cuda13.0.txt"}
    assert from_host_data("gpu1", {**cuda13, "gpuhost_speculative_algorithm": "NEXTN"}
                          ).speculative_algorithm == "NEXTN"
    assert from_host_data("gpu1", {**cuda13, **sweep}).bench_sweep == sweep["gpuhost_bench_sweep"]
