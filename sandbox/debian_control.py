"""Debian's real control data of the NVIDIA driver's packages, the model of the stand-in NVIDIA
repository's package tree (sandbox/nvidia_repo.py).

NVIDIA's debian12 repository ships Debian's own packaging of the driver (source package
``nvidia-graphics-drivers``): the same binary package names, the same exact-version
dependencies (``nvidia-driver (= V)`` -> ``nvidia-driver-libs (= V)`` -> ``libgl1-nvidia-glvnd-glx
(= V)`` -> ``libglx-nvidia0 (= V)`` ...) and the same virtual packages. A pin that misses one of
them makes real apt give up with "held broken packages" (issue #28); a stand-in tree written by
hand had hidden that. So the tree is read from Debian's archive, not written here:

    python -m sandbox.debian_control > sandbox/data/nvidia-graphics-drivers.json

reads bookworm's ``non-free`` and ``non-free-firmware`` Packages indices from deb.debian.org and
keeps, for source ``nvidia-graphics-drivers`` at one version, the packages that installing
``nvidia-driver``, ``nvidia-kernel-dkms``, ``nvidia-smi`` and ``libcuda1`` pulls in (Depends and
Pre-Depends, not Recommends: the product installs with --no-install-recommends), with their
Depends, Pre-Depends, Provides, Conflicts, Breaks and Replaces. The version is written as
``@VERSION@`` (``535.261.03-1``) and ``@UPSTREAM@`` (``535.261.03``, in virtual package names
such as ``nvidia-kernel-535.261.03``), so that the stand-in builds the same tree for each of its
driver versions.

Relations to packages outside that tree (libc6, dkms, xserver-xorg-core's video ABI, libvdpau1,
glx-alternative-nvidia, nvidia-modprobe, ...) are left out and listed under ``"external"``: on a
sandbox host they would pull X.org and a compiler from Debian for stand-ins that drive nothing.
The tree's own relations, where a pin succeeds or fails, are kept whole.
"""

from __future__ import annotations

import json
import lzma
import re
import sys
import urllib.request
from pathlib import Path

DATA = Path(__file__).with_name("data") / "nvidia-graphics-drivers.json"
ARCHIVE = "http://deb.debian.org/debian"
SUITE = "bookworm"
COMPONENTS = ("non-free", "non-free-firmware")
SOURCE = "nvidia-graphics-drivers"
#: What the product's driver install asks for (operations/plans/driver_names.py DRIVER_PACKAGES,
#: Debian).
ROOTS = ("nvidia-driver", "nvidia-kernel-dkms", "nvidia-smi", "libcuda1")
#: Virtual packages of the open kernel module (Debian's nvidia-open-kernel-dkms provides
#: nvidia-open-kernel-V from trixie on; NVIDIA's repository names the package
#: nvidia-kernel-open-dkms): kept in nvidia-driver's alternatives, the stand-in provides them.
OPEN_MODULE_VIRTUAL = re.compile(r"nvidia-open-kernel-[0-9.]+")
RELATIONS = ("Pre-Depends", "Depends", "Provides", "Conflicts", "Breaks", "Replaces")
FOLLOWED = ("Pre-Depends", "Depends")


def parse_packages(text: str) -> list[dict[str, str]]:
    """A Packages index (deb-control(5) stanzas) as a list of field dicts; continuation lines
    are joined to their field."""
    stanzas = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = None
        for line in block.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if "Package" in fields:
            stanzas.append(fields)
    return stanzas


def _names(relation: str) -> list[list[str]]:
    """``a (>= 1) | b, c`` as [["a", "b"], ["c"]] (names only)."""
    return [[alt.strip().split(" ", 1)[0].split(":", 1)[0] for alt in group.split("|")]
            for group in relation.split(",") if group.strip()]


def tree(stanzas: list[dict[str, str]], version: str) -> dict:
    """The packages of :data:`SOURCE` at ``version`` that :data:`ROOTS` pull in, tokenised (see
    the module docstring)."""
    ours = {s["Package"]: s for s in stanzas
            if s.get("Source", s["Package"]).split(" ", 1)[0] == SOURCE
            and s["Version"] == version}
    provided: dict[str, str] = {}
    for name, s in ours.items():
        for group in _names(s.get("Provides", "")):
            for virtual in group:
                provided.setdefault(virtual, name)
    wanted: list[str] = []
    todo = list(ROOTS)
    while todo:
        name = todo.pop(0)
        name = name if name in ours else provided.get(name, "")
        if not name or name in wanted:
            continue
        wanted.append(name)
        for field in FOLLOWED:
            for group in _names(ours[name].get(field, "")):
                todo.extend(group)
    upstream = version.rsplit("-", 1)[0]
    inside = set(wanted) | {v for v, by in provided.items() if by in wanted}
    external: set[str] = set()
    packages = {}
    for name in sorted(wanted):
        entry = {}
        for field in RELATIONS:
            kept = []
            for group in (g for g in ours[name].get(field, "").split(",") if g.strip()):
                alternatives = [a.strip() for a in group.split("|")]
                mine = [a for a in alternatives if a.split(" ", 1)[0] in inside
                        or OPEN_MODULE_VIRTUAL.fullmatch(a.split(" ", 1)[0])]
                if field in FOLLOWED:
                    external.update(a.split(" ", 1)[0] for a in alternatives if a not in mine)
                if field in ("Provides", "Conflicts", "Breaks", "Replaces") or mine:
                    kept.append(" | ".join(mine if field in FOLLOWED else alternatives))
            text = ", ".join(k for k in kept if k)
            if text:
                entry[field] = text.replace(version, "@VERSION@").replace(upstream, "@UPSTREAM@")
        packages[name] = entry
    return {"source": SOURCE, "version": version, "suite": SUITE,
            "components": list(COMPONENTS), "roots": list(ROOTS), "packages": packages,
            "external": sorted(external - inside)}


def fetch(archive: str = ARCHIVE, suite: str = SUITE) -> list[dict[str, str]]:
    """The stanzas of Debian's Packages indices for :data:`COMPONENTS` (amd64)."""
    stanzas = []
    for component in COMPONENTS:
        url = f"{archive}/dists/{suite}/{component}/binary-amd64/Packages.xz"
        with urllib.request.urlopen(url, timeout=120) as response:  # noqa: S310 (Debian's archive)
            stanzas += parse_packages(lzma.decompress(response.read()).decode())
    return stanzas


def load(path: Path = DATA) -> dict:
    """The tree as :func:`tree` made it (sandbox/data/nvidia-graphics-drivers.json)."""
    return json.loads(path.read_text())


def instantiate(relation: str, version: str) -> str:
    """A tokenised relation for a driver ``version`` with its revision ("580.95.05-1")."""
    upstream = version.rsplit("-", 1)[0]
    return relation.replace("@VERSION@", version).replace("@UPSTREAM@", upstream)


def main() -> int:
    stanzas = fetch()
    versions = sorted({s["Version"] for s in stanzas if s["Package"] == "nvidia-driver"})
    if not versions:
        print(f"no nvidia-driver in {ARCHIVE} {SUITE}", file=sys.stderr)
        return 1
    data = tree(stanzas, versions[-1])
    if not re.fullmatch(r"[0-9.]+-[0-9a-z.~+]+", data["version"]):
        print(f"unexpected version {data['version']!r}", file=sys.stderr)
        return 1
    json.dump(data, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
