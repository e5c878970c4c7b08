"""A torch workload with known phases, for the telemetry fixtures (tools/telemetry_capture.sh).

Phases, each with its start and end in UTC (ISO 8601, milliseconds) printed as JSON on stdout:
``idle`` (10 s, no kernel), ``large-gemm`` (15 s of 8192 x 8192 bf16 matrix products: the tensor
cores busy, power near its limit), ``tiny-gemm`` (15 s of 64 x 64 bf16 products one at a time:
a kernel always running, the SMs mostly idle, as small decode GEMMs leave them), ``idle-after``
(5 s).
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

import torch


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _loop(seconds: float, a: torch.Tensor, b: torch.Tensor, batch: int) -> int:
    count = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(batch):
            torch.matmul(a, b)
        torch.cuda.synchronize()
        count += batch
    return count


def main() -> None:
    phases = []
    dev = torch.device("cuda")
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    tiny = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()

    start = _now()
    time.sleep(10)
    phases.append({"phase": "idle", "start": start, "end": _now()})

    start = _now()
    n = _loop(15, big, big, 20)
    phases.append({"phase": "large-gemm", "start": start, "end": _now(), "gemms": n,
                   "shape": [8192, 8192, 8192], "dtype": "bfloat16"})

    start = _now()
    n = _loop(15, tiny, tiny, 2000)
    phases.append({"phase": "tiny-gemm", "start": start, "end": _now(), "gemms": n,
                   "shape": [64, 64, 64], "dtype": "bfloat16"})

    start = _now()
    time.sleep(5)
    phases.append({"phase": "idle-after", "start": start, "end": _now()})
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "phases": phases}, indent=1))


if __name__ == "__main__":
    main()
