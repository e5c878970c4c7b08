"""An NCCL all-reduce across the nodes of one server, before it starts: one process per GPU on
every node, all in one process group, the sum compared and the bandwidth printed.

Runs on each node at once (gpuhost's group restart runs it on every node in the same pyinfra
operation, with every server stopped), in the ML venv's python, beside p2p_check.py (whose
child runner it uses). Global rank = node rank x GPUs per node + local GPU index; rank 0 (node
0, GPU 0) listens at ``--dist-init-addr`` as torch.distributed's TCPStore does, the others
connect. The NCCL environment is the server's: the environment files given with ``--env-file``
(p2p.env, then nodes.env, as the unit reads them), plus NCCL_NVLS_ENABLE=0 as in p2p_check.py.
Each rank contributes rank + 1; the sum must be n(n + 1)/2. Bandwidths as nccl-tests counts
them: algorithm = bytes / seconds, bus = algorithm x 2(n - 1)/n (nccl-tests, PERFORMANCE.md).

Exit status: 0 intact (one line with the bandwidths); 1 a wrong sum, a rank's error, or no
answer within ``--timeout`` seconds (the line says which).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "facts"), str(HERE.parent / "plans")]

from p2p_check import DEFAULT_BYTES, _run_children  # noqa: E402


def read_env_files(paths: list[Path]) -> dict[str, str]:
    """KEY=VALUE lines of systemd EnvironmentFiles (comments and blank lines skipped), later
    files winning, as systemd reads them in order."""
    env: dict[str, str] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith(("#", ";")) and "=" in line:
                key, _, value = line.partition("=")
                env[key.strip()] = value.strip()
    return env


def _child(rank: int, local: int, world: int, init: str, nbytes: int, timeout: float,
           env: dict[str, str], out) -> None:
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(local)
        dist.init_process_group("nccl", init_method=f"tcp://{init}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout),
                                device_id=torch.device("cuda", local))
        expected = world * (world + 1) / 2
        intact, seconds = True, 0.0
        for numel in (1024, nbytes // 4):
            t = torch.full((numel,), float(rank + 1), dtype=torch.float32,
                           device=f"cuda:{local}")
            torch.cuda.synchronize(local)
            began = time.perf_counter()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            torch.cuda.synchronize(local)
            seconds = time.perf_counter() - began
            intact = intact and bool((t == expected).all().item())
        dist.destroy_process_group()
        out.put({"rank": rank, "intact": intact, "seconds": seconds, "bytes": (nbytes // 4) * 4})
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def check(nnodes: int, node_rank: int, gpus: int, init: str, nbytes: int, timeout: float,
          env: dict[str, str]) -> tuple[bool, str]:
    """Run this node's ranks; returns whether the all-reduce was intact and the line to print."""
    world = nnodes * gpus
    targets = [(_child, (node_rank * gpus + g, g, world, init, nbytes, timeout, env))
               for g in range(gpus)]
    results, finished = _run_children(targets, timeout + 30)
    what = f"NCCL all-reduce across {nnodes} nodes ({world} GPUs, this node rank {node_rank})"
    errors = sorted((r["rank"], r["error"]) for r in results if "error" in r)
    if not finished:
        return False, f"{what}: no answer within {timeout:g} s (a node missing or unreachable)"
    if errors:
        return False, f"{what}: failed: rank {errors[0][0]}: {errors[0][1]}"
    if not all(r["intact"] for r in results):
        return False, f"{what}: the sum arrived wrong (expected {world * (world + 1) // 2})"
    seconds = max(r["seconds"] for r in results)
    algbw = results[0]["bytes"] / seconds / 1e9
    return True, (f"{what}: intact, {results[0]['bytes'] / 2**20:.0f} MiB in {seconds:.4f} s: "
                  f"algorithm bandwidth {algbw:.2f} GB/s, bus bandwidth "
                  f"{algbw * 2 * (world - 1) / world:.2f} GB/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--gpus", type=int, required=True, help="GPUs on each node")
    parser.add_argument("--dist-init-addr", required=True, help="rank 0's HOST:PORT")
    parser.add_argument("--env-file", type=Path, action="append", default=[])
    parser.add_argument("--bytes", type=int, default=DEFAULT_BYTES)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    env = {**read_env_files(args.env_file), "NCCL_NVLS_ENABLE": "0"}
    ok, line = check(args.nnodes, args.node_rank, args.gpus, args.dist_init_addr,
                     max(4, args.bytes), args.timeout, env)
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
