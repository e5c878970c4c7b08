"""How long the server is unreachable during a successful venv upgrade (a new lock).

    .venv/bin/python bench/venv_upgrade_outage.py [--no-converge]

Boots nothing: run ``python -m sandbox up`` first (GPUHOST_SANDBOX_LAB picks the lab). Converges
the lab's first host once (unless --no-converge), then deploys it with a new lock: the sandbox's
lock with one more hash on its first pin, so another lock digest and a new venv beside the
serving one (operations/stages/venvs.py), the same distributions. Meanwhile a probe on the host asks
the server's /health every 0.1 s (from the host: the server binds its loopback) and records the
times it did not answer. Prints the longest window without an answer, their count and the
deploy's wall time; asserts nothing. Goal: no longer than one restart (the stand-in server
starts in about half a second; a real one loads its weights for minutes).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYINFRA = str(ROOT / ".venv" / "bin" / "pyinfra")
STOP = "/run/gpuhost-bench-outage.stop"
PROBE = f"""
import os, time, urllib.request
down = None
while not os.path.exists({STOP!r}):
    now = time.monotonic()
    try:
        urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=1).read()
        if down is not None:
            print(f"down {{down:.3f}} {{now:.3f}}", flush=True)
            down = None
    except Exception:
        down = now if down is None else down
    time.sleep(0.1)
if down is not None:
    print(f"down {{down:.3f}} {{time.monotonic():.3f}} still", flush=True)
"""


def ssh_command(host: dict, command: str) -> list[str]:
    return ["ssh", "-i", host["ssh_key"], "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
            f"root@{host['address']}", command]


def deploy(*extra: str) -> float:
    start = time.perf_counter()
    result = subprocess.run([PYINFRA, "-y", *extra, "inventory/sandbox.py", "deploy.py"],
                            cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"deploy failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-converge", action="store_true")
    args = parser.parse_args()
    status = subprocess.run([sys.executable, "-m", "sandbox", "status", "--json"], cwd=ROOT,
                            capture_output=True, text=True, check=True)
    hosts = json.loads(status.stdout)
    if not hosts:
        sys.exit("no sandbox hosts: run python -m sandbox up")
    host = hosts[0]
    limit = ("--limit", host["name"])
    if not args.no_converge:
        print(f"converge {host['name']}:        {deploy(*limit):7.2f} s")
    with tempfile.TemporaryDirectory(prefix="gpuhost-bench-") as tmp:
        lock = Path(tmp) / "relocked.txt"
        lock.write_text(re.sub(r"(--hash=sha256:[0-9a-f]{64})", r"\1 --hash=sha256:" + "0" * 64,
                               Path(host["lock"]).read_text(), count=1))
        subprocess.run(ssh_command(host, f"rm -f {STOP}"), check=True)
        probe = subprocess.Popen(ssh_command(host, f"python3 -c {shlex.quote(PROBE)}"),
                                 stdout=subprocess.PIPE, text=True)
        time.sleep(1)
        wall = deploy(*limit, "--data", f"gpuhost_lock={lock}")
        time.sleep(1)
        subprocess.run(ssh_command(host, f"touch {STOP}"), check=True)
        out, _ = probe.communicate(timeout=30)
    windows = [float(b) - float(a) for _, a, b, *_ in (line.split() for line in out.splitlines()
                                                        if line.startswith("down "))]
    print(f"venv upgrade deploy:      {wall:7.2f} s (a new lock digest: a venv beside)")
    print(f"server unreachable:       {max(windows, default=0.0):7.2f} s longest, "
          f"{len(windows)} window(s), {sum(windows):.2f} s in all")
    if any(line.endswith("still") for line in out.splitlines()):
        print("the server did not answer at the end")


if __name__ == "__main__":
    main()
