"""Each host's network namespace and its one veth link to this machine."""

from __future__ import annotations

import re
import subprocess

from sandbox.layout import LAB, HostSpec

# This lab's names only (HostSpec.netns, HostSpec.veth): never another lab's.
_NETNS = re.compile(rf"^gpuhost{LAB or ''}-gpu\d+$")
_VETH = re.compile(rf"^gh{LAB}x\d+$" if LAB else r"^gh\d+$")


class NetworkError(RuntimeError):
    """An `ip` command failed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def link_commands(spec: HostSpec) -> list[list[str]]:
    """The `ip` argument lists that build the host's link: ghN (gateway) <-> eth0 (address)."""
    ns = spec.netns
    return [
        ["netns", "add", ns],
        ["link", "add", spec.veth, "type", "veth", "peer", "name", "eth0", "netns", ns],
        ["addr", "add", f"{spec.gateway}/24", "dev", spec.veth],
        ["link", "set", spec.veth, "up"],
        ["-n", ns, "link", "set", "lo", "up"],
        ["-n", ns, "addr", "add", f"{spec.address}/24", "dev", "eth0"],
        ["-n", ns, "link", "set", "eth0", "up"],
        ["-n", ns, "route", "add", "default", "via", spec.gateway],
    ]


def create(spec: HostSpec) -> None:
    """The namespace and link of `spec`; raises NetworkError if a name is already taken."""
    for args in link_commands(spec):
        _ip(*args)


def set_link(spec: HostSpec, up: bool) -> None:
    """Drop (``up=False``) or bring back the host's side of its link, as a cable pulled at the
    host: eth0 inside its namespace goes down (its default route with it) or comes back with
    the route. This machine's side and routes are left alone."""
    ns = spec.netns
    if up:
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "route", "replace", "default", "via", spec.gateway)
    else:
        _ip("-n", ns, "link", "set", "eth0", "down")


def lab_namespaces() -> list[str]:
    """Network namespaces on this machine named as the lab names them."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line and _NETNS.match(line.split()[0])]


def lab_links() -> list[str]:
    """Links on this machine named as the lab names its veth ends."""
    out = _ip("-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if _VETH.match(n)]


def namespace_pids(netns: str) -> list[int]:
    """PIDs of processes inside the namespace."""
    out = _ip("netns", "pids", netns, check=False).stdout
    return [int(p) for p in out.split()]


def remove_all() -> None:
    """Delete every lab link and namespace (the peer eth0 goes with its namespace)."""
    for link in lab_links():
        _ip("link", "del", link, check=False)
    for ns in lab_namespaces():
        _ip("netns", "del", ns, check=False)
