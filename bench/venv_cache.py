"""The ML venv stage with a cold and a warm flash-attn wheel cache, and the flash-attn
compilations when the lab's hosts converge together.

    .venv/bin/python bench/venv_cache.py [--no-converge]

Boots nothing: run ``python -m sandbox up --hosts 2`` first (GPUHOST_SANDBOX_LAB picks the lab).
Converges the lab once (unless --no-converge), then, with the venv stage alone
(bench/venv_stage.py) and a controller cache in a fresh temporary folder:

1. cold: the first host's venv removed, the cache empty: the stage's wall time;
2. warm: the venv removed again, the cache now holding the wheel: the stage's wall time;
3. together: every host's venv removed, a new empty cache, the stage on all hosts at once:
   the number of hosts that compiled flash-attn (a build log systemd wrote), read over ssh.

Prints figures, asserts nothing. Goal: one compilation for the whole lab. In the sandbox the
flash-attn stand-in compiles nothing, so the cold/warm ratio is small here; on a real host the
build takes most of an hour and the ratio is its length over a wheel's upload.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYINFRA = str(ROOT / ".venv" / "bin" / "pyinfra")
VENV = "/opt/gpuhost/venv"
#: the venvs themselves (VENV is the link to the serving one: operations/stages/venvs.py)
VENVS = "/opt/gpuhost/venvs"
BUILD_LOG = "/opt/gpuhost/build/flash-attn/build.log"


def deploy(file: str, cache: Path | None = None, limit: str | None = None) -> float:
    command = [PYINFRA, "-y"]
    if cache is not None:
        command += ["--data", f"gpuhost_wheel_cache={cache}"]
    if limit is not None:
        command += ["--limit", limit]
    start = time.perf_counter()
    result = subprocess.run([*command, "inventory/sandbox.py", file], cwd=ROOT,
                            capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{file} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return elapsed


def ssh(host: dict, command: str) -> str:
    return subprocess.run(
        ["ssh", "-i", host["ssh_key"], "-o", "StrictHostKeyChecking=no",
         "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
         f"root@{host['address']}", command],
        capture_output=True, text=True, check=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-converge", action="store_true")
    args = parser.parse_args()
    status = subprocess.run([sys.executable, "-m", "sandbox", "status", "--json"], cwd=ROOT,
                            capture_output=True, text=True, check=True)
    hosts = json.loads(status.stdout)
    if not hosts:
        sys.exit("no sandbox hosts: run python -m sandbox up --hosts 2")
    with tempfile.TemporaryDirectory(prefix="gpuhost-bench-") as tmp:
        if not args.no_converge:
            print(f"converge the lab:          {deploy('deploy.py', Path(tmp) / 'c0'):7.2f} s")
        first = hosts[0]
        cache = Path(tmp) / "cache"
        ssh(first, f"rm -rf {VENV} {VENVS} /opt/gpuhost/build")
        cold = deploy("bench/venv_stage.py", cache, first["name"])
        ssh(first, f"rm -rf {VENV} {VENVS} /opt/gpuhost/build")
        warm = deploy("bench/venv_stage.py", cache, first["name"])
        print(f"venv stage, cold cache:    {cold:7.2f} s  ({first['name']}, venv removed)")
        print(f"venv stage, warm cache:    {warm:7.2f} s  (venv removed again)")
        print(f"cold / warm:               {cold / warm:7.2f}")

        for h in hosts:
            ssh(h, f"rm -rf {VENV} {VENVS} /opt/gpuhost/build")
        together = deploy("bench/venv_stage.py", Path(tmp) / "together")
        builds = [h["name"] for h in hosts
                  if ssh(h, f"test -s {BUILD_LOG} && echo yes || echo no").strip() == "yes"]
        print(f"{len(hosts)} hosts together:           {together:7.2f} s")
        print(f"flash-attn compilations:   {len(builds):7d}    (on {', '.join(builds) or 'none'}; "
              "goal: 1)")


if __name__ == "__main__":
    main()
