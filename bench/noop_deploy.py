"""Median wall time of no-op re-runs of the deploy against converged sandbox hosts, and the
remote commands each sends.

    .venv/bin/python bench/noop_deploy.py [--runs 3] [--no-converge]

Boots nothing: run ``python -m sandbox up`` first. Converges once (unless --no-converge), then
times ``pyinfra -y inventory/sandbox.py deploy.py`` --runs times, then counts the commands of one
more run with ``-vv`` (pyinfra prints each remote command as ``[host] >>> ...``). Prints figures,
asserts nothing. Goal: at most 5 s on one host.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYINFRA = [str(ROOT / ".venv" / "bin" / "pyinfra"), "-y", "inventory/sandbox.py", "deploy.py"]


def run(*extra: str) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run([*PYINFRA, *extra], cwd=ROOT, capture_output=True, text=True,
                            check=False)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"deploy failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return elapsed, result.stdout + result.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-converge", action="store_true")
    args = parser.parse_args()

    if not args.no_converge:
        elapsed, _ = run()
        print(f"converge run:          {elapsed:6.2f} s")
    times = [run()[0] for _ in range(args.runs)]
    _, verbose = run("-vv")
    commands = [line for line in verbose.splitlines() if ">>> " in line]
    hosts = {line.split(">>>")[0].strip() for line in commands}
    print(f"no-op runs:            {', '.join(f'{t:.2f}' for t in times)} s")
    print(f"median no-op run:      {statistics.median(times):6.2f} s  (goal: <= 5 s on one host)")
    print(f"remote commands a run: {len(commands)} over {len(hosts)} host(s)")


if __name__ == "__main__":
    main()
