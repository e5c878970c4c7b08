#!/bin/bash
# On a GPU machine without sglang, give operations/files/bench_run.py this as its --python:
# "-c" (the versions) goes to python3; "-m sglang.bench_serving ..." runs 8 s of
# torch matmuls (64^3 bf16 one at a time at --max-concurrency 1, 8192^3 above) between
# bench_serving's own "Warmup completed" and result lines, and writes a result line to
# --output-file (tests/fixtures/h200-device/bench-run/README.md).
if [ "$1" = "-c" ]; then exec python3 "$@"; fi
out=""; c=1
while [ $# -gt 0 ]; do case "$1" in --output-file) out=$2; shift;; --max-concurrency) c=$2; shift;; esac; shift; done
echo "Starting warmup with 1 sequences..."
sleep 2
echo "Warmup completed with 1 sequences. Starting main benchmark run..."
python3 - "$c" <<'PY'
import sys, time, torch
n = 8192 if int(sys.argv[1]) > 1 else 64
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
end = time.monotonic() + 8
while time.monotonic() < end:
    for _ in range(20 if n > 64 else 2000):
        torch.matmul(a, a)
    torch.cuda.synchronize()
PY
echo "============ Serving Benchmark Result ============"
echo '{"max_concurrency": '$c', "completed": 8, "duration": 8.0, "output_throughput": 100.0, "total_throughput": 200.0, "request_throughput": 1.0, "median_ttft_ms": 1.0, "p99_ttft_ms": 1.0, "median_tpot_ms": 1.0, "p99_tpot_ms": 1.0, "median_itl_ms": 1.0, "p99_itl_ms": 1.0, "server_info": null}' >> "$out"
