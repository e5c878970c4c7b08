"""A node of one SGLang server across hosts: its role read from every node's facts while
planning, and its NCCL environment file.

pyinfra plans the deploy file host by host, each with every host connected: planning one node
reads the other nodes' facts (their network devices and loaded driver) through their own Host
objects, so every node computes the same rank 0 address and refuses the same differences.
Nothing here changes another host: each node writes only its own /etc/gpuhost/nodes.env.
"""

from __future__ import annotations

import shlex
from io import StringIO
from typing import Any, Final

from pyinfra import host, inventory, logger, state
from pyinfra.api import FactBase
from pyinfra.api.operation import OperationMeta
from pyinfra.facts.hardware import NetworkDevices
from pyinfra.operations import files
from typing_extensions import override

from operations import REPO_ROOT
from operations.facts.gpu import NvidiaDriver
from operations.plans.node_group import GroupError, NodeRole, env_file, role_of, shared_network
from operations.plans.plan import fact, fact_of, refuse
from operations.plans.settings import Settings
from operations.stages.venvs import host_venv

NODES_ENV_FILE: Final = "/etc/gpuhost/nodes.env"
#: The all-reduce across the nodes, shipped beside p2p_check.py (operations/stages/p2p.py LIB_DIR).
INTERNODE_CHECK: Final = "/opt/gpuhost/lib/internode_check.py"
STAGE: Final = "Nodes"


class RdmaDevices(FactBase[list[str]]):
    """The RDMA devices the kernel exposes (the entries of /sys/class/infiniband, one per
    device, as rdma-core's ``ibv_devices`` lists them: mlx5_0, ...), or [] where there is
    none (the folder is missing without the ib_core module).

    .. code:: python

        ["mlx5_0", "mlx5_1"]
    """

    @override
    def command(self) -> str:
        return "ls -1 /sys/class/infiniband 2>/dev/null || true"

    @override
    def process(self, output: list[str]) -> list[str]:
        return sorted(line.strip() for line in output if line.strip())

    @override
    def default(self) -> list[str]:
        return []


#: Seconds a connect may take before the target counts as unreachable.
REACH_TIMEOUT_S: Final = 3
_REACH_SCRIPT: Final = r"""
import errno, socket, sys
for target in sys.argv[1:]:
    address, port = target.rsplit(":", 1)
    s = socket.socket()
    s.settimeout(%d)
    try:
        s.connect((address, int(port)))
        print(target, "open")
    except ConnectionRefusedError:
        print(target, "refused")
    except socket.timeout:
        print(target, "timeout")
    except OSError as exc:
        print(target, errno.errorcode.get(exc.errno, str(exc.errno)))
    finally:
        s.close()
""" % REACH_TIMEOUT_S


class NodeReach(FactBase[dict]):
    """Whether this host reaches each ``address:port`` over TCP: "open" (something listens),
    "refused" (the host answered: nothing listens there yet, as on rank 0 before its server
    starts), "timeout", or the errno's name (EHOSTUNREACH, ENETUNREACH, ...).

    .. code:: python

        {"10.0.0.1:25000": "refused", "10.0.0.2:25000": "timeout"}
    """

    @override
    def command(self, targets: tuple[str, ...]) -> str:
        return "python3 -c " + shlex.quote(_REACH_SCRIPT) + " " + " ".join(
            shlex.quote(t) for t in targets)

    @override
    def process(self, output: list[str]) -> dict:
        return dict(line.split(" ", 1) for line in output if " " in line)

    @override
    def default(self) -> dict:
        return {}


def unreached(nodes: tuple[str, ...], reach: dict[str, dict]) -> list[str]:
    """Each node that does not reach rank 0's rendezvous port or another node, one line each
    (a refused connection is reached: the host answered)."""
    found = []
    for name in nodes:
        for target, outcome in sorted(reach.get(name, {}).items()):
            if outcome not in ("open", "refused"):
                found.append(f"{name} does not reach {target} ({outcome})")
        if not reach.get(name):
            found.append(f"{name} could not check what it reaches")
    return found


def reach_targets(name: str, nodes: tuple[str, ...], network: dict[str, tuple[str, str]],
                  port: int) -> tuple[str, ...]:
    """What node ``name`` must reach: rank 0's rendezvous port, and every other node (the
    same port there: a refusal is an answer)."""
    return tuple(f"{network[n][1]}:{port}" for n in nodes if n != name or n == nodes[0])


def _drivers_differ(nodes: tuple[str, ...]) -> str | None:
    """The loaded driver of each node where they differ (nodes without a loaded driver, a
    fresh host, are converged to the same host data first)."""
    versions = {n: fact_of(n, NvidiaDriver).driver_version for n in nodes}
    known = {v for v in versions.values() if v}
    if len(known) <= 1:
        return None
    return "; ".join(f"{n}: {v or 'no driver loaded'}" for n, v in versions.items())


def node_role(settings: Settings) -> NodeRole | None:
    """This host's role in its group (None for a server of its own, or where the group is
    refused: the reason is printed and the host taken out, operations/plans/plan.py)."""
    nodes = settings.nodes
    if not nodes:
        return None
    left_out = [n for n in nodes if not state.is_host_in_limit(inventory.get_host(n))]
    if left_out:
        refuse(STAGE, f"group {', '.join(nodes)}: {', '.join(left_out)} is left out of this "
                      "run (--limit): the nodes of one server are converged together, in one "
                      "run (give --limit every node, or none)")
        return None
    # a node pyinfra could not connect to (or one failed already) has no facts to read: its
    # get_fact would end the whole run with pyinfra's own error
    absent = [n for n in nodes if inventory.get_host(n) not in state.active_hosts]
    if absent:
        refuse(STAGE, f"group {', '.join(nodes)}: {', '.join(absent)} is not in this run (not "
                      "connected, or failed): the nodes of one server are converged together; "
                      "the group is left as it is")
        return None
    devices = {n: fact_of(n, NetworkDevices) for n in nodes}
    try:
        network = shared_network(nodes, devices, settings.node_interface)
    except GroupError as exc:
        refuse(STAGE, str(exc))
        return None
    port = settings.dist_init_port
    reach = {n: fact_of(n, NodeReach, targets=reach_targets(n, nodes, network, port))
             for n in nodes}
    lost = unreached(nodes, reach)
    if lost:
        refuse(STAGE, f"group {', '.join(nodes)}: rendezvous {network[nodes[0]][1]}:{port} "
                      f"checked from every node before any restart: {'; '.join(lost)}")
        return None
    differ = _drivers_differ(nodes)
    if differ:
        refuse(STAGE, f"group {', '.join(nodes)}: the loaded NVIDIA driver differs between its "
                      f"nodes ({differ}): every node must run the same driver")
        return None
    role = role_of(host.name, nodes, settings.dist_init_port, network,
                   tuple(fact(RdmaDevices)))
    rdma = (f"RDMA devices {', '.join(role.rdma_devices)}: NCCL_IB_DISABLE=0"
            if role.rdma_devices else "no RDMA device (/sys/class/infiniband): NCCL_IB_DISABLE=1")
    logger.info(f"{host.print_prefix}{STAGE}: node rank {role.node_rank} of {role.nnodes} "
                f"({', '.join(nodes)}), rendezvous {role.dist_init_addr}; NCCL_SOCKET_IFNAME="
                f"GLOO_SOCKET_IFNAME={role.interface}; {rdma}")
    return role


def nodes_env(role: NodeRole | None, settings: Settings) -> list[OperationMeta]:
    """Write /etc/gpuhost/nodes.env for a node (the unit reads it after p2p.env); on a host
    that is no node (any more: it left its group), remove it and internode_check.py, so that
    nothing of a rank is left on a server of its own. Returns the operations whose change
    means the server must restart."""
    if role is None:
        if settings.nodes:  # a node of a group refused while planning: left as it is
            return []
        return [files.file(name=f"Remove {path} (no node of a group)", path=path, present=False)
                for path in (NODES_ENV_FILE, INTERNODE_CHECK)]
    files.put(name="Ship internode_check.py", src=str(REPO_ROOT / "operations/files/"
                                                       "internode_check.py"),
              dest=INTERNODE_CHECK, mode="644")
    # An operation is one row of pyinfra's plan, named after whichever host planned it first:
    # planned at a loop position of the node's rank, each rank's file is a row of its own
    # ("/etc/gpuhost/nodes.env (node rank 1)  1 (gpu2)"), not every host's under one rank.
    for rank in host.loop(range(role.node_rank + 1)):
        if rank == role.node_rank:
            written = files.put(name=f"{NODES_ENV_FILE} (node rank {rank})",
                                src=StringIO(env_file(role)), dest=NODES_ENV_FILE, mode="644")
    return [written]


def internode_argv(settings: Settings, role: NodeRole, env_files: tuple[str, ...]) -> tuple:
    """The command line of the all-reduce across the nodes on this node (every server
    stopped, so rank 0's rendezvous port is free for it)."""
    # the lock's venv, the one the servers start from (gpuhost_venv_path links to it only once
    # the health gate passed: operations/stages/venvs.py)
    argv = [f"{host_venv(settings.lock_path)}/bin/python", INTERNODE_CHECK, "--nnodes",
            str(role.nnodes),
            "--node-rank", str(role.node_rank), "--gpus", str(settings.gpu_count),
            "--dist-init-addr", role.dist_init_addr,
            "--timeout", str(settings.p2p_check_timeout)]
    for path in env_files:
        argv += ["--env-file", path]
    return tuple(argv)

