"""sglang.bench_serving: sandbox stand-in (gpuhost sandbox lab) for SGLang 0.5.9's. Not SGLang.

Takes the real tool's arguments that gpuhost uses (names and defaults from the 0.5.9 wheel's
bench_serving.py; any other flag is refused, exit 2, as argparse does), loads the server over
HTTP as the real one does for ``--backend sglang-oai`` (streamed POST /v1/completions with
best_of, max_tokens, temperature 0, ignore_eos; ``Authorization: Bearer $OPENAI_API_KEY``) and
for ``--backend sglang`` (its async_request_sglang_generate: streamed POST /generate with text,
sampling_params max_new_tokens, temperature 0, ignore_eos; each chunk's text is the whole text so
far, its meta_info.completion_tokens the count),
``--max-concurrency`` requests at a time, after ``--warmup-requests``, and appends one JSON line
to ``--output-file`` with the real tool's ``result`` fields, computed as its calculate_metrics
does (TPOT = (latency - TTFT) / (output_len - 1); percentiles as numpy's, linear;
``max_output_tokens_per_s`` and ``max_concurrent_requests`` from 1 s buckets of each token's
time and each request's span; ``accept_length`` from /get_server_info's
``internal_states[0].avg_spec_accept_length`` for a backend named sglang*, and with it, for
sglang-oai, each chunk's gap split over its tokens). Prompts are words, not token ids: the
stand-in has no tokenizer (the folder must exist, as the real tool loads it); a chunk's tokens
are its words, as the stand-in server streams them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

BACKENDS = ("sglang", "sglang-native", "sglang-oai", "sglang-oai-chat", "vllm", "vllm-chat",
            "lmdeploy", "lmdeploy-chat", "trt", "gserver", "truss")
DATASETS = ("sharegpt", "custom", "openai", "random", "random-ids", "generated-shared-prefix",
            "mmmu", "image", "mooncake")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark the online serving throughput.")
    p.add_argument("--backend", choices=BACKENDS, default="sglang")
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int)
    p.add_argument("--dataset-name", choices=DATASETS, default="sharegpt")
    p.add_argument("--dataset-path", default="")
    p.add_argument("--model")
    p.add_argument("--served-model-name")
    p.add_argument("--tokenizer")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--output-file")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=1)
    return p


def percentile(values: list[float], q: float) -> float:
    """numpy.percentile's default (linear) method."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def std(values: list[float]) -> float:
    m = mean(values)
    return (sum((v - m) ** 2 for v in values) / len(values)) ** 0.5 if values else 0.0


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"


def tqdm_bar(n: int, total: int, elapsed: float) -> str:
    """One redraw of tqdm's default bar without a terminal (tqdm 4's format_meter: a 10-cell
    bar when the width is unknown, "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining},
    {rate_fmt}]"), which the real tool draws with ``tqdm(total=len(input_requests))``."""
    frac = n / total if total else 0.0
    cells = frac * 10
    bar = "\u2588" * int(cells)
    if int(cells) < 10:
        part = int((cells - int(cells)) * 8)
        bar += (" \u258f\u258e\u258d\u258c\u258b\u258a\u2589"[part]).ljust(10 - int(cells))
    rate = n / elapsed if elapsed > 0 and n else None
    remaining = _clock((total - n) / rate) if rate else "?"
    rate_fmt = "?it/s" if rate is None else (f"{rate:5.2f}it/s" if rate >= 1
                                              else f"{1 / rate:5.2f}s/it")
    return f"{frac * 100:3.0f}%|{bar}| {n}/{total} [{_clock(elapsed)}<{remaining}, {rate_fmt}]"


def headers() -> dict:
    h = {"Content-Type": "application/json"}
    key = os.environ.get("OPENAI_API_KEY")
    if key:
        h["Authorization"] = f"Bearer {key}"
    elif os.environ.get("API_KEY"):
        h["Authorization"] = os.environ["API_KEY"]
    return h


def one_request(url: str, model: str, prompt: str, output_len: int, ignore_eos: bool) -> dict:
    payload = {"model": model, "prompt": prompt, "best_of": 1, "max_tokens": output_len,
               "stream": True, "temperature": 0.0, "ignore_eos": ignore_eos}
    out = {"success": False, "ttft": 0.0, "itl": [], "latency": 0.0, "output_len": 0,
           "text": "", "error": "", "start": time.perf_counter(), "chunks": []}
    st = out["start"]
    recent = st
    try:
        request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                         headers=headers())
        with urllib.request.urlopen(request, timeout=600) as response:
            for raw in response:
                line = raw.strip()
                if not line:
                    continue
                chunk = line.decode().removeprefix("data: ")
                latency = time.perf_counter() - st
                if chunk == "[DONE]":
                    continue
                data = json.loads(chunk)
                text = data["choices"][0]["text"]
                if text:
                    now = time.perf_counter()
                    if out["ttft"] == 0.0:
                        out["ttft"] = now - st
                    else:
                        out["itl"].append(now - recent)
                        out["chunks"].append(text)
                    recent = now
                    out["text"] += text
                    out["output_len"] = (data.get("usage") or {}).get("completion_tokens",
                                                                      output_len)
            out.update(success=True, latency=latency)
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        out["error"] = str(exc)
    return out


def one_generate(url: str, model: str, prompt: str, output_len: int, ignore_eos: bool) -> dict:
    """One request of the real tool's ``sglang`` backend (async_request_sglang_generate)."""
    payload = {"text": prompt,
               "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len,
                                   "ignore_eos": ignore_eos},
               "stream": True, "lora_path": None, "return_logprob": False,
               "return_routed_experts": False, "logprob_start_len": -1}
    out = {"success": False, "ttft": 0.0, "itl": [], "latency": 0.0, "output_len": output_len,
           "text": "", "error": "", "start": time.perf_counter()}
    st = recent = out["start"]
    last = 0
    try:
        request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                         headers=headers())
        with urllib.request.urlopen(request, timeout=600) as response:
            for raw in response:
                chunk = raw.strip().decode().removeprefix("data: ")
                if not chunk:
                    continue
                latency = time.perf_counter() - st
                if chunk == "[DONE]":
                    continue
                data = json.loads(chunk)
                if data.get("text"):
                    now = time.perf_counter()
                    out["text"] = data["text"]
                    out["output_len"] = data["meta_info"]["completion_tokens"]
                    if out["ttft"] == 0.0:
                        out["ttft"] = now - st
                    else:
                        new = out["output_len"] - last
                        if new == 0:
                            continue
                        out["itl"] += [(now - recent) / new] * new
                    recent, last = now, out["output_len"]
            out.update(success=True, latency=latency)
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        out["error"] = str(exc)
    return out


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.backend not in ("sglang-oai", "sglang") or args.dataset_name != "random-ids":
        print("sandbox stand-in: only --backend sglang-oai or sglang with --dataset-name "
              "random-ids", file=sys.stderr)
        return 2
    tokenizer = args.tokenizer or args.model
    if tokenizer and tokenizer.startswith("/") and not os.path.isdir(tokenizer):
        print(f"OSError: Can't load tokenizer for '{tokenizer}'.", file=sys.stderr)
        return 1
    base = args.base_url or f"http://{args.host}:{args.port or 30000}"
    url = f"{base}/generate" if args.backend == "sglang" else f"{base}/v1/completions"
    request = one_generate if args.backend == "sglang" else one_request
    model = args.served_model_name or args.model
    print(f"Namespace({', '.join(f'{k}={v!r}' for k, v in vars(args).items())})")
    print(f"#Input tokens: {args.num_prompts * args.random_input_len}")
    print(f"#Output tokens: {args.num_prompts * args.random_output_len}")
    prompt = " ".join(["hello"] * args.random_input_len)
    ignore_eos = not args.disable_ignore_eos
    print(f"Starting warmup with {args.warmup_requests} sequences...")
    with ThreadPoolExecutor(max_workers=max(args.warmup_requests, 1)) as pool:
        warm = list(pool.map(lambda _: request(url, model, prompt, 16, ignore_eos),
                             range(args.warmup_requests)))
    if args.warmup_requests > 0 and not any(w["success"] for w in warm):
        print("ValueError: Warmup failed - Please make sure benchmark arguments are correctly "
              f"specified. Error: {warm[0]['error']}")
        return 1
    print(f"Warmup completed with {args.warmup_requests} sequences. "
          "Starting main benchmark run...")
    concurrency = args.max_concurrency or args.num_prompts
    lock = threading.Lock()
    outputs: list[dict] = []
    start = time.perf_counter()

    def draw():
        if not args.disable_tqdm:
            sys.stderr.write("\r" + tqdm_bar(len(outputs), args.num_prompts,
                                              time.perf_counter() - start))
            sys.stderr.flush()

    def run(_):
        result = request(url, model, prompt, args.random_output_len, ignore_eos)
        with lock:
            outputs.append(result)
            draw()

    draw()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(run, range(args.num_prompts)))
    if not args.disable_tqdm:
        sys.stderr.write("\n")
    info = server_info(base)
    accept_length = spec_accept_length(info) if "sglang" in args.backend else None
    duration = time.perf_counter() - start
    done = [o for o in outputs if o["success"]]
    output_lens = [o["output_len"] for o in done]
    ttfts = [o["ttft"] for o in done]
    e2e = [o["latency"] for o in done]
    tpots = [(o["latency"] - o["ttft"]) / (o["output_len"] - 1) for o in done
             if o["output_len"] > 1]
    if accept_length and args.backend == "sglang-oai":
        itls = [gap / n for o in done for gap, text in zip(o["itl"], o["chunks"])
                for n in [max(len(text.split()), 1)] for _ in range(n)]
    else:
        itls = [v for o in done for v in o["itl"]]
    peak_tok_s, peak_requests = peaks(done)
    total_input = len(done) * args.random_input_len
    ms = 1000
    result = {
        "tag": None, "backend": args.backend, "dataset_name": args.dataset_name,
        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "sharegpt_output_len": None, "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "server_info": info,
        "duration": duration, "completed": len(done), "total_input_tokens": total_input,
        "total_input_text_tokens": total_input, "total_input_vision_tokens": 0,
        "total_output_tokens": sum(output_lens),
        "total_output_tokens_retokenized": sum(output_lens),
        "request_throughput": len(done) / duration,
        "input_throughput": total_input / duration,
        "output_throughput": sum(output_lens) / duration,
        "total_throughput": (total_input + sum(output_lens)) / duration,
        "mean_e2e_latency_ms": mean(e2e) * ms, "median_e2e_latency_ms": percentile(e2e, 50) * ms,
        "std_e2e_latency_ms": std(e2e) * ms, "p90_e2e_latency_ms": percentile(e2e, 90) * ms,
        "p99_e2e_latency_ms": percentile(e2e, 99) * ms,
        "mean_ttft_ms": mean(ttfts) * ms, "median_ttft_ms": percentile(ttfts, 50) * ms,
        "std_ttft_ms": std(ttfts) * ms, "p99_ttft_ms": percentile(ttfts, 99) * ms,
        "mean_tpot_ms": mean(tpots) * ms, "median_tpot_ms": percentile(tpots, 50) * ms,
        "std_tpot_ms": std(tpots) * ms, "p99_tpot_ms": percentile(tpots, 99) * ms,
        "mean_itl_ms": mean(itls) * ms, "median_itl_ms": percentile(itls, 50) * ms,
        "std_itl_ms": std(itls) * ms, "p95_itl_ms": percentile(itls, 95) * ms,
        "p99_itl_ms": percentile(itls, 99) * ms,
        "concurrency": sum(e2e) / duration, "accept_length": accept_length,
        "max_output_tokens_per_s": peak_tok_s, "max_concurrent_requests": peak_requests,
    }
    print("============ Serving Benchmark Result ============")
    print("{:<40} {:<10}".format("Successful requests:", len(done)))
    print("{:<40} {:<10.2f}".format("Output token throughput (tok/s):",
                                    result["output_throughput"]))
    print("{:<40} {:<10.2f}".format("Median TTFT (ms):", result["median_ttft_ms"]))
    print("=" * 50)
    if not done:
        print(f"Error running benchmark for request rate: {args.request_rate}")
        return 1
    name = args.output_file or f"{args.backend}_{args.num_prompts}.jsonl"
    with open(name, "a") as fh:
        fh.write(json.dumps(result) + "\n")
    return 0


def peaks(done: list[dict]) -> tuple[float, int]:
    """The real calculate_metrics' peaks: output tokens (first at start + TTFT, each next one
    ITL later) and requests in flight, counted in 1 s buckets from the first request's start;
    the most of each (0.0 and 0 when none completed)."""
    if not done:
        return 0.0, 0
    first = min(o["start"] for o in done)
    buckets = int(math.ceil(max(o["start"] + o["latency"] for o in done) - first)) + 1
    tokens, requests = [0] * buckets, [0] * buckets
    for o in done:
        at = o["start"] + o["ttft"]
        for gap in [0.0, *o["itl"]]:
            at += gap
            if 0 <= int(at - first) < buckets:
                tokens[int(at - first)] += 1
        for second in range(int(o["start"] - first),
                            min(int(o["start"] + o["latency"] - first) + 1, buckets)):
            requests[second] += 1
    return float(max(tokens)), max(requests)


def spec_accept_length(info):
    """As the real benchmark() reads it: a disaggregated server's first decode entry, then
    ``internal_states[0]["avg_spec_accept_length"]`` (sglang's scheduler sets it only while
    speculative decoding runs); None otherwise."""
    if not isinstance(info, dict):
        return None
    if "decode" in info:
        info = info["decode"][0]
    states = info.get("internal_states")
    return states[0].get("avg_spec_accept_length") if states else None


def server_info(base: str):
    try:
        request = urllib.request.Request(f"{base}/get_server_info", headers=headers())
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
