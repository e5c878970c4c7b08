"""A level's figures as the field reports them: decode throughput at steady state, time to first
token and inter-token latency (p50, p99) apart, and the published figure beside them.

From sglang 0.5.9's bench_serving (its wheel's bench_serving.py, calculate_metrics and the
``result`` dict it appends to ``--output-file``):

- ``median_itl_ms`` / ``p99_itl_ms``: the gaps between one request's streamed tokens after its
  first, over every completed request (``itls += outputs[i].itl``); the ``sglang`` backend
  splits a chunk's gap over its new tokens (``adjust_itl = chunk_gap / num_new_tokens``), the
  ``sglang-oai`` backend does so (retokenised) only when the server reports a speculative
  ``accept_length`` (``avg_spec_accept_length`` of /get_server_info's ``internal_states``),
  else one gap per chunk.
- ``median_ttft_ms`` / ``p99_ttft_ms``: each request's time to its first token: its queueing
  and its prefill.
- ``median_tpot_ms``: ``(latency - ttft) / (output_len - 1)`` per request: its decode time per
  token, other requests' prefills that stalled it included.
- ``max_output_tokens_per_s``: the most output tokens in any one second of the run (1 s buckets
  of each token's time), its peak.

Decode throughput at steady state is ``streams * 1000 / median_itl_ms``, where ``streams`` is
the level's concurrency, at most the prompts sent and the server's ``max_running_requests``
(sglang queues the rest: their wait is in TTFT): the rate at which that many streams
decode together in a step no prefill falls in. A step that runs another request's prefill
(one per arriving request) is a long gap in the ITL tail (p99), not in its median while fewer
than half the steps carry one; ``output_throughput`` (all output over the whole run, the
ramp-up, the tail and every prefill included) reads lower. That is what public decode figures
measure (operations/reports/published.py: decode alone, prefill skipped). Where speculative decoding
served through ``sglang-oai`` with no accept length reported, a gap is one per chunk of
several tokens: the figure is then ``streams * 1000 / median_tpot_ms`` instead (``basis``
says which), per token but with the prefill stalls in.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Final

from operations.reports.published import Served, match

#: bench_serving's fields this module reads (each in its ``result``; bench_report keeps them).
FIELDS: Final = ("median_itl_ms", "p99_itl_ms", "median_ttft_ms", "p99_ttft_ms",
                 "median_tpot_ms", "p99_tpot_ms", "max_output_tokens_per_s", "accept_length",
                 "backend")


def served(versions: dict[str, Any], server: dict[str, Any], settings: Any = None) -> Served:
    """What was served: the card from bench_run.py's nvidia-smi (``versions``: ``gpu``,
    ``compute_cap``); the model from the host's settings (``model``: a repository id, which
    the server's ``model_path`` folder only ends in), else that folder; the tensor parallel
    size and the speculative algorithm from the server's own flags (bench_serving's
    ``server_info``, sglang's server_args: ``tp_size``, ``speculative_algorithm``; a sweep's
    value as served), else from the settings (``tensor_parallel_size``,
    ``speculative_algorithm`` where the settings have it)."""
    spec = (server["speculative_algorithm"] if "speculative_algorithm" in server
            else getattr(settings, "speculative_algorithm", None))
    return Served(gpu=versions.get("gpu"), compute_capability=versions.get("compute_cap"),
                  model=getattr(settings, "model", None) or server.get("model_path"),
                  tensor_parallel_size=server.get("tp_size")
                  or getattr(settings, "tensor_parallel_size", None),
                  speculative=spec)


def decode(bench: dict[str, Any] | None, concurrency: int, prompts: int,
           what: Served | None = None, running_limit: Any = None) -> dict[str, Any] | None:
    """One level's field figures (None where bench_serving wrote no result): ``tok_s`` (decode
    at steady state, see the module's docstring), ``per_stream_tok_s``, ``streams``,
    ``basis`` (``"itl"`` or ``"tpot"``), ``ttft_ms`` and ``itl_ms`` as ``{"p50", "p99"}``,
    ``peak_output_tok_s``, ``accept_length``, and ``published``: the published figure for the
    same card, model, tensor parallel size, speculative decoding and concurrency with its
    source and ``ratio`` (ours / theirs), or None where none is known. ``running_limit``: the
    server's max_running_requests (None or not a number: no limit known)."""
    if not bench:
        return None
    limits = [concurrency, prompts] + ([running_limit] if isinstance(running_limit, int)
                                       and running_limit > 0 else [])
    streams = max(min(limits), 1)
    per_token = (bench.get("backend") != "sglang-oai" or bench.get("accept_length")
                 or what is None or what.speculative is None)
    basis, gap = ("itl", bench.get("median_itl_ms")) if per_token else \
        ("tpot", bench.get("median_tpot_ms"))
    tok_s = streams * 1000 / gap if isinstance(gap, (int, float)) and gap > 0 else None
    found = match(what, concurrency) if what is not None else None
    published = None
    if found is not None:
        row, figure = found
        published = {"tok_s": figure, **{k: list(v) if isinstance(v, tuple) else v
                                          for k, v in asdict(row).items() if k != "tok_s"},
                     "ratio": None if tok_s is None else tok_s / figure}
    return {
        "tok_s": tok_s, "per_stream_tok_s": None if tok_s is None else tok_s / streams,
        "streams": streams, "basis": basis,
        "ttft_ms": {"p50": bench.get("median_ttft_ms"), "p99": bench.get("p99_ttft_ms")},
        "itl_ms": {"p50": bench.get("median_itl_ms"), "p99": bench.get("p99_itl_ms")},
        "peak_output_tok_s": bench.get("max_output_tokens_per_s"),
        "accept_length": bench.get("accept_length"),
        "published": published,
    }


def published_line(level: dict[str, Any]) -> str | None:
    """"c=64: 251.3 decode tok/s = 0.25 x the published 1010.6 (<where>, <page>; <launch>)", or
    None where no published figure matches the level."""
    d = level.get("decode") or {}
    p = d.get("published")
    if not p:
        return None
    ours = "-" if d.get("tok_s") is None else f"{d['tok_s']:.1f}"
    ratio = "" if p.get("ratio") is None else f" = {p['ratio']:.2f} x"
    return (f"concurrency {level['concurrency']}: {ours} decode tok/s{ratio} the published "
            f"{p['tok_s']:.1f} ({p['where']}; {p['source']}; {p['launch']}; {p['stack']})")
