"""bench.py's use of sglang.bench_serving against the real 0.5.9 tool's command line and result
fields, read out of its wheel (locks/sglang-0.5.9.bench_serving.json, tools/bench_serving_args.py):
the host script's flags and values, the sandbox stand-in's flags, defaults and result fields,
the report's fields."""

import json
import sys
from pathlib import Path

import pytest

from operations.reports import bench_figures, bench_report

ROOT = Path(__file__).resolve().parents[1]
SPEC = json.loads((ROOT / "locks" / "sglang-0.5.9.bench_serving.json").read_text())
STANDIN = ROOT / "sandbox" / "standins" / "sglang" / "sglang" / "bench_serving.py"
sys.path.insert(0, str(ROOT / "operations" / "files"))
sys.path.insert(0, str(ROOT / "tools"))
import bench_run  # noqa: E402
import bench_serving_args  # noqa: E402

TYPES = {"int": int, "float": float, "str": str}


def test_spec_is_the_wheels():
    assert SPEC["sglang"] == "0.5.9"
    assert "random-ids" in SPEC["arguments"]["--dataset-name"]["choices"]
    assert "sglang-oai" in SPEC["arguments"]["--backend"]["choices"]


@pytest.mark.parametrize("backend", ["sglang-oai", "sglang"])  # a host's own; the router's
def test_host_script_command_is_accepted_by_the_real_parser(backend):
    args = type("A", (), dict(python="python", url="http://127.0.0.1:8000", tokenizer="/m",
                              model="glm-5", input_len=1024, output_len=256, prompts=128,
                              backend=backend))
    command = bench_run.bench_command(args, 64, "/out/level-64.json")[3:]
    seen = []
    i = 0
    while i < len(command):
        flag = command[i]
        assert flag in SPEC["arguments"], flag
        arg = SPEC["arguments"][flag]
        seen.append(flag)
        if arg.get("action") == "store_true":
            i += 1
            continue
        value = command[i + 1]
        if arg.get("choices"):
            assert value in arg["choices"], (flag, value)
        TYPES.get(arg.get("type"), str)(value)
        i += 2
    assert {"--dataset-name", "--random-range-ratio", "--tokenizer", "--warmup-requests",
            "--output-file", "--max-concurrency"} <= set(seen)


def test_standin_takes_the_real_flags_with_the_real_defaults():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serving_standin", STANDIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for action in module.parser()._actions:
        for flag in action.option_strings:
            if flag in ("-h", "--help"):
                continue
            real = SPEC["arguments"][flag]
            if "default" in real and not str(real["default"]).startswith("float("):
                assert action.default == real["default"], flag
            if real.get("choices"):
                assert list(action.choices) == real["choices"], flag


def test_standin_writes_the_real_result_fields():
    fields = bench_serving_args.extract(STANDIN.read_text())["result_fields"]
    assert fields == SPEC["result_fields"]


def test_report_reads_real_result_fields():
    assert set(bench_report.BENCH_FIELDS) <= set(SPEC["result_fields"])
    assert set(bench_figures.FIELDS) <= set(bench_report.BENCH_FIELDS)  # the decode figures'


@pytest.mark.parametrize("field", ["output_throughput", "median_tpot_ms", "p99_itl_ms"])
def test_fields_the_issue_names(field):
    assert field in SPEC["result_fields"]
