"""Exercise the P2P check's torch calls on a GPU machine, also with one GPU (where the check
itself has no pairs and never imports torch): a copy into a -1 buffer compared with torch.equal,
a corrupted byte caught, the copies child, a one-rank NCCL all-reduce through
torch.distributed, and nvidia-smi --query-compute-apps seeing this process.

    python tools/p2p_torch_probe.py        # from the repository root, in a python with torch

Read on the lent H200 (torch 2.11.0+cu130, driver 580.159.04), 2026-11-29:

    torch 2.11.0+cu130 devices 1
    copy 0.004009203000002515 equal True peer(0,0) False
    equal after corruption False
    copies child True [{"ok": true, "device_count": 1, "torch": "2.11.0+cu130", "pairs": []}]
    all-reduce 1 rank True [{"rank": 0, "intact": true, "seconds": 0.000268..., "bytes": 67108864}]
    gpu users ['411 python3']
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operations" / "files"))

import p2p_check as c

if __name__ == "__main__":
    import torch

    print("torch", torch.__version__, "devices", torch.cuda.device_count())
    numel = c.DEFAULT_BYTES // 4
    src = torch.arange(1000, 1000 + numel, dtype=torch.int32, device="cuda:0")
    expected = torch.arange(1000, 1000 + numel, dtype=torch.int32, device="cuda:0")
    dst = torch.full((numel,), -1, dtype=torch.int32, device="cuda:0")
    torch.cuda.synchronize(0)
    began = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize(0)
    print("copy", time.perf_counter() - began, "equal", torch.equal(dst, expected),
          "peer(0,0)", torch.cuda.can_device_access_peer(0, 0))
    dst[5] = 7
    print("equal after corruption", torch.equal(dst, expected))
    results, finished = c._run_children([(c._copies_child, (c.DEFAULT_BYTES,))], 120)
    print("copies child", finished, json.dumps(results))
    env = {"NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    results, finished = c._run_children(
        [(c._all_reduce_child, (0, 1, c._free_port(), c.DEFAULT_BYTES, 60, env))], 120)
    print("all-reduce 1 rank", finished, json.dumps(results))
    print("gpu users", c.gpu_users())
