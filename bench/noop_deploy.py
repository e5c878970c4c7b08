"""What a no-op deploy costs against converged sandbox hosts, beside pyinfra's own floor.

    .venv/bin/python bench/noop_deploy.py [--runs 3] [--no-converge]

Boots nothing: run ``python -m sandbox up --hosts 4`` first (any number of hosts from 2). Converges
every host once (unless --no-converge), then runs, interleaved, ``--runs`` rounds of three
runs, the order turned each round so that the machine's load falls on each alike:

- the floor: ``bench/one_operation.py`` (one ``server.shell`` of ``true``) on the first host;
- the no-op: ``pyinfra -y inventory/sandbox.py deploy.py`` on the first host (``--limit``);
- the no-op on every host.

Each run's wall time and the controller CPU it used (user + system time of pyinfra's process
and its children, ``RUSAGE_CHILDREN``), medians over the rounds; then one run each of the floor and
of both no-ops with ``-vv`` counts the remote commands (pyinfra prints each as
``[host] >>> ...``), apart for planning and for executing (before and after pyinfra's
"--> Beginning operation run"). Prints figures against the targets of issue #20, asserts
nothing.

The runs see an operator's environment: this machine's sets PYTHONDONTWRITEBYTECODE=1, which
keeps gpuhost from caching its modules' bytecode (operations/__init__.py): the bench drops it
for its runs, and a warm-up run (``--dry``) compiles them once.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYINFRA = str(ROOT / ".venv" / "bin" / "pyinfra")
DEPLOY = "deploy.py"
FLOOR = "bench/one_operation.py"
#: Targets of issue #20, for a no-op run on a converged host.
RATIO_TARGET = 2.0
COMMANDS_TARGET = 12
HOSTS_TARGET = 1.2
CPU_TARGET_S = 0.4
#: The runs' environment (see the module's docstring).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


@dataclass(frozen=True)
class Run:
    wall_s: float
    cpu_s: float
    output: str


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(deploy: str, limit: str | None, *extra: str) -> Run:
    """One pyinfra run; its CPU is the growth of this process's RUSAGE_CHILDREN (runs are
    sequential and each is reaped before the next, so it is that run's process tree alone)."""
    argv = [PYINFRA, "-y", "inventory/sandbox.py", deploy, *(["--limit", limit] if limit else []),
            *extra]
    cpu, start = _cpu_of_children(), time.perf_counter()
    result = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, check=False, env=ENV)
    elapsed, cpu = time.perf_counter() - start, _cpu_of_children() - cpu
    if result.returncode != 0:
        sys.exit(f"{' '.join(argv[1:])} failed (exit {result.returncode}):\n"
                 f"{result.stdout[-4000:]}")
    return Run(elapsed, cpu, result.stdout)


def commands(output: str) -> tuple[dict[str, int], int, int]:
    """Remote commands per host, and in all while planning and while executing."""
    per_host: dict[str, int] = {}
    planning = executing = 0
    executing_now = False
    for line in output.splitlines():
        if "--> Beginning operation run" in line:
            executing_now = True
        if "] >>> " not in line:
            continue
        name = line.split("] >>> ", 1)[0].strip().lstrip("[")
        per_host[name] = per_host.get(name, 0) + 1
        if executing_now:
            executing += 1
        else:
            planning += 1
    return per_host, planning, executing


def sandbox_hosts() -> list[str]:
    status = subprocess.run([sys.executable, "-m", "sandbox", "status", "--json"], cwd=ROOT,
                            capture_output=True, text=True, check=True)
    return [h["name"] for h in json.loads(status.stdout)]


def _verdict(value: float, target: float) -> str:
    return "meets" if value <= target else "misses"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--no-converge", action="store_true")
    args = parser.parse_args()
    hosts = sandbox_hosts()
    if len(hosts) < 2:
        sys.exit(f"{len(hosts)} sandbox host(s): boot at least 2 "
                 "(python -m sandbox up --hosts 4)")
    first, n = hosts[0], len(hosts)

    if not args.no_converge:
        print(f"converge run ({n} hosts): {run(DEPLOY, None).wall_s:6.2f} s")
    run(DEPLOY, first, "--dry")  # compiles gpuhost's modules once (see the module's docstring)
    kinds = {"floor": (FLOOR, first), "noop-1": (DEPLOY, first), f"noop-{n}": (DEPLOY, None)}
    order = list(kinds)
    runs: dict[str, list[Run]] = {kind: [] for kind in kinds}
    for round_ in range(args.runs):
        for kind in order[round_ % 3:] + order[:round_ % 3]:
            runs[kind].append(run(*kinds[kind]))
    wall = {kind: statistics.median(r.wall_s for r in rs) for kind, rs in runs.items()}
    cpu = {kind: statistics.median(r.cpu_s for r in rs) for kind, rs in runs.items()}
    counted = {kind: commands(run(*kinds[kind], "-vv").output) for kind in kinds}

    one, many = "noop-1", f"noop-{n}"
    ratio = wall[one] / wall["floor"]
    per_host_one = counted[one][0].get(first, 0)
    per_host_many = max(counted[many][0].values(), default=0)
    scale = wall[many] / wall[one]
    cpu_per_host = cpu[many] / n
    cpu_marginal = (cpu[many] - cpu[one]) / (n - 1)
    print(f"rounds (interleaved):  {args.runs}, each the floor, a no-op on {first}, "
          f"a no-op on {n} hosts")
    for kind, rs in runs.items():
        print(f"  {kind:8} wall {', '.join(f'{r.wall_s:.2f}' for r in rs)} s; "
              f"controller CPU {', '.join(f'{r.cpu_s:.2f}' for r in rs)} s")
    print(f"floor (one operation):     {wall['floor']:6.2f} s wall, {cpu['floor']:.2f} s CPU, "
          f"{counted['floor'][0].get(first, 0)} remote commands")
    print(f"no-op run, 1 host:         {wall[one]:6.2f} s wall, {cpu[one]:.2f} s CPU")
    print(f"no-op / floor:             {ratio:6.2f}x   (target <= {RATIO_TARGET}: "
          f"{_verdict(ratio, RATIO_TARGET)})")
    print(f"remote commands per host:  {per_host_one:6d}    (target <= {COMMANDS_TARGET}: "
          f"{_verdict(per_host_one, COMMANDS_TARGET)}); planning {counted[one][1]}, "
          f"executing {counted[one][2]}; on {n} hosts at most {per_host_many} a host")
    print(f"controller CPU per host:   {cpu_per_host:6.2f} s  ({n} hosts' run / {n}; target "
          f"<= {CPU_TARGET_S}: {_verdict(cpu_per_host, CPU_TARGET_S)}); each host beyond the "
          f"first {cpu_marginal:.2f} s")
    print(f"{n} hosts / 1 host:          {scale:6.2f}x   ({wall[many]:.2f} s vs {wall[one]:.2f} s; "
          f"target <= {HOSTS_TARGET}: {_verdict(scale, HOSTS_TARGET)})")


if __name__ == "__main__":
    main()
