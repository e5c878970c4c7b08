"""Each host's network namespace, its veth link to this machine, and the lab switch.

The switch (sandbox/README.md, "The lab switch") is a Linux bridge inside a network namespace of
the lab's own: each host has a second veth pair, eth1 in its namespace and a port on the bridge,
with an address on the lab's switch subnet, so the hosts reach each other without this machine
routing anything. The switch namespace has no address, no route and forwarding off (IPv4 and
IPv6; IPv6 disabled altogether), and holds nothing but the bridge and its ports: a frame put on
it reaches the lab's hosts and nothing else, and nothing in this machine's own namespace
(routes, sysctls, links) is touched.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time

from sandbox.layout import LAB, SWITCH_BRIDGE, SWITCH_IFACE, SWITCH_NETNS, HostSpec

# This lab's names only (HostSpec.netns, HostSpec.veth, the switch): never another lab's.
_NETNS = re.compile(rf"^gpuhost{LAB or ''}-(gpu\d+|switch)$")
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


#: Set inside the switch namespace before the bridge exists (so its ports inherit "default"):
#: no forwarding, and no IPv6 address (not even link-local) on the bridge or its ports.
SWITCH_SYSCTLS: tuple[str, ...] = (
    "net.ipv4.ip_forward=0",
    "net.ipv6.conf.all.forwarding=0",
    "net.ipv6.conf.all.disable_ipv6=1",
    "net.ipv6.conf.default.disable_ipv6=1",
)


def switch_commands() -> list[list[str]]:
    """The `ip` argument lists that build the lab switch: its namespace, the sysctls, the
    bridge (no address)."""
    sw = SWITCH_NETNS
    return [
        ["netns", "add", sw],
        ["netns", "exec", sw, "sysctl", "-q", "-w", *SWITCH_SYSCTLS],
        ["-n", sw, "link", "set", "lo", "up"],
        ["-n", sw, "link", "add", SWITCH_BRIDGE, "type", "bridge"],
        ["-n", sw, "link", "set", SWITCH_BRIDGE, "up"],
    ]


def port_commands(spec: HostSpec) -> list[list[str]]:
    """The `ip` argument lists that plug `spec` into the switch: eth1 (its switch address, no
    gateway) <-> portN on the bridge. The pair is made inside the host's namespace and its
    peer moved into the switch's, so it never appears in this machine's namespace."""
    ns, sw = spec.netns, SWITCH_NETNS
    return [
        ["-n", ns, "link", "add", SWITCH_IFACE, "type", "veth",
         "peer", "name", spec.switch_port, "netns", sw],
        ["-n", sw, "link", "set", spec.switch_port, "master", SWITCH_BRIDGE],
        ["-n", sw, "link", "set", spec.switch_port, "up"],
        ["-n", ns, "addr", "add", f"{spec.switch_address}/24", "dev", SWITCH_IFACE],
        ["-n", ns, "link", "set", SWITCH_IFACE, "up"],
    ]  # fmt: skip


def create_switch() -> None:
    """The lab switch (before any host's port); raises NetworkError if it already exists."""
    for args in switch_commands():
        _ip(*args)


def create(spec: HostSpec) -> None:
    """The namespace, link and switch port of `spec`; raises NetworkError if a name is already
    taken or the switch is missing."""
    for args in link_commands(spec) + port_commands(spec):
        _ip(*args)


def set_link(spec: HostSpec, up: bool, switch_only: bool = False) -> None:
    """Drop (``up=False``) or bring back the host's side of its link, as a cable pulled at the
    host: eth0 inside its namespace goes down (its default route with it) or comes back with
    the route, and its switch port eth1 with it (the host is off the whole network). With
    ``switch_only`` only eth1 (the host is off the switch, still reached from this machine: its
    peers cannot reach it, the controller can). This machine's side and routes, and the switch,
    are left alone."""
    ns = spec.netns
    if switch_only:
        _ip("-n", ns, "link", "set", SWITCH_IFACE, "up" if up else "down")
    elif up:
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "route", "replace", "default", "via", spec.gateway)
        _ip("-n", ns, "link", "set", SWITCH_IFACE, "up")
        _answering(spec)
    else:
        _ip("-n", ns, "link", "set", "eth0", "down")
        _ip("-n", ns, "link", "set", SWITCH_IFACE, "down")


def _answering(spec: HostSpec, within_s: float = 15.0) -> None:
    """Wait until the host's SSH port answers on its link again: the neighbour entry this
    machine marked FAILED while the link was down gives "No route to host" until resolved
    anew (a test's first ssh right after ``link up`` met it). Silent past ``within_s``: the
    link is up; what answers on it is the host's business."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((spec.address, 22), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)


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
    """Delete every lab link and namespace, the switch's with them (a veth pair goes with
    either of its namespaces)."""
    for link in lab_links():
        _ip("link", "del", link, check=False)
    for ns in lab_namespaces():
        _ip("netns", "del", ns, check=False)
