#!/usr/bin/env python3
"""Resolve a stack's input (locks/<stack>.in) into a fully pinned, hashed lock (locks/<stack>.txt).

    python tools/lock.py cuda12.8            # write locks/cuda12.8.txt
    python tools/lock.py cuda12.8 --check    # resolve again into /tmp, compare with the lock

The input names the top-level requirements; its "#: key = value" lines say how to resolve
(python-version, python-platform, cuda, exclude-newer) and its "#| ..." lines are copied into
the lock's header. Resolution is ``uv pip compile --generate-hashes`` against PyPI only, for the
target interpreter and platform rather than this machine's; ``--exclude-newer`` makes it
repeatable. After resolving, the lock is checked: every requirement pinned with == and hashed,
torch pinned to what sglang's METADATA requires, and torch's CUDA (read from the
nvidia-cuda-runtime-cu12 pin that torch's Linux wheel depends on, or CUDA 13's
nvidia-cuda-runtime) equal to the stack's.

Standard library only (plus uv, found next to this interpreter or on PATH; and the helpers of
tools/sglang_args.py for reading sglang's wheel).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_args

REPO = Path(__file__).resolve().parent.parent
LOCKS = REPO / "locks"
INDEX = os.environ.get("LOCK_INDEX_URL", "https://pypi.org/simple")

# Minimum Linux driver for a CUDA runtime (NVIDIA's CUDA Toolkit release notes, "CUDA Toolkit
# and Corresponding Driver Versions"; minor-version compatibility lets older drivers of the same
# major run some binaries, but JIT of PTX and new APIs need these). Blackwell (SM120) GPUs also
# need the open kernel modules, which start at R570.
MIN_DRIVER = {
    "12.8": "570.26 (R570; CUDA 12.8 GA, 570.124.06 for 12.8 Update 1)",
    "12.9": "575.51.03 (R575)",
    "13.0": "580.65.06 (R580)",
}

REQ_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)")


def find_uv() -> str:
    cand = Path(sys.executable).parent / "uv"
    if cand.exists():
        return str(cand)
    found = shutil.which("uv")
    if not found:
        raise SystemExit("uv not found: pip install uv (into the venv that runs this script)")
    return found


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_input(stack: str) -> tuple[dict, list[str], list[str]]:
    """(settings from '#:' lines, header lines from '#|', requirement lines)."""
    path = LOCKS / f"{stack}.in"
    if not path.exists():
        raise SystemExit(f"{path.relative_to(REPO)} does not exist")
    settings, notes, reqs = {}, [], []
    for line in path.read_text().splitlines():
        if line.startswith("#:"):
            key, _, value = line[2:].partition("=")
            settings[key.strip()] = value.strip()
        elif line.startswith("#|"):
            notes.append(line[2:].rstrip())
        elif line.strip() and not line.lstrip().startswith("#"):
            reqs.append(line.strip())
    for key in ("python-version", "python-platform", "cuda"):
        if key not in settings:
            raise SystemExit(f"{path.name}: missing '#: {key} = ...'")
    return settings, notes, reqs


def uv_command(stack: str, settings: dict, output: Path) -> list[str]:
    cmd = [
        "uv", "pip", "compile", f"locks/{stack}.in",
        "--output-file", str(output),
        "--python-version", settings["python-version"],
        "--python-platform", settings["python-platform"],
        "--generate-hashes",
        "--index-url", INDEX,
        "--no-config",
        "--no-header",
        "--quiet",
    ]
    if settings.get("exclude-newer"):
        cmd += ["--exclude-newer", settings["exclude-newer"]]
    return cmd


def resolve(stack: str, output: Path) -> list[str]:
    """Run uv pip compile for the stack into ``output``; return the command as run."""
    settings, _, _ = read_input(stack)
    cmd = uv_command(stack, settings, output)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
    subprocess.run([find_uv()] + cmd[1:], check=True, cwd=REPO, env=env)
    return cmd


def parse_lock(text: str) -> dict[str, dict]:
    """{normalized name: {"name", "version", "hashes": [...], "line"}} from a hashed lock."""
    out: dict[str, dict] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            current = None if not raw.startswith(" ") else current
            continue
        if raw[0] not in " \t":
            m = REQ_RE.match(line)
            if not m:
                raise ValueError(f"not pinned with ==: {line}")
            current = {"name": m.group(1), "version": m.group(3), "hashes": [], "line": line}
            out[normalize(m.group(1))] = current
            continue
        if current is not None:
            for h in re.findall(r"--hash=(sha256:[0-9a-f]{64})", line):
                current["hashes"].append(h)
    return out


def sglang_requires(version: str) -> dict[str, str]:
    """sglang's unconditional Requires-Dist, {normalized name: specifier}, from its wheel."""
    wheel, _ = sglang_args.fetch_wheel(version)
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = {}
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec = line.split(":", 1)[1].strip()
        if "extra ==" in spec:
            continue
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)", spec)
        if m:
            reqs[normalize(m.group(1))] = m.group(2).strip()
    return reqs


def verify(pins: dict[str, dict], settings: dict) -> dict:
    """Facts for the header; raises SystemExit when the lock does not fit the stack."""
    problems = []
    for p in pins.values():
        if not p["hashes"]:
            problems.append(f"{p['name']} has no --hash")
    if "sglang" not in pins or "torch" not in pins:
        raise SystemExit("the lock pins no sglang or no torch")
    sgl = pins["sglang"]["version"]
    torch = pins["torch"]["version"]
    reqs = sglang_requires(sgl)
    want_torch = reqs.get("torch", "")
    if want_torch != f"=={torch}":
        problems.append(f"sglang {sgl} requires torch{want_torch}, the lock pins {torch}")
    cuda = settings["cuda"]
    major = cuda.split(".")[0]
    # CUDA 12's runtime wheel is nvidia-cuda-runtime-cu12; from CUDA 13 on NVIDIA names it
    # nvidia-cuda-runtime (torch 2.11.0's METADATA: cuda-toolkit[cudart]==13.0.2, which
    # requires nvidia-cuda-runtime==13.0.96)
    names = (f"nvidia-cuda-runtime-cu{major}", "nvidia-cuda-runtime")
    runtime_name = next((n for n in names if n in pins), names[0])
    runtime = pins.get(runtime_name)
    if runtime is None:
        problems.append(f"no {' or '.join(names)} in the lock: torch is not a CUDA {major} build")
        runtime_v = "?"
    else:
        runtime_v = runtime["version"]
        if ".".join(runtime_v.split(".")[:2]) != cuda:
            problems.append(f"{runtime_name}=={runtime_v} is not CUDA {cuda}")
    if problems:
        raise SystemExit("lock does not fit the stack:\n  " + "\n  ".join(problems))
    facts = {
        "sglang": sgl,
        "torch": torch,
        "cuda_runtime": runtime_v,
        "cuda_runtime_name": runtime_name,
        "cuda": cuda,
        "min_driver": MIN_DRIVER.get(cuda, "see NVIDIA's CUDA release notes"),
        "sglang_pins": {k: reqs[k] for k in
                        ("torch", "cuda-python", "flashinfer-python", "flashinfer-cubin",
                         "sgl-kernel", "sglang-kernel", "flash-attn", "flash-attn-4")
                        if k in reqs},
        "count": len(pins),
    }
    for name in ("cuda-python", "flashinfer-python", "sgl-kernel", "sglang-kernel", "flash-attn",
                 "triton"):
        if name in pins:
            facts[name] = pins[name]["version"]
    return facts


def header(stack: str, cmd: list[str], notes: list[str], facts: dict) -> str:
    pins = ", ".join(f"{k}{v}" for k, v in facts["sglang_pins"].items())
    extra = ", ".join(f"{k} {facts[k]}" for k in ("cuda-python", "flashinfer-python", "sgl-kernel",
                                                   "sglang-kernel", "flash-attn", "triton")
                      if k in facts)
    lines = [
        f"# locks/{stack}.txt -- generated by tools/lock.py; do not edit by hand.",
        f"#   regenerate: python tools/lock.py {stack}",
        f"#   which runs: {' '.join(cmd)}",
        f"# Input: locks/{stack}.in. Every requirement is pinned with == and carries its sha256",
        *(["# hashes. Install with pip --require-hashes --no-deps; flash-attn (an sdist) last, "
           "with\n# --no-build-isolation once torch and its build requirements are in "
           "(locks/README.md)."] if facts.get("flash-attn") else
          ["# hashes. Install with pip --require-hashes --no-deps (locks/README.md)."]),
        "#",
        f"# sglang {facts['sglang']} Requires-Dist (its wheel's METADATA): {pins}.",
        (f"# torch {facts['torch']}: PyPI's Linux x86_64 wheel, a CUDA {facts['cuda']} build "
         f"({facts['cuda_runtime_name']}=={facts['cuda_runtime']})."),
        f"# Minimum NVIDIA driver: {facts['min_driver']}.",
        f"# Also: {extra}.",
        "#",
    ]
    lines += [f"#{n}" if n.startswith(" ") else f"# {n}" for n in notes]
    lines.append("#")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stack", help="stack name: reads locks/<stack>.in (cuda12.8, cuda13.0)")
    p.add_argument("--check", action="store_true",
                   help="resolve again into a temporary file and compare pins with the lock")
    ns = p.parse_args(argv)
    settings, notes, _ = read_input(ns.stack)
    lock = LOCKS / f"{ns.stack}.txt"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{ns.stack}.txt"
        cmd = resolve(ns.stack, out)
        shown = [c if c != str(out) else f"locks/{ns.stack}.txt" for c in cmd]
        pins = parse_lock(out.read_text())
        facts = verify(pins, settings)
        body = out.read_text()
    if ns.check:
        committed = parse_lock(lock.read_text())
        a = {k: v["version"] for k, v in committed.items()}
        b = {k: v["version"] for k, v in pins.items()}
        if a != b:
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    print(f"{k}: lock {a.get(k)} resolved {b.get(k)}")
            return 1
        print(f"locks/{ns.stack}.txt matches a fresh resolution ({len(a)} pins)")
        return 0
    lock.write_text(header(ns.stack, shown, notes, facts) + body)
    print(f"wrote {lock.relative_to(REPO)}: {facts['count']} pins; sglang {facts['sglang']}, "
          f"torch {facts['torch']} (CUDA {facts['cuda']}, runtime {facts['cuda_runtime']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
