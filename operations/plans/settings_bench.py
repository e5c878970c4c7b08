"""The bench's settings (bench.py): sglang.bench_serving's load at each level, and the sweep."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from operations.plans.settings_rules import _int_between, _is_int, _one_of, _Rule, setting

#: Server settings a sweep may vary (each renders one launch_server flag).
SWEEP_KEYS: Final = ("moe_runner_backend", "attention_backend", "fp8_gemm_backend",
                     "nsa_decode_backend", "nsa_prefill_backend", "kv_cache_dtype",
                     "mem_fraction_static", "speculative_algorithm")  # its None: MTP off


@dataclass(frozen=True)
class BenchSettings:
    """The bench's part of Settings (operations/plans/settings_schema.py)."""
    # The bench (bench.py): sglang.bench_serving's load at each concurrency level
    bench_levels: tuple[int, ...] = setting(
        (1, 16, 64),
        _Rule(
            lambda v: isinstance(v, (list, tuple)) and bool(v) and all(_is_int(n) and n >= 1
                                                                       for n in v)
            and len(set(v)) == len(v),
            "a non-empty list of distinct concurrency levels, integers >= 1, such as [1, 16, 64]",
        ),
        "bench.py: the concurrency levels (`--max-concurrency`), distinct, each from 1 to "
        "`gpuhost_max_running_requests`")
    bench_input_len: int = setting(
        1024, _int_between(1, 1 << 20),
        "bench.py: input tokens per request (`--random-input-len`, fixed); with the output length "
        "at most the model's context length (checked on the host while planning)")
    bench_output_len: int = setting(
        256, _int_between(1, 1 << 20),
        "bench.py: output tokens per request (`--random-output-len`, fixed)")
    bench_prompts: int = setting(
        128, _int_between(1, 1 << 20),
        "bench.py: prompts per level (`--num-prompts`), at least the highest level")
    bench_sweep: Mapping[str, tuple] | None = setting(
        None,
        _Rule(
            lambda v: v is None or (isinstance(v, Mapping) and len(v) == 1 and all(
                isinstance(k, str) and isinstance(vals, (list, tuple)) for k, vals in v.items())),
            'None, or one server setting and the values to try, such as {"moe_runner_backend": '
            '["flashinfer_cutlass", "cutlass"]}',
        ),
        "bench.py: one server setting and the values to try, e.g. `{\"moe_runner_backend\": "
        "[\"cutlass\"]}`, MTP off and on `{\"speculative_algorithm\": [null, \"NEXTN\"]}`")
    #: "host": each host's own server; "router": the fleet endpoint
    #: (operations/stages/bench_fleet.py)
    bench_target: str = setting(
        "host", _one_of(("host", "router")),
        "bench.py: `\"host\"` loads each host's own server; `\"router\"` loads the fleet through "
        "the router's endpoint, from a router host (docs/bench.md); not with a sweep")


def default_bench_levels(max_running_requests: int) -> tuple[int, ...]:
    """The bench's default concurrency levels (1, 16, 64: the reference lab's notes) within
    what the server runs at once; a server of fewer requests also gets its own maximum. Host
    data that lowers gpuhost_max_running_requests must not make the deploy refuse a bench key
    it never set."""
    defaults = BenchSettings.bench_levels
    levels = tuple(n for n in defaults if n <= max_running_requests)
    if max_running_requests not in levels and max_running_requests < max(defaults):
        levels += (max_running_requests,)
    return levels
