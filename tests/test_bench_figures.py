"""The field's figures per level (operations/reports/bench_figures.py: decode throughput at steady
state, TTFT and ITL apart), the published figures and their matching
(operations/reports/published.py), the report's use of both, and the stand-in bench_serving's peaks
and accept length as the real tool computes them."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from operations.reports import bench_figures, bench_report, published
from operations.reports.published import Served
from tests.test_bench import _texts, raw_run

ROOT = Path(__file__).resolve().parents[1]
LAB = Served(gpu="NVIDIA RTX PRO 6000 Blackwell Server Edition", compute_capability="12.0",
             model="lukealonso/GLM-5-NVFP4", tensor_parallel_size=8, speculative=None)
BENCH = {"backend": "sglang-oai", "median_itl_ms": 40.0, "p99_itl_ms": 95.0,
         "median_ttft_ms": 300.0, "p99_ttft_ms": 2100.0, "median_tpot_ms": 50.0,
         "max_output_tokens_per_s": 470.0, "accept_length": None}


def test_decode_at_steady_state_from_the_median_itl():
    d = bench_figures.decode(BENCH, 16, 128, LAB)
    assert d["tok_s"] == pytest.approx(16 * 1000 / 40.0) and d["basis"] == "itl"
    assert d["per_stream_tok_s"] == pytest.approx(25.0) and d["streams"] == 16
    assert d["ttft_ms"] == {"p50": 300.0, "p99": 2100.0}
    assert d["itl_ms"] == {"p50": 40.0, "p99": 95.0}
    assert d["peak_output_tok_s"] == 470.0
    assert d["published"]["tok_s"] == 427.4
    assert d["published"]["ratio"] == pytest.approx(400 / 427.4)
    assert bench_figures.decode(None, 16, 128, LAB) is None


def test_streams_at_most_the_prompts_sent_and_the_servers_running_limit():
    assert bench_figures.decode(BENCH, 64, 8, LAB)["tok_s"] == pytest.approx(8 * 1000 / 40.0)
    limited = bench_figures.decode(BENCH, 64, 128, LAB, running_limit=32)
    assert limited["streams"] == 32 and limited["published"]["tok_s"] == 1010.6  # asked: 64
    assert bench_figures.decode(BENCH, 64, 128, LAB, running_limit=None)["streams"] == 64


def test_speculative_chunks_without_an_accept_length_read_tpot():
    """sglang-oai gives one ITL gap per chunk unless the server reports an accept length: with
    MTP several tokens come in one chunk, so the per-token TPOT is read instead."""
    mtp = Served(**{**LAB.__dict__, "speculative": "NEXTN"})
    d = bench_figures.decode(BENCH, 64, 128, mtp)
    assert d["basis"] == "tpot" and d["tok_s"] == pytest.approx(64 * 1000 / 50.0)
    assert d["published"]["tok_s"] == 1424.6
    told = bench_figures.decode({**BENCH, "accept_length": 2.4}, 64, 128, mtp)
    assert told["basis"] == "itl" and told["accept_length"] == 2.4
    native = bench_figures.decode({**BENCH, "backend": "sglang"}, 64, 128, mtp)
    assert native["basis"] == "itl"  # /generate: gaps split over each chunk's new tokens


def test_published_figures_are_the_issues_table():
    """Issue #39's table (voipmonitor/rtx6kpro models/glm5.md, rounded half up) from the data."""
    off, on = published.PUBLISHED
    assert {n: int(off.tok_s[n] + 0.5) for n in (1, 32, 64)} == {1: 50, 32: 660, 64: 1011}
    assert {n: int(on.tok_s[n] + 0.5) for n in (1, 32, 64)} == {1: 94, 32: 995, 64: 1425}
    for row in published.PUBLISHED:
        assert row.source.startswith("https://github.com/voipmonitor/rtx6kpro/")
        assert "bf16" in row.launch and "CUDA 13" in row.stack and row.where


@pytest.mark.parametrize("change, found", [
    ({}, 1010.6),
    ({"model": "/opt/gpuhost/models/lukealonso/GLM-5-NVFP4"}, 1010.6),
    ({"model": "festr2/GLM-5-NVFP4-MTP", "speculative": "nextn"}, 1424.6),
    ({"gpu": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"}, 1010.6),
    ({"gpu": "NVIDIA H200", "compute_capability": "9.0"}, None),
    ({"compute_capability": "10.0"}, None),
    ({"compute_capability": None}, None),
    ({"tensor_parallel_size": 4}, None),
    ({"model": "zai-org/GLM-5"}, None),
    ({"model": None}, None),
    ({"speculative": "EAGLE"}, None),
])
def test_match_card_model_tp_speculative(change, found):
    got = published.match(Served(**{**LAB.__dict__, **change}), 64)
    assert (got and got[1]) == found


def test_match_needs_a_figure_at_that_level():
    assert published.match(LAB, 3) is None and published.match(LAB, 128) is None


def test_served_from_the_server_flags_then_the_settings():
    """The server's own flags win (a sweep's value served); settings before and after
    gpuhost_speculative_algorithm exists (getattr with None)."""
    versions = {"gpu": LAB.gpu, "compute_cap": "12.0"}
    old = SimpleNamespace(model="lukealonso/GLM-5-NVFP4", tensor_parallel_size=8)
    what = bench_figures.served(versions, {}, old)
    assert what == LAB
    new = SimpleNamespace(**old.__dict__, speculative_algorithm="NEXTN")
    assert bench_figures.served(versions, {}, new).speculative == "NEXTN"
    assert bench_figures.served(versions, {"speculative_algorithm": None}, new).speculative \
        is None
    assert bench_figures.served(versions, {"tp_size": 4}, new).tensor_parallel_size == 4
    bare = bench_figures.served({}, {"model_path": "/m/lukealonso/GLM-5-NVFP4"})
    assert bare.model == "/m/lukealonso/GLM-5-NVFP4" and bare.gpu is None


def _lab_run(tmp_path: Path) -> Path:
    """raw_run's outputs as if from the reference lab: its card, model path and TP."""
    raw = raw_run(tmp_path)
    meta = json.loads((raw / "meta.json").read_text())
    meta["versions"].update(gpu=LAB.gpu, compute_cap="12.0", gpu_count="8")
    (raw / "meta.json").write_text(json.dumps(meta))
    for n in (1, 64):
        result = json.loads((raw / f"level-{n}.json").read_text())
        result["server_info"].update(tp_size=8, speculative_algorithm=None,
                                     model_path="/opt/gpuhost/models/lukealonso/GLM-5-NVFP4")
        (raw / f"level-{n}.json").write_text(json.dumps(result) + "\n")
    return raw


def test_report_sets_the_published_figure_beside_decode(tmp_path):
    raw = _lab_run(tmp_path)
    results, text = bench_report.write(raw, tmp_path, "gpu1")
    by_level = {lv["concurrency"]: lv for lv in results["levels"]}
    d = by_level[64]["decode"]
    assert d["tok_s"] == pytest.approx(64 * 1000 / 79.0)  # raw_run's median ITL
    assert d["published"]["tok_s"] == 1010.6 and d["published"]["source"] == published.PAGE
    assert d["published"]["ratio"] == pytest.approx(64 * 1000 / 79.0 / 1010.6)
    assert by_level[1]["decode"]["published"]["tok_s"] == 50.4
    assert results["served"]["tensor_parallel_size"] == 8
    assert json.loads((tmp_path / "results.json").read_text())["levels"][1]["decode"] == d
    assert "| 64 | 128 of 128 | 306.4 | 810.1 | 1010.6 (0.80 x) |" in text
    assert f"concurrency 64: 810.1 decode tok/s = 0.80 x the published 1010.6 (" in text
    assert published.PAGE in text and "--kv-cache-dtype bf16" in text


def test_report_without_a_published_figure_says_none(tmp_path):
    results, text = bench_report.write(raw_run(tmp_path), tmp_path, "h200")  # one H200, TP 1
    assert all(lv["decode"]["published"] is None for lv in results["levels"])
    assert all(lv["decode"]["tok_s"] > 0 for lv in results["levels"])
    assert "published" not in text.split("|---")[-1]


def test_plot_draws_decode_and_the_published_figures(tmp_path):
    import matplotlib.pyplot as plt

    raw = _lab_run(tmp_path)
    results = bench_report.build(raw, "gpu1")
    results["series"] = bench_report.series(raw)
    fig = bench_report.figure([results])
    try:
        tput = fig.get_axes()[0]
        lines = {line.get_label(): line for line in tput.get_lines()}
        assert list(lines["decode (steady state)"].get_ydata()) == pytest.approx(
            [1000 / 79.0, 64 * 1000 / 79.0])
        stars = lines["published decode, voipmonitor/rtx6kpro"]
        assert list(stars.get_xdata()) == [1, 64] and list(stars.get_ydata()) == [50.4, 1010.6]
        assert tput.get_ylim()[1] > 1010.6 and tput.get_ylim()[0] == 0  # every point shown
        assert [a.get_text() for a in tput.texts] == ["0.25 x", "0.80 x"]  # ours / theirs
        legend = [t.get_text() for t in tput.get_legend().get_texts()]
        assert "published decode, voipmonitor/rtx6kpro" in legend
        texts = _texts(fig)
        for i, (a, box_a) in enumerate(texts):
            for b, box_b in texts[i + 1:]:
                assert not box_a.overlaps(box_b) or box_a.width * box_b.width == 0, (a, b)
    finally:
        plt.close(fig)


def _standin():
    path = ROOT / "sandbox" / "standins" / "sglang" / "sglang" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving_standin_peaks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_standin_peaks_as_the_real_calculate_metrics():
    """Two requests from t=0: tokens at 0.5, 0.9, 1.3 s and 0.2, 1.1 s: 3 in second 0, 2 in
    second 1; both in flight in seconds 0 and 1."""
    done = [{"start": 0.0, "ttft": 0.5, "itl": [0.4, 0.4], "latency": 1.3},
            {"start": 0.0, "ttft": 0.2, "itl": [0.9], "latency": 1.1}]
    assert _standin().peaks(done) == (3.0, 2)
    assert _standin().peaks([]) == (0.0, 0)


def test_standin_reads_the_accept_length_as_the_real_tool():
    spec_accept_length = _standin().spec_accept_length
    assert spec_accept_length({"internal_states": [{"avg_spec_accept_length": 2.5}]}) == 2.5
    assert spec_accept_length({"decode": [{"internal_states": [
        {"avg_spec_accept_length": 2.0}]}]}) == 2.0
    assert spec_accept_length({"internal_states": [{"status": "ready"}]}) is None
    assert spec_accept_length(None) is None
