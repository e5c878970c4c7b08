"""Measure and verify P2P between the host's GPUs, and write the decision for the server.

Runs on the GPU host in the ML venv's python (torch), beside nvsmi.py and p2p_policy.py (gpuhost's
p2p stage ships all three to /opt/gpuhost/lib; in a checkout they are found in operations/):

1. reads ``nvidia-smi --query-gpu``, ``nvidia-smi topo -m`` and ``nvidia-smi topo -p2p r`` / ``w``;
2. write-and-verify: for every ordered GPU pair (i, j) for which
   ``torch.cuda.can_device_access_peer(i, j)`` is true, copies a known pattern (a counting
   sequence of int32, ``--bytes`` long, different for every pair) from GPU i into a buffer on
   GPU j filled with -1, and compares it on arrival with the same pattern made on GPU j; the
   timed copy is the second of two (the first enables peer access), in seconds and GB/s
   (10^9 bytes per second);
3. an all-reduce (sum) over every GPU through NCCL: one process per GPU (torch.distributed,
   backend nccl, NCCL_NVLS_ENABLE=0 and the NCCL settings the reported status gives), each
   contributing rank + 1, compared with n(n + 1)/2; algorithm and bus bandwidth in GB/s as
   nccl-tests counts them (bus = algorithm x 2(n-1)/n);
4. decides with p2p_policy.decide (verified: every copy and the all-reduce arrived intact);
5. with ``--env-file`` and ``--record``, writes the systemd environment file and a JSON record
   of what was measured on what (driver version, GPU UUIDs, policy and check sha256).

Steps 2 and 3 run in child processes killed after ``--timeout`` seconds: a peer copy or an
all-reduce that hangs counts as failed. One GPU: "no pairs", nothing to verify, exit 0.

Exit status: 0 with the decision printed (and written); 2 when nvidia-smi fails or its output
does not parse (the message names the command and the first bad line); 3 when torch cannot
reach the GPUs; 4 when processes hold the GPUs (stop the server first).

Run by hand on any GPU machine with torch, from a checkout (writes nothing without the file
options): ``python operations/files/p2p_check.py [--json]``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import multiprocessing
import os
import queue
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# shipped side by side; in a checkout, operations/facts and operations/plans hold them
sys.path[:0] = [str(HERE), str(HERE.parent / "facts"), str(HERE.parent / "plans")]

import nvsmi
import p2p_policy

#: Pattern size per copy and all-reduce buffer: 64 MiB, large enough for a bandwidth figure,
#: small enough for 56 ordered pairs of 8 GPUs in a few seconds.
DEFAULT_BYTES = 64 * 2**20
#: Seconds a child (the peer copies, or the all-reduce with NCCL's set-up) may take.
DEFAULT_TIMEOUT = 120.0


class CheckError(Exception):
    """The check cannot run; ``status`` is the exit status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _smi(*args: str) -> list[str]:
    command = f"nvidia-smi {' '.join(args)}"
    try:
        result = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True,
                                check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise nvsmi.ParseError(f"{command}: {exc}") from None
    if result.returncode != 0:
        raise nvsmi.ParseError(
            f"{command} exited with {result.returncode}: {(result.stdout + result.stderr).strip()}"
        )
    return result.stdout.splitlines()


def gpu_users() -> list[str]:
    """Processes holding a GPU (``nvidia-smi --query-compute-apps``), as "pid name" strings;
    empty where the tool cannot say."""
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"],
            capture_output=True, text=True, check=False, timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if result.returncode != 0:
        return []
    return [" ".join(p.strip() for p in line.split(",")) for line in result.stdout.splitlines()
            if line.strip() and "No running" not in line]


# --- children ------------------------------------------------------------------------------------

def _copies_child(nbytes: int, out) -> None:
    """Every ordered pair with peer access: pattern from GPU i to GPU j, compared on arrival."""
    try:
        import torch

        n = torch.cuda.device_count()
        numel = nbytes // 4
        pairs = []
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                entry = {"src": i, "dst": j, "bytes": numel * 4}
                if not torch.cuda.can_device_access_peer(i, j):
                    pairs.append({**entry, "peer_access": False, "intact": None,
                                  "seconds": None, "gb_per_s": None})
                    continue
                start_value = 1000 * (i * n + j + 1)
                src = torch.arange(start_value, start_value + numel, dtype=torch.int32,
                                   device=f"cuda:{i}")
                expected = torch.arange(start_value, start_value + numel, dtype=torch.int32,
                                        device=f"cuda:{j}")
                intact, seconds = True, None
                for _ in range(2):  # the first copy enables peer access; the second is timed
                    dst = torch.full((numel,), -1, dtype=torch.int32, device=f"cuda:{j}")
                    torch.cuda.synchronize(i)
                    torch.cuda.synchronize(j)
                    began = time.perf_counter()
                    dst.copy_(src)
                    torch.cuda.synchronize(j)
                    seconds = time.perf_counter() - began
                    intact = intact and bool(torch.equal(dst, expected))
                pairs.append({**entry, "peer_access": True, "intact": intact,
                              "seconds": round(seconds, 6),
                              "gb_per_s": round(numel * 4 / seconds / 1e9, 2)})
                del src, dst, expected
        out.put({"ok": True, "device_count": n, "torch": torch.__version__, "pairs": pairs})
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which says what failed
        out.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def _all_reduce_child(rank: int, world: int, port: int, nbytes: int, timeout: float,
                      env: dict[str, str], out) -> None:
    """One rank of the NCCL all-reduce: a warm-up (NCCL's set-up), then the timed one."""
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=timeout), device_id=torch.device("cuda", rank),
        )
        expected = world * (world + 1) / 2
        intact, seconds = True, 0.0
        for numel in (1024, nbytes // 4):
            t = torch.full((numel,), float(rank + 1), dtype=torch.float32, device=f"cuda:{rank}")
            torch.cuda.synchronize(rank)
            began = time.perf_counter()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            torch.cuda.synchronize(rank)
            seconds = time.perf_counter() - began
            intact = intact and bool((t == expected).all().item())
        dist.destroy_process_group()
        out.put({"rank": rank, "intact": intact, "seconds": seconds, "bytes": (nbytes // 4) * 4})
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_children(targets: list[tuple], timeout: float) -> tuple[list[dict], bool]:
    """Start one spawned process per (function, args); gather one result each. Returns the
    results and whether every child answered within ``timeout`` seconds (the rest are killed)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, out), daemon=True) for fn, args in targets]
    for p in procs:
        p.start()
    results: list[dict] = []
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            results.append(out.get(timeout=min(left, 1.0)))
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and out.empty():
                break
    for p in procs:
        p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join()
    return results, len(results) == len(procs)


# --- the check -----------------------------------------------------------------------------------

def verify(gpu_count: int, nbytes: int, timeout: float, nccl_env: dict[str, str]) -> dict:
    """Steps 2 and 3 (module docstring). Returns ``{"verified": True | False | None, "torch":
    version, "pairs": [...], "all_reduce": {...}}``; None with one GPU (no pairs).

    Raises :class:`CheckError` (status 3) when torch cannot reach the GPUs or counts a different
    number of them than nvidia-smi.
    """
    if gpu_count < 2:
        return {"verified": None, "pairs": [], "all_reduce": None}
    results, finished = _run_children([(_copies_child, (nbytes,))], timeout)
    if not finished:
        return {"verified": False, "pairs": [], "all_reduce": None,
                "failure": f"the peer copies did not finish within {timeout:g} s (hung or died)"}
    copies = results[0]
    if not copies.get("ok"):
        raise CheckError(f"torch cannot reach the GPUs: {copies.get('error')}", 3)
    if copies["device_count"] != gpu_count:
        raise CheckError(
            f"torch sees {copies['device_count']} GPU(s), nvidia-smi {gpu_count} "
            "(CUDA_VISIBLE_DEVICES set?)", 3,
        )
    env = {**nccl_env, "NCCL_NVLS_ENABLE": "0"}
    port = _free_port()
    ranks, finished = _run_children(
        [(_all_reduce_child, (r, gpu_count, port, nbytes, timeout, env)) for r in range(gpu_count)],
        timeout,
    )
    errors = sorted(f"rank {r['rank']}: {r['error']}" for r in ranks if "error" in r)
    done = [r for r in ranks if "error" not in r]
    reduce: dict = {"gpus": gpu_count, "env": env, "expected": gpu_count * (gpu_count + 1) / 2}
    if not finished:
        reduce.update(intact=False, failure=f"did not finish within {timeout:g} s", errors=errors)
    elif errors:
        reduce.update(intact=False, failure=errors[0], errors=errors)
    else:
        seconds = max(r["seconds"] for r in done)
        algbw = done[0]["bytes"] / seconds / 1e9
        reduce.update(intact=all(r["intact"] for r in done), seconds=round(seconds, 6),
                      bytes=done[0]["bytes"], algbw_gb_per_s=round(algbw, 2),
                      busbw_gb_per_s=round(algbw * 2 * (gpu_count - 1) / gpu_count, 2))
    tested = [p for p in copies["pairs"] if p["peer_access"]]
    verified = all(p["intact"] for p in tested) and reduce["intact"]
    return {"verified": verified, "torch": copies["torch"], "pairs": copies["pairs"],
            "all_reduce": reduce}


def pairs_line(pairs: list[dict]) -> str:
    """Every GPU pair in one line (the record keeps each pair's copy: its ``pairs``): how many
    were copied intact and how fast, each pair whose copy arrived wrong by name, how many report
    no peer access. 8 GPUs are 56 ordered pairs: a line each buried the decision (issue 42)."""
    copied = [p for p in pairs if p["peer_access"]]
    wrong = [f"GPU{p['src']} -> GPU{p['dst']}" for p in copied if not p["intact"]]
    intact = [p for p in copied if p["intact"]]
    parts = []
    if intact:
        rates = sorted(p["gb_per_s"] for p in intact)
        parts.append(f"{len(intact)} peer copies of {intact[0]['bytes'] // 2**20} MiB intact, "
                     f"{rates[0]} to {rates[-1]} GB/s")
    if wrong:
        parts.append(f"{len(wrong)} WRONG DATA on arrival: {', '.join(wrong)}")
    if len(copied) < len(pairs):
        parts.append(f"{len(pairs) - len(copied)} with no peer access reported, not copied")
    return f"{len(pairs)} GPU pairs: {'; '.join(parts)} (each pair: the record's pairs)"


def summary(record: dict) -> list[str]:
    """The record in lines for people: the pairs in one line, the all-reduce, the decision,
    warnings."""
    lines = []
    gpus = len(record["measured_on"]["gpu_uuids"])
    result = record["verification"]
    if gpus < 2:
        lines.append("one GPU: no pairs, nothing to verify")
    if result.get("pairs"):
        lines.append(pairs_line(result["pairs"]))
    if result.get("failure"):
        lines.append(f"verification failed: {result['failure']}")
    reduce = result.get("all_reduce")
    if reduce:
        if reduce.get("failure"):
            lines.append(f"NCCL all-reduce over {reduce['gpus']} GPUs FAILED: {reduce['failure']}")
        else:
            state = "intact" if reduce["intact"] else "WRONG SUM"
            lines.append(f"NCCL all-reduce over {reduce['gpus']} GPUs of {reduce['bytes'] // 2**20} "
                         f"MiB {state}, {reduce['seconds']:.6f} s, algbw "
                         f"{reduce['algbw_gb_per_s']} GB/s, busbw {reduce['busbw_gb_per_s']} GB/s")
    decision = record["decision"]
    lines.append(f"P2P {decision['p2p']}: {decision['reason']}")
    lines += [f"  {k}={v}" for k, v in sorted(decision["env"].items())]
    lines += [f"  server flag {flag}" for flag in decision["server_args"]]
    lines += [f"WARNING: {w}" for w in decision["warnings"]]
    return lines


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def measure(override: str | None, nbytes: int, timeout: float) -> dict:
    """Steps 1 to 4: the record (what main writes). Raises nvsmi.ParseError and CheckError."""
    gpus = nvsmi.parse_query_gpu(
        _smi(f"--query-gpu={','.join(nvsmi.QUERY_FIELDS)}", "--format=csv,noheader,nounits")
    )
    topology = nvsmi.parse_topology(_smi("topo", "-m"))
    read = nvsmi.parse_p2p_matrix(_smi("topo", "-p2p", "r"), "nvidia-smi topo -p2p r")
    write = nvsmi.parse_p2p_matrix(_smi("topo", "-p2p", "w"), "nvidia-smi topo -p2p w")
    read_cells = [list(r) for r in read.cells]
    write_cells = [list(w) for w in write.cells]
    if len(read_cells) != len(gpus):
        raise nvsmi.ParseError(f"nvidia-smi topo -p2p r: {len(read_cells)} GPUs, --query-gpu "
                               f"lists {len(gpus)}")
    users = gpu_users()
    if users:
        raise CheckError(f"processes hold the GPUs ({'; '.join(users)}): stop them (the "
                         "server: systemctl stop sglang.service) and measure again", 4)
    reported = p2p_policy.decide(read_cells, write_cells, None, None)
    result = verify(len(gpus), nbytes, timeout, reported.env)
    decision = p2p_policy.decide(read_cells, write_cells, result["verified"], override)
    return {
        "measured_on": {
            "driver_version": gpus[0].driver_version if gpus else None,
            "gpu_uuids": [g.uuid for g in gpus],
        },
        "override": override,
        "policy_sha256": _sha256(Path(p2p_policy.__file__)),
        "check_sha256": _sha256(Path(__file__)),
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "topology": [list(r) for r in topology.links.cells],
        "p2p_read": read_cells,
        "p2p_write": write_cells,
        "verification": result,
        "decision": decision.to_json(),
    }


def main(argv: list[str] | None = None) -> int:
    # what it makes is readable by the model copy user and operators whatever root's umask
    # (a hardened host's 077, from pam_umask and the profile): files 0644, folders 0755
    os.umask(0o022)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--override", choices=("on", "off"),
                        help="gpuhost_p2p_override: force the decision, with a warning")
    parser.add_argument("--env-file", type=Path, help="write the systemd environment file here")
    parser.add_argument("--record", type=Path, help="write the JSON record here")
    parser.add_argument("--bytes", type=int, default=DEFAULT_BYTES,
                        help=f"bytes per copy and all-reduce (default {DEFAULT_BYTES})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds for the copies, and for the all-reduce (default "
                             f"{DEFAULT_TIMEOUT:g})")
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    args = parser.parse_args(argv)
    try:
        record = measure(args.override, max(4, args.bytes), args.timeout)
    except nvsmi.ParseError as exc:
        print(f"P2P check: {exc}", file=sys.stderr)
        return 2
    except CheckError as exc:
        print(f"P2P check: {exc}", file=sys.stderr)
        return exc.status
    record["summary"] = summary(record)
    decision = p2p_policy.Decision(**{**record["decision"],
                                      "server_args": tuple(record["decision"]["server_args"]),
                                      "warnings": tuple(record["decision"]["warnings"])})
    if args.env_file:
        _write(args.env_file, p2p_policy.env_file(decision), 0o644)
    if args.record:
        _write(args.record, json.dumps(record, indent=2) + "\n", 0o644)
    print(json.dumps(record, indent=2) if args.json else "\n".join(record["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
