"""Measure P2P between the host's GPUs and write the decision for the server.

Runs on the GPU host, in the ML venv's python, beside nvsmi.py and p2p_policy.py (shipped by
gpuhost's p2p stage). Reads ``nvidia-smi topo -p2p r`` and ``w``, decides with p2p_policy, and
writes the systemd environment file and a JSON record of what it measured on (driver version,
GPU UUIDs) so the deploy measures again only when those change.

Exit status: 0 with the decision on stdout; 2 when nvidia-smi's output does not parse (the
message names the command and the first bad line).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import nvsmi  # noqa: E402
import p2p_policy  # noqa: E402


def _run(*args: str) -> list[str]:
    result = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise nvsmi.ParseError(
            f"nvidia-smi {' '.join(args)} exited with {result.returncode}: "
            f"{(result.stdout + result.stderr).strip()}"
        )
    return result.stdout.splitlines()


def _write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--override", choices=("on", "off"))
    parser.add_argument("--env-file", type=Path, required=True)
    parser.add_argument("--record", type=Path, required=True)
    args = parser.parse_args()

    try:
        gpus = nvsmi.parse_query_gpu(
            _run(f"--query-gpu={','.join(nvsmi.QUERY_FIELDS)}", "--format=csv,noheader,nounits")
        )
        read = nvsmi.parse_p2p_matrix(_run("topo", "-p2p", "r"), "nvidia-smi topo -p2p r")
        write = nvsmi.parse_p2p_matrix(_run("topo", "-p2p", "w"), "nvidia-smi topo -p2p w")
    except nvsmi.ParseError as exc:
        print(f"P2P check: {exc}", file=sys.stderr)
        return 2

    decision = p2p_policy.decide(
        [list(r) for r in read.cells], [list(w) for w in write.cells], None, args.override
    )
    policy = Path(p2p_policy.__file__).read_bytes()
    record = {
        "measured_on": {
            "driver_version": gpus[0].driver_version if gpus else None,
            "gpu_uuids": [g.uuid for g in gpus],
        },
        "override": args.override,
        "policy_sha256": hashlib.sha256(policy).hexdigest(),
        "p2p_read": [list(r) for r in read.cells],
        "p2p_write": [list(w) for w in write.cells],
        "decision": decision.to_json(),
    }
    _write(args.env_file, p2p_policy.env_file(decision), 0o644)
    _write(args.record, json.dumps(record, indent=2) + "\n", 0o644)
    print(f"P2P {decision.p2p}: {decision.reason}")
    for key, value in sorted(decision.env.items()):
        print(f"  {key}={value}")
    for flag in decision.server_args:
        print(f"  server flag {flag}")
    for warning in decision.warnings:
        print(f"WARNING: {warning}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
