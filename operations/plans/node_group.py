"""One SGLang server across several hosts: the group, its ranks, its rendezvous and NCCL's
interface, from host data and facts (no pyinfra here: operations/stages/nodes.py reads the facts).

An inventory group whose data sets ``gpuhost_nodes`` (its hosts, rank 0 first) is one server:
every node runs the same ``launch_server`` command with ``--nnodes N --node-rank i
--dist-init-addr <rank 0's address>:<gpuhost_dist_init_port>`` added (sglang 0.5.9's flags,
locks/sglang-0.5.9.args.json, read from the wheel's sglang/srt/server_args.py). Rank 0 serves
HTTP; the others serve only sglang's dummy /health (sglang/srt/entrypoints/engine.py,
``_launch_subprocesses``: ``if server_args.node_rank >= 1`` ... ``launch_dummy_health_check_
server``).

The nodes must run one thing: the same lock (by content), model and revision, driver and the
same server flags; a difference is refused before any host is touched, naming the hosts and
what differs (:func:`check_groups`). The interface the nodes share is the IPv4 network every
node has an address in (or ``gpuhost_node_interface``, named in host data): rank 0's address
there is the rendezvous address; each node's own interface name there is its
``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` (:func:`shared_network`, :func:`node_env`).
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final

#: operations.plans.settings.Settings, by name only: settings imports this module to check the
#: groups, so this one reads the settings it is given without importing their class.
Settings = Any

PREFIX: Final = "gpuhost_"

#: What every node of a group must share, as host data keys (without the prefix). The lock is
#: compared by content (its sha256), the server flags as rendered (operations/plans/sglang.py).
IDENTICAL: Final = ("lock", "model", "model_revision", "driver_branch", "driver_version",
                    "driver_flavour", "cuda_toolkit", "gpu_count", "compute_capability",
                    "tensor_parallel_size", "pipeline_parallel_size", "node_interface",
                    "dist_init_port")


class GroupError(ValueError):
    """A group whose nodes cannot make one server: the message names the hosts and what
    differs or is missing."""


@dataclass(frozen=True)
class NodeRole:
    """One host's place in a server across nodes.

    + nodes: the group's hosts, rank 0 first
    + node_rank: this host's index in ``nodes``
    + dist_init_addr: ``<rank 0's address>:<port>``, sglang's --dist-init-addr
    + interface: this host's interface on the network the nodes share
    + rdma_devices: /sys/class/infiniband's entries on this host (none: NCCL_IB_DISABLE=1)
    """

    nodes: tuple[str, ...]
    node_rank: int
    dist_init_addr: str
    interface: str
    rdma_devices: tuple[str, ...] = ()

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def rank0(self) -> str:
        return self.nodes[0]

    @property
    def rendezvous(self) -> tuple[str, int]:
        host, _, port = self.dist_init_addr.rpartition(":")
        return host, int(port)

    def server_args(self) -> list[str]:
        """The flags this node adds to the launch (sglang 0.5.9: --nnodes, --node-rank,
        --dist-init-addr)."""
        return ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                "--dist-init-addr", self.dist_init_addr]


def lock_digest(settings: Settings) -> str:
    """sha256 of the lock file's bytes, or why it cannot be read (said by the lock's own check)."""
    try:
        return hashlib.sha256(settings.lock_path.read_bytes()).hexdigest()
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def _identity(settings: Settings) -> dict[str, Any]:
    from operations.plans.sglang import server_args

    found: dict[str, Any] = {key: getattr(settings, key) for key in IDENTICAL}
    found["lock"] = f"{settings.lock} (sha256 {lock_digest(settings)[:12]})"
    found["server flags"] = " ".join(server_args(settings))
    return found


def check_groups(settings: Mapping[str, Settings], refused: Collection[str] = ()) -> list[str]:
    """Every problem of every group, one line each: a node that is no host of the inventory, a
    node whose own ``gpuhost_nodes`` names another group, a node asked to roll back alone
    (``gpuhost_rollback``), and nodes that differ in any of IDENTICAL or the server flags
    (naming the hosts and each value).

    + settings: every host's validated settings, by host name
    + refused: hosts whose own data was refused (their problems are listed already): a group
      with one of them is not compared, as its settings are not known
    """
    problems: list[str] = []
    seen: set[tuple[str, ...]] = set()
    for name, s in settings.items():
        if not s.nodes or s.nodes in seen or any(n in refused for n in s.nodes):
            continue
        seen.add(s.nodes)
        shown = ", ".join(s.nodes)
        missing = [n for n in s.nodes if n not in settings]
        if missing:
            problems.append(f"host {name}: {PREFIX}nodes = {list(s.nodes)} names "
                            f"{', '.join(missing)}, which the inventory has no host of: each "
                            "node must be a host of the inventory")
            continue
        other = [n for n in s.nodes if settings[n].nodes != s.nodes]
        if other:
            problems.append(
                f"group {shown}: " + "; ".join(
                    f"host {n} has {PREFIX}nodes = {list(settings[n].nodes)}" for n in other)
                + f": every node of a group needs the group's own list ({list(s.nodes)})")
            continue
        rolling_back = [n for n in s.nodes if settings[n].rollback]
        if rolling_back:
            problems.append(
                f"group {shown}: {PREFIX}rollback = True on {', '.join(rolling_back)}: allowed "
                "on a node of a server across hosts: False only (a node has no last known good "
                "of its own: its ranks restart together, never one alone); roll the group "
                "back by deploying every node with the lock and host data it last served with")
        identities = {n: _identity(settings[n]) for n in s.nodes}
        for key in identities[s.nodes[0]]:
            values = {n: identities[n][key] for n in s.nodes}
            if len({repr(v) for v in values.values()}) > 1:
                label = key if key == "server flags" else f"{PREFIX}{key}"
                problems.append(
                    f"group {shown}: {label} differs between its nodes ("
                    + "; ".join(f"{n}: {v!r}" for n, v in values.items())
                    + "): every node must run the same lock, model, driver and flags")
    return problems


def networks(devices: Mapping[str, Any]) -> dict[str, list[ipaddress.IPv4Interface]]:
    """The IPv4 addresses (with their prefix) of each interface that is up, loopback aside,
    from pyinfra's NetworkDevices fact (``{"eth0": {"state": "UP", "ipv4": {"address":
    "10.0.0.2", "mask_bits": 24, "additional_ips": [...]}}}``)."""
    found: dict[str, list[ipaddress.IPv4Interface]] = {}
    for name, info in devices.items():
        ipv4 = info.get("ipv4") or {}
        entries = [ipv4, *ipv4.get("additional_ips", [])] if ipv4.get("address") else []
        addresses = [ipaddress.IPv4Interface(f"{e['address']}/{e.get('mask_bits', 32)}")
                     for e in entries]
        addresses = [a for a in addresses if not a.ip.is_loopback]
        if addresses and info.get("state") != "DOWN":
            found[name] = addresses
    return found


def shared_network(nodes: tuple[str, ...], devices: Mapping[str, Mapping[str, Any]],
                   interface: str | None = None) -> dict[str, tuple[str, str]]:
    """Each node's (interface, address) on the IPv4 network the nodes share.

    + nodes: the group's hosts, rank 0 first
    + devices: each node's NetworkDevices fact
    + interface: the interface named in host data (gpuhost_node_interface), else found: the
      network every node has an address in; more than one such network must be told apart
      by naming the interface

    Raises :class:`GroupError` naming the nodes and the interfaces each has.
    """
    nets = {n: networks(devices.get(n, {})) for n in nodes}
    shown = ", ".join(nodes)

    def has(node: str) -> str:
        listed = [f"{i} {a.with_prefixlen}" for i, addrs in sorted(nets[node].items())
                  for a in addrs]
        return f"{node}: {', '.join(listed) or 'no IPv4 address up'}"

    if interface is not None:
        lacking = [n for n in nodes if interface not in nets[n]]
        if lacking:
            raise GroupError(f"group {shown}: {PREFIX}node_interface = {interface!r}: "
                             f"{', '.join(lacking)} has no IPv4 address up on it ("
                             + "; ".join(has(n) for n in lacking) + ")")
        candidates = {a.network for a in nets[nodes[0]][interface]}
    else:
        candidates = {a.network for addrs in nets[nodes[0]].values() for a in addrs}
    common = [net for net in sorted(candidates, key=str)
              if all(any(a.network == net for addrs in nets[n].values() for a in addrs)
                     for n in nodes)]
    if not common:
        raise GroupError(f"group {shown}: no IPv4 network that every node has an address in ("
                         + "; ".join(has(n) for n in nodes) + "): the nodes must reach each "
                         "other on one network (or name it: " + PREFIX + "node_interface)")
    if len(common) > 1:
        raise GroupError(f"group {shown}: the nodes share more than one network ("
                         + ", ".join(map(str, common)) + "): name the interface with "
                         + PREFIX + "node_interface (" + "; ".join(has(n) for n in nodes) + ")")
    net = common[0]
    found: dict[str, tuple[str, str]] = {}
    for n in nodes:
        for name, addrs in sorted(nets[n].items()):
            if interface is not None and name != interface:
                continue
            match = next((a for a in addrs if a.network == net), None)
            if match is not None:
                found[n] = (name, str(match.ip))
                break
    return found


def node_env(role: NodeRole) -> dict[str, str]:
    """NCCL's and Gloo's settings for one node: the socket interface of the shared network
    (NCCL_SOCKET_IFNAME; GLOO_SOCKET_IFNAME, which torch.distributed's Gloo reads), and
    NCCL_IB_DISABLE=1 only where no RDMA device exists (/sys/class/infiniband empty: NCCL's
    IB transport has nothing to open); where one exists, NCCL_IB_DISABLE=0 (NCCL's default,
    written out because the host's P2P decision, p2p.env, sets 1 for a server of one host).
    NCCL's environment variables: docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html.
    """
    return {
        "NCCL_SOCKET_IFNAME": role.interface,
        "GLOO_SOCKET_IFNAME": role.interface,
        "NCCL_IB_DISABLE": "0" if role.rdma_devices else "1",
    }


def env_file(role: NodeRole) -> str:
    """/etc/gpuhost/nodes.env: :func:`node_env` as a systemd EnvironmentFile, read after
    p2p.env (so its NCCL_IB_DISABLE is the one the server gets)."""
    lines = [f"# Written by gpuhost: node rank {role.node_rank} of {role.nnodes} "
             f"({', '.join(role.nodes)}), rendezvous {role.dist_init_addr}"]
    lines += [f"{k}={v}" for k, v in sorted(node_env(role).items())]
    return "\n".join(lines) + "\n"


def role_of(host: str, nodes: tuple[str, ...], port: int,
            network: Mapping[str, tuple[str, str]], rdma: tuple[str, ...]) -> NodeRole:
    """The role of ``host`` in ``nodes``, from :func:`shared_network`'s answer."""
    interface, _ = network[host]
    _, rank0_address = network[nodes[0]]
    return NodeRole(nodes, nodes.index(host), f"{rank0_address}:{port}", interface,
                    tuple(sorted(rdma)))
