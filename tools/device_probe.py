"""Read every fact this toolkit uses on the machine it runs on, and keep the raw outputs.

    python3 tools/device_probe.py OUTDIR

For each fact: runs its command with bash, as pyinfra would, writes the raw output to
OUTDIR/<Fact>.txt (the command first, as ``$ ...``, and ``# rc=N`` last, like
../shared/fixtures), and prints what the fact makes of it. Also prints the flash-attn build
parallelism this host would get. Meant for the lent GPU machine (issue: real GPU host); runs
anywhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, is_dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pyinfra.facts.deb import DebPackages  # noqa: E402
from pyinfra.facts.server import Arch, LinuxDistribution, OsVersion  # noqa: E402

from operations.facts.gpu import NvidiaDriver  # noqa: E402
from operations.facts.host import AptListsPresent, HeldPackages, HostResources  # noqa: E402
from operations.stages.mlenv import build_parallelism  # noqa: E402
from operations.stages.preflight import InitSystem, Virtualization  # noqa: E402
from operations.stages.secureboot import SecureBoot  # noqa: E402

FACTS = [LinuxDistribution, OsVersion, Arch, DebPackages, HeldPackages, AptListsPresent,
         HostResources, Virtualization, InitSystem, SecureBoot, NvidiaDriver]
RAW = {
    "topo-m": "nvidia-smi topo -m",
    "topo-p2p-r": "nvidia-smi topo -p2p r",
    "topo-p2p-w": "nvidia-smi topo -p2p w",
    "nvidia-smi-owner": 'dpkg -S "$(command -v nvidia-smi)"',
    "proc-driver-version": "cat /proc/driver/nvidia/version",
    "pid1": "cat /proc/1/comm",
}


def _shell(command: str) -> tuple[int, list[str]]:
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=False)
    return result.returncode, (result.stdout + result.stderr).splitlines()


def _jsonable(value):
    if is_dataclass(value):
        return asdict(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return value


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "probe")
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for cls in FACTS:
        fact = cls()
        command = str(fact.command())
        rc, lines = _shell(command)
        (out / f"{cls.__name__}.txt").write_text(
            f"$ {command}\n" + "".join(f"{line}\n" for line in lines) + f"# rc={rc}\n")
        try:
            value = fact.process(lines) if lines else fact.default()
            results[cls.__name__] = _jsonable(value)
            shown = json.dumps(results[cls.__name__], default=str)
            print(f"{cls.__name__}: {shown[:400]}")
        except Exception as exc:  # noqa: BLE001 - a probe reports every failure and goes on
            results[cls.__name__] = f"ERROR {type(exc).__name__}: {exc}"
            print(f"{cls.__name__}: ERROR {type(exc).__name__}: {exc}")
    for name, command in RAW.items():
        rc, lines = _shell(command)
        (out / f"{name}.txt").write_text(
            f"$ {command}\n" + "".join(f"{line}\n" for line in lines) + f"# rc={rc}\n")
    resources = results.get("HostResources")
    if isinstance(resources, dict):
        p = build_parallelism(resources["cores"], resources["mem_available_gib"])
        print(f"flash-attn build on this host: MAX_JOBS={p.max_jobs} NVCC_THREADS={p.nvcc_threads}"
              f" (bound {p.thread_bound} nvcc threads for {resources['mem_available_gib']} GiB "
              f"available, {resources['cores']} cores)")
    (out / "facts.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
