"""sglang wheels fetched from the package index (PEP 691 JSON) into a cache outside the
repository, each checked against the index's sha256 (tools/sglang_args.py's first step)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from packaging.utils import parse_wheel_filename
from packaging.version import Version

DEFAULT_CACHE = Path(os.environ.get("SGLANG_WHEEL_CACHE", "/tmp/sglang-wheels"))
DEFAULT_INDEX = os.environ.get("SGLANG_ARGS_INDEX_URL", "https://pypi.org/simple")

# The deployment target: CPython 3.12 on Linux x86_64 (Ubuntu 24.04, glibc 2.39). pip does
# not widen a manylinux_2_N --platform to older tags, so every tag is listed.
TARGET_PYTHON = "3.12"
TARGET_PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(39, 16, -1)] + [
    "manylinux2014_x86_64",
    "linux_x86_64",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr)


def index_files(package: str, index_url: str = DEFAULT_INDEX) -> dict:
    """PEP 691 JSON listing of a project on the index: {"versions": [...], "files": [...]}."""
    req = urllib.request.Request(
        f"{index_url.rstrip('/')}/{package}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


def release_versions(package: str = "sglang", index_url: str = DEFAULT_INDEX) -> list[Version]:
    """Final (non-pre-release) versions that have at least one non-yanked wheel, ascending."""
    data = index_files(package, index_url)
    found = set()
    for f in data["files"]:
        if not f["filename"].endswith(".whl") or f.get("yanked"):
            continue
        _, ver, _, _ = parse_wheel_filename(f["filename"])
        if not ver.is_prerelease and not ver.is_devrelease:
            found.add(ver)
    return sorted(found)


def resolve_version(spec: str, index_url: str = DEFAULT_INDEX) -> str:
    if spec == "latest":
        return str(release_versions("sglang", index_url)[-1])
    return str(Version(spec))


def fetch_wheel(version: str, cache: Path = DEFAULT_CACHE, index_url: str = DEFAULT_INDEX):
    """Return (path, sha256) of sglang==version's wheel for the target, downloading if needed.

    ``--isolated`` keeps the machine's pip configuration (extra indexes, find-links,
    constraints) out of it, so the wheel comes from ``index_url`` alone.
    """
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "--isolated", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--index-url", index_url,
        "--python-version", TARGET_PYTHON, "--implementation", "cp",
        "--abi", "cp" + TARGET_PYTHON.replace(".", ""),
    ]
    for plat in TARGET_PLATFORMS:
        cmd += ["--platform", plat]
    cmd += ["-d", str(cache), f"sglang=={version}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wheels = []
    for p in cache.glob("sglang-*.whl"):
        _, ver, _, _ = parse_wheel_filename(p.name)
        if ver == Version(version):
            wheels.append(p)
    if not wheels:
        raise SystemExit(f"pip download left no wheel for sglang=={version} in {cache}")
    # A py3-none-any wheel and a cp312 wheel of one version cannot both be chosen by pip;
    # prefer whichever pip just touched.
    wheel = max(wheels, key=lambda p: p.stat().st_mtime)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    try:
        listed = {
            f["filename"]: f["hashes"].get("sha256")
            for f in index_files("sglang", index_url)["files"]
        }
    except OSError as exc:  # the index answered pip; a failure here is worth a note only
        log(f"note: could not cross-check {wheel.name} against the index: {exc}")
    else:
        if listed.get(wheel.name) != sha:
            raise SystemExit(f"{wheel.name}: sha256 {sha} does not match the index's listing")
    return wheel, sha
