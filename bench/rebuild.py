"""Rebuilding a fresh host on the sandbox lab, timed per stage: without the fleet (weights
from the hub stand-in, wheels from the index), then with it (weights from a converged peer,
wheels from the controller's cache).

    GPUHOST_SANDBOX_LAB=L .venv/bin/python bench/rebuild.py

Boots its own lab (``python -m sandbox up --hosts 3``, removed at the end) and runs the deploy
as a user would:

1. gpu1 converged (its weights from the hub stand-in: no peer holds them yet; its locked wheels
   from the index, or from the controller's cache where an earlier run left them there);
2. gpu2, fresh, rebuilt without the fleet: ``gpuhost_model_copy_from_peers=false`` (the weights
   from the hub) and ``gpuhost_wheel_cache`` an empty folder (the locked wheels from the index,
   flash-attn built on the host);
3. gpu3, fresh, rebuilt as by default: the weights copied from gpu1 directly over the lab switch,
   the locked wheels and flash-attn's from the controller's cache.

gpu2 and gpu3 are both fresh copies of the lab's root filesystem: a VM torn down and made again.
For each rebuild: every stage's wall time (from its first operation's start, as pyinfra prints
"--> Starting operation: <stage> | ...", to the next stage's), the weights' time (the model
operation alone), and the bytes fetched from outside the lab, from the stand-ins' own counts
(``GET /_sandbox/bytes-served``): the hub's (sandbox/hub.py: the weights, and the metadata the
verification reads) and the lab's HTTP server's (sandbox/httpd.py: the index's distributions,
its pages, NVIDIA's repository); Debian's packages through the proxy are not counted. Prints
the figures and the hub/peer ratios; asserts nothing. The stand-in weights are 1.5 MiB: in the
sandbox the ratio is the copy's fixed costs against a download's; on a real lab the weights are
~400 GB and the ratio is the Hub's bandwidth against the LAN's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sandbox import hub  # noqa: E402

#: The lab's HTTP server (sandbox/README.md: NVIDIA's repository and the index on 8080).
HTTPD_PORT = 8080

PYINFRA = str(ROOT / ".venv" / "bin" / "pyinfra")
_STARTING = re.compile(r"^--> Starting operation: (.+?) \| (.+?)\s*$")
MODEL_OP = "Model "


def sandbox(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


def served(gateway: str, port: int) -> dict:
    """A stand-in's bytes served: {client: {"total": n, "files": {path: n}}}."""
    with urllib.request.urlopen(f"http://{gateway}:{port}/_sandbox/bytes-served") as r:
        return json.loads(r.read())


def counts(gateway: str, client: str) -> dict[str, int]:
    """The bytes ``client`` was sent so far: from the hub, and from the lab's HTTP server as
    the index's distributions, its pages, and NVIDIA's repository."""
    out = {"hub": served(gateway, hub.PORT).get(client, {}).get("total", 0),
           "wheels": 0, "pages": 0, "repo": 0}
    for path, n in served(gateway, HTTPD_PORT).get(client, {}).get("files", {}).items():
        if path.startswith("/simple/"):
            out["pages" if path.endswith(("/", ".html")) else "wheels"] += n
        else:
            out["repo"] += n
    return out


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
        empty = tempfile.mkdtemp(prefix="gpuhost-bench-no-cache-")
        runs = {}
        for name, label, data in (
                ("gpu1", "gpu1 converged (hub, no peer yet)", ()),
                ("gpu2", "gpu2 rebuilt without the fleet: weights from the hub, wheels from "
                 "the index", ("gpuhost_model_copy_from_peers=false",
                               f"gpuhost_wheel_cache={empty}")),
                ("gpu3", "gpu3 rebuilt with the fleet: weights from peer gpu1, wheels from the "
                 "controller's cache", ())):
            before = counts(gateway, address[name])
            stages, model, total = deploy(name, *data)
            after = counts(gateway, address[name])
            runs[name] = (label, stages, model, total,
                          {k: after[k] - before[k] for k in after})
        shutil.rmtree(empty, ignore_errors=True)
        names = list(runs["gpu2"][1])
        print(f"\n{'stage':<34}" + "".join(f"{n:>10}" for n in runs))
        for stage in names:
            print(f"{stage:<34}" + "".join(f"{r[1].get(stage, 0.0):>9.1f}s" for r in runs.values()))
        print(f"{'  of it: the weights':<34}" + "".join(f"{r[2]:>9.1f}s" for r in runs.values()))
        print(f"{'total':<34}" + "".join(f"{r[3]:>9.1f}s" for r in runs.values()))
        for key, what in (("hub", "bytes from the hub"), ("wheels", "bytes of wheels (index)"),
                          ("pages", "bytes of index pages"), ("repo", "bytes from NVIDIA's repo")):
            print(f"{what:<34}" + "".join(f"{r[4][key]:>10}" for r in runs.values()))
        for label, *_ in runs.values():
            print(f"  {label}")
        hub_s, peer_s = runs["gpu2"][2], runs["gpu3"][2]
        print(f"\nweights from the hub / from the peer: {hub_s:.1f} s / {peer_s:.1f} s = "
              f"{hub_s / peer_s:.2f}")
        print(f"rebuild without / with the fleet: {runs['gpu2'][3]:.1f} s / "
              f"{runs['gpu3'][3]:.1f} s = {runs['gpu2'][3] / runs['gpu3'][3]:.2f}")
        for key, what in (("hub", "weights (hub)"), ("wheels", "wheels (index)")):
            print(f"bytes from outside the lab, {what}: without the fleet "
                  f"{runs['gpu2'][4][key]}, with it {runs['gpu3'][4][key]}")
    finally:
        sandbox("down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
