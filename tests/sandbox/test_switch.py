"""The lab switch end to end (root, e2e): two booted hosts reach each other over it and nothing
else through it; this machine's routes and forwarding settings are as they were before `up` and
after `down`.

Checks go through plain ssh, `ip` and /proc, never through the lab's own helpers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.layout import LAB

ROOT = Path(__file__).resolve().parents[2]
NET = f"10.{213 + LAB}"
SWITCH_NS = f"gpuhost{LAB or ''}-switch"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="boots sandbox hosts: needs root"),
]


def _sandbox(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "sandbox", *args], cwd=ROOT, text=True,
                          capture_output=True, check=False)
    assert proc.returncode == 0, f"sandbox {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}"
    return proc.stdout


def _machine() -> dict[str, str]:
    """This machine's own routes and forwarding settings, as `ip` and /proc give them."""
    out = {}
    for family in ("-4", "-6"):
        out[f"route{family}"] = subprocess.run(["ip", family, "route", "show", "table", "all"],
                                               text=True, capture_output=True).stdout
    for path in sorted(Path("/proc/sys/net/ipv4/conf").glob("*/forwarding")) + sorted(
        Path("/proc/sys/net/ipv6/conf").glob("*/forwarding")
    ):
        if path.parent.name in ("all", "default") or not path.parent.name.startswith("gh"):
            out[str(path)] = path.read_text().strip()
    out["ip_forward"] = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
    return out


def _own(machine: dict[str, str]) -> dict[str, str]:
    """This machine's own routes and settings: without the lines of any lab's links (ghN,
    ghLxN), which this lab's `up` adds and `down` removes, and other labs' runs beside it."""
    own = dict(machine)
    for key in ("route-4", "route-6"):
        own[key] = "\n".join(line for line in machine[key].splitlines()
                             if not re.search(r"\bdev gh\d", line))
    return own


def _ssh(host: dict, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ssh", "-i", host["ssh_key"], "-o", "StrictHostKeyChecking=no",
         "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
         "-o", "ConnectTimeout=3", f"root@{host['address']}", command],
        text=True, capture_output=True, timeout=60, check=False,
    )  # fmt: skip


def _connects(host: dict, address: str, port: int = 22) -> bool:
    """Whether a TCP connection from `host` to address:port opens within 3 s."""
    probe = (f"python3 -c \"import socket; socket.create_connection(('{address}', {port}), 3)\"")
    return _ssh(host, probe).returncode == 0


@pytest.fixture(scope="module")
def lab():
    before = _machine()
    _sandbox("up", "--hosts", "2")
    hosts = json.loads(_sandbox("status", "--json"))
    yield before, hosts
    _sandbox("down")


def test_hosts_reach_each_other_over_the_switch(lab):
    _, (gpu1, gpu2) = lab
    assert (gpu1["switch_address"], gpu2["switch_address"]) == (f"{NET}.0.1", f"{NET}.0.2")
    assert _connects(gpu1, gpu2["switch_address"]) and _connects(gpu2, gpu1["switch_address"])
    route = _ssh(gpu1, f"ip route get {gpu2['switch_address']}").stdout
    assert "dev eth1" in route and " via " not in route  # straight over the switch


def test_nothing_else_is_reached_through_the_switch(lab):
    _, (gpu1, gpu2) = lab
    # gpu2's link address (behind this machine, which forwards nothing) and an address outside
    # the lab sent onto the switch: neither answers
    assert not _connects(gpu1, gpu2["address"])
    # (the container has no CAP_NET_ADMIN: the route is added from this machine)
    subprocess.run(["ip", "-n", f"gpuhost{LAB or ''}-gpu1", "route", "add", "198.51.100.7/32",
                    "via", gpu2["switch_address"], "dev", "eth1"], check=True)
    assert not _connects(gpu1, "198.51.100.7")
    # the switch: a bridge and its two ports, no address, no route, forwarding off
    links = subprocess.run(["ip", "-n", SWITCH_NS, "-o", "link"], text=True,
                           capture_output=True, check=True).stdout
    names = sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines())
    assert names == ["br0", "lo", "port1", "port2"]
    addrs = subprocess.run(["ip", "-n", SWITCH_NS, "-o", "addr"], text=True,
                           capture_output=True, check=True).stdout
    assert [line for line in addrs.splitlines() if " lo " not in line] == []
    for family in ("-4", "-6"):
        routes = subprocess.run(["ip", "-n", SWITCH_NS, family, "route", "show", "table", "all"],
                                text=True, capture_output=True, check=True).stdout
        assert [line for line in routes.splitlines() if " dev lo " not in line] == []
    forwarding = subprocess.run(["ip", "netns", "exec", SWITCH_NS, "cat",
                                 "/proc/sys/net/ipv4/ip_forward"], text=True,
                                capture_output=True, check=True).stdout.strip()
    assert forwarding == "0"


def test_this_machine_is_as_it_was(lab):
    before, _ = lab
    assert _own(_machine()) == _own(before)
    _sandbox("down")
    assert _own(_machine()) == _own(before)
    assert SWITCH_NS not in subprocess.run(["ip", "netns", "list"], text=True,
                                           capture_output=True).stdout.split()
