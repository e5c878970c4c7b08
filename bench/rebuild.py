"""Rebuilding a fresh host on the sandbox lab, timed per stage: its weights from the hub
stand-in, then from a converged peer.

    GPUHOST_SANDBOX_LAB=L .venv/bin/python bench/rebuild.py

Boots its own lab (``python -m sandbox up --hosts 3``, removed at the end) and runs the deploy
as a user would:

1. gpu1 converged (its weights from the hub stand-in: no peer holds them yet);
2. gpu2, fresh, rebuilt with ``gpuhost_model_copy_from_peers=false``: the weights from the hub;
3. gpu3, fresh, rebuilt as by default: the weights copied from gpu1 through the controller.

gpu2 and gpu3 are both fresh copies of the lab's root filesystem: a VM torn down and made again.
For each rebuild: every stage's wall time (from its first operation's start, as pyinfra prints
"--> Starting operation: <stage> | ...", to the next stage's), the weights' time (the model
operation alone), and the bytes fetched from outside the lab: from the hub stand-in (its byte
count, sandbox/hub.py) and from the lab's HTTP server, NVIDIA's repository and the package
index stand-ins (the sizes of the files its log shows served with 200; Debian's packages through
the proxy are not counted). Prints the figures and the weights' hub/peer time ratio; asserts
nothing. The stand-in weights are 1.5 MiB: in the sandbox the ratio is the copy's fixed costs
against a download's; on a real lab the weights are ~400 GB and the ratio is the Hub's bandwidth
against the LAN's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandbox import hub  # noqa: E402
from sandbox.layout import SERVICES_DIR, WWW  # noqa: E402

PYINFRA = str(ROOT / ".venv" / "bin" / "pyinfra")
_STARTING = re.compile(r"^--> Starting operation: (.+?) \| (.+?)\s*$")
_HTTPD_LINE = re.compile(r'^\S+ (\S+) "GET (\S+) HTTP/[\d.]+" 200 ')
MODEL_OP = "Model "


def sandbox(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


def hub_bytes(gateway: str) -> dict:
    with urllib.request.urlopen(f"http://{gateway}:{hub.PORT}/_sandbox/bytes-served") as r:
        return json.loads(r.read())


def httpd_bytes(client: str) -> int:
    """Bytes of the files the lab's HTTP server served ``client`` (200 responses)."""
    total = 0
    for line in (SERVICES_DIR / "httpd.log").read_text(errors="replace").splitlines():
        match = _HTTPD_LINE.match(line)
        if match and match[1] == client:
            path = WWW / match[2].split("?")[0].lstrip("/")
            if path.is_file():
                total += path.stat().st_size
    return total


def deploy(limit: str, *data: str) -> tuple[dict[str, float], float, float]:
    """One deploy of ``limit``: (seconds per stage, seconds of the model operation, total)."""
    command = [PYINFRA, "-y", "--limit", limit]
    for item in data:
        command += ["--data", item]
    began = time.monotonic()
    proc = subprocess.Popen([*command, "inventory/sandbox.py", "deploy.py"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    marks: list[tuple[float, str, str]] = []
    tail: list[str] = []
    for line in proc.stdout:
        now = time.monotonic()
        tail = (tail + [line])[-60:]
        match = _STARTING.match(line)
        if match:
            marks.append((now, match[1], match[2]))
    if proc.wait() != 0:
        sys.exit(f"deploy --limit {limit} failed:\n{''.join(tail)}")
    end = time.monotonic()
    stages: dict[str, float] = {}
    model = 0.0
    for i, (at, stage, op) in enumerate(marks):
        nxt = marks[i + 1][0] if i + 1 < len(marks) else end
        stages[stage] = stages.get(stage, 0.0) + nxt - at
        if op.startswith(MODEL_OP):
            model += nxt - at
    return stages, model, end - began


def main() -> int:
    if os.geteuid() != 0:
        sys.exit("bench/rebuild.py boots sandbox hosts: run it as root")
    print("booting 3 sandbox hosts ...", flush=True)
    sandbox("up", "--hosts", "3")
    try:
        hosts = json.loads(sandbox("status", "--json"))
        gateway = hosts[0]["gateway"]
        address = {h["name"]: h["address"] for h in hosts}
        runs = {}
        for name, label, data in (("gpu1", "gpu1 converged (hub, no peer yet)", ()),
                                  ("gpu2", "gpu2 rebuilt, weights from the hub",
                                   ("gpuhost_model_copy_from_peers=false",)),
                                  ("gpu3", "gpu3 rebuilt, weights from peer gpu1", ())):
            before = hub_bytes(gateway).get(address[name], {}).get("total", 0)
            stages, model, total = deploy(name, *data)
            runs[name] = (label, stages, model, total,
                          hub_bytes(gateway).get(address[name], {}).get("total", 0) - before,
                          httpd_bytes(address[name]))
        names = list(runs["gpu2"][1])
        print(f"\n{'stage':<32}" + "".join(f"{n:>10}" for n in runs))
        for stage in names:
            print(f"{stage:<32}" + "".join(f"{r[1].get(stage, 0.0):>9.1f}s" for r in runs.values()))
        print(f"{'  of it: the weights':<32}" + "".join(f"{r[2]:>9.1f}s" for r in runs.values()))
        print(f"{'total':<32}" + "".join(f"{r[3]:>9.1f}s" for r in runs.values()))
        print(f"{'bytes from the hub':<32}" + "".join(f"{r[4]:>10}" for r in runs.values()))
        print(f"{'bytes from repo + index':<32}" + "".join(f"{r[5]:>10}" for r in runs.values()))
        for label, *_ in runs.values():
            print(f"  {label}")
        hub_s, peer_s = runs["gpu2"][2], runs["gpu3"][2]
        print(f"\nweights from the hub / from the peer: {hub_s:.1f} s / {peer_s:.1f} s = "
              f"{hub_s / peer_s:.2f}")
        print(f"rebuild from the hub / with the peer: {runs['gpu2'][3]:.1f} s / "
              f"{runs['gpu3'][3]:.1f} s = {runs['gpu2'][3] / runs['gpu3'][3]:.2f}")
    finally:
        sandbox("down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
