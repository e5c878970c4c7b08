"""Run the P2P check's verification (peer copies and an NCCL all-reduce) under each NCCL
environment the P2P decision can give, with NCCL_DEBUG=INFO, to see which transport NCCL picks.

    python3 tools/nccl_env_probe.py [BYTES]

Environments: "on" (p2p_policy.BASE_ENV), "off" (p2p_policy.NO_P2P_ENV, the reference lab's
launch) and "off, P2P disabled" (NO_P2P_ENV plus NCCL_P2P_DISABLE=1: what NCCL is left with in a
VM whose GPUs cannot reach each other). NCCL_NVLS_ENABLE=0 always (the device tool's KINDS.md).
Prints one JSON line per environment; NCCL's own lines ("via P2P/...", "via SHM/...") go to
stderr. Meant for the lent multi-GPU machine (issue: P2P on a real multi-GPU host).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "operations" / "files"), str(ROOT / "operations")]

import p2p_check  # noqa: E402
import p2p_policy  # noqa: E402

DEBUG = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,P2P,SHM,NET"}
ENVS = {
    "on": dict(p2p_policy.BASE_ENV),
    "off": dict(p2p_policy.NO_P2P_ENV),
    "off, P2P disabled": {**p2p_policy.NO_P2P_ENV, "NCCL_P2P_DISABLE": "1"},
}


def main() -> int:
    nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else p2p_check.DEFAULT_BYTES
    gpus = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              check=True).stdout.splitlines())
    for name, env in ENVS.items():
        print(f"== {name}: {env}", file=sys.stderr, flush=True)
        result = p2p_check.verify(gpus, nbytes, 120, {**env, **DEBUG})
        print(json.dumps({"env": name, "verified": result["verified"],
                          "all_reduce": result["all_reduce"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
