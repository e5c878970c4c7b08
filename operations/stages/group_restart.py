"""Start and restart a server across nodes as one: every rank together, rank 0 first, never
one rank alone; the health gate on rank 0.

Why the order holds: pyinfra plans the deploy file host by host, then executes it operation by
operation, each operation on every host at once and all of them done before the next one
starts (pyinfra 3, ``pyinfra/api/operations.py``, ``run_ops`` without --serial/--no-wait). An
operation's place is the line numbers of its call stack (``get_operation_order_from_stack``),
the same on every node for the same code. So the operations below, called by each node at
these lines in this order, run in this order across the group:

1. ``nodes present``: where the group restarts, each node checks that every node of its group
   is still in the run (a node refused while planning, or failed in an earlier stage, leaves
   the others as they are: no restart of part of the group);
2. ``stop``: every node stops its server when the group restarts;
3. ``all-reduce across the nodes``: on every node at once, with every server stopped, an NCCL
   all-reduce over every GPU of every node (operations/files/internode_check.py), its
   bandwidth printed; a node where it fails leaves the run, and then no node starts;
4. ``start rank 0``: rank 0 starts (``systemctl start --no-block``: it waits in the
   rendezvous);
5. ``start ranks 1..N-1``: the others start, after rank 0 on every host;
6. the health gate, on rank 0 (only rank 0 serves the model; a rank >= 1 answers sglang's
   dummy /health only);
7. ``follow rank 0``: a rank >= 1 whose rank 0 failed the gate, or whose own server died,
   stops its server and shows the last 50 lines of its own journal, so the group is down on
   every node, visibly, with each rank's own words.

The group restarts when anything a server reads changed on any node (every node registers its
changing operations while planning; their results are read when step 2 runs, after all of them
ran on every host), when a node's server runs stale, or when a node's server is not running (a
fresh group, or a rank that died: its journal is shown). A no-op run restarts nothing on any
node. The units of a node do not restart themselves (``Restart=no``): a rank restarted alone
would wait in a rendezvous the others are not in.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Final

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.api.operation import OperationMeta

from operations.runtime import remote
from operations.plans.node_group import NodeRole

UNIT: Final = "sglang.service"


@dataclass
class NodePlan:
    """What planning found on one node: the operations whose change restarts the server, and
    why it must start even without a change (not running, stale), or None."""

    changes: list[OperationMeta] = field(default_factory=list)
    must_start: str | None = None
    #: When its server stopped (seconds since the epoch, systemd's InactiveEnterTimestamp),
    #: where it is not running; None where it runs or never ran.
    stopped_at: float | None = None


#: Every group's nodes as planned, by the group's node list, then by host name.
GROUPS: dict[tuple[str, ...], dict[str, NodePlan]] = {}


def register(role: NodeRole, changes: list[OperationMeta], must_start: str | None,
             stopped_at: float | None = None) -> None:
    """Record this node's plan for the group's restart decision."""
    GROUPS.setdefault(role.nodes, {})[host.name] = NodePlan(list(changes), must_start,
                                                            stopped_at)


def first_stopped(nodes: tuple[str, ...]) -> str | None:
    """Where servers of the group are not running: which rank stopped first, by the time
    systemd says each stopped ("gpu2 (node rank 1) stopped first, at 09:48:01 UTC; gpu1
    (node rank 0) 4 s later"); None where fewer than two say when."""
    plans = GROUPS.get(nodes, {})
    stopped = sorted((plans[n].stopped_at, nodes.index(n), n) for n in nodes
                     if n in plans and plans[n].must_start and plans[n].stopped_at is not None)
    if len(stopped) < 2:
        return None
    (first, rank, name), *later = stopped
    at = datetime.fromtimestamp(first, timezone.utc).strftime("%H:%M:%S UTC")
    after = "; ".join(f"{n} (node rank {r}) {t - first:.0f} s later" for t, r, n in later)
    return f"{name} (node rank {rank}) stopped first, at {at}; {after}"


def restart_reason(nodes: tuple[str, ...]) -> str | None:
    """Why the group restarts, read while the operations execute (after every node's changes
    ran), or None. Where several ranks' servers are not running, the one that stopped first
    is named: the others' stop follows from it (a rank whose peer left its collectives)."""
    plans = GROUPS.get(nodes, {})
    first = first_stopped(nodes)
    if first is not None:
        name = first.split(" ", 1)[0]
        return f"{name}: {plans[name].must_start}; {first}"
    for name in nodes:
        plan = plans.get(name)
        if plan is None:
            continue
        if plan.must_start:
            return f"{name}: {plan.must_start}"
        changed = [op for op in plan.changes if op.is_complete() and op.did_change()]
        if changed:
            return f"{name}: what its server reads changed"
    return None


def _missing(state, nodes: tuple[str, ...]) -> list[str]:
    active = {h.name for h in state.active_hosts}
    return [n for n in nodes if n not in active or n not in GROUPS.get(nodes, {})]


@remote.callback("the group check")
def _nodes_present(state, host, nodes: tuple[str, ...]) -> bool:
    missing = _missing(state, nodes)
    if not missing:
        return True
    logger.error(f"{host.print_prefix}Nodes: {', '.join(missing)} of the group "
                 f"{', '.join(nodes)} is out of this run (refused or failed): the servers of "
                 "the group are left as they are (a rank is never restarted alone)")
    return False


@operation(is_idempotent=False)
def nodes_present(nodes: tuple[str, ...]):
    """Fail this node when another node of its group is out of the run."""
    yield FunctionCommand(_nodes_present, (nodes,), {})


@operation(is_idempotent=False)
def unit_stopped(unit: str):
    """Stop ``unit`` (the group restarts)."""
    yield f"systemctl stop {unit}"


@operation(is_idempotent=False)
def unit_started_now(unit: str):
    """Start ``unit`` without waiting for it (operations/stages/systemd_units.py,
    ``unit_started``)."""
    yield f"systemctl reset-failed {unit} 2>/dev/null || true"
    yield f"systemctl start --no-block {unit}"


@remote.callback("the all-reduce across the nodes")
def _internode(state, host, argv: list[str]) -> bool:
    ok, out = remote.shell(host, StringCommand(*(shlex.quote(a) for a in argv)),
                           _success_exit_codes=[0, 1])
    lines = out.stdout_lines + out.stderr_lines
    failed = not ok or not out.stdout_lines
    for line in lines:
        (logger.error if failed else logger.info)(f"{host.print_prefix}Nodes: {line}")
    return not failed


@operation(is_idempotent=False)
def internode_checked(argv: tuple[str, ...]):
    """Run the all-reduce across the nodes (every node runs this operation at once)."""
    yield FunctionCommand(_internode, (list(argv),), {})


#: Lines of a rank's own journal shown when the group goes down (its last ones).
JOURNAL_LINES: Final = 50


def down_message(rank: int, rank0: str, rank0_failed: bool, active: str) -> str:
    """What a rank >= 1 says when the group is down: whether its own server died (``active``:
    ``systemctl is-active``'s word) and whether rank 0 failed its health gate."""
    if active == "active":
        return (f"rank 0 ({rank0}) failed its health gate: {UNIT} (node rank {rank}) stopped "
                "here too")
    gate = f"; rank 0 ({rank0}) failed its health gate" if rank0_failed else ""
    return (f"{UNIT} (node rank {rank}) died here (it is {active}){gate}: the group is down, "
            "every rank stopped")


#: Seconds a rank >= 1 still "activating" is waited for before it counts as not running.
ACTIVATING_WAIT_S: Final = 60


@remote.callback("the group's health gate")
def _follow_rank0(state, host, rank0: str, rank: int, journal_lines: int) -> bool:
    rank0_failed = rank0 in {h.name for h in state.failed_hosts}
    # a rank started without blocking may still be "activating" when rank 0's gate passes
    # quickly (seen in the sandbox: rank 1 stopped in the second it started): wait for it
    wait = (f"for i in $(seq {ACTIVATING_WAIT_S}); do "
            f"test \"$(systemctl is-active {UNIT})\" = activating || break; sleep 1; done; ")
    _, seen = remote.shell(host, wait + f"systemctl is-active {UNIT} || true")
    active = (seen.stdout_lines or ["unknown"])[-1].strip()
    if not rank0_failed and active == "active":
        return True
    ok, out = remote.shell(host, f"systemctl stop {UNIT}; journalctl -u {UNIT} -n "
                                 f"{journal_lines} --no-pager -o cat")
    lines = "".join(f"\n    {line}" for line in out.stdout_lines) if ok else ""
    logger.error(f"{host.print_prefix}Nodes: {down_message(rank, rank0, rank0_failed, active)}. "
                 f"The last {journal_lines} lines of its journal on {host.name}:{lines}")
    return False


@operation(is_idempotent=False)
def follows_rank0(rank0: str, rank: int, journal_lines: int = JOURNAL_LINES):
    """Stop this rank's server and fail, showing its own journal, when rank 0 failed the gate
    or this rank's server died."""
    yield FunctionCommand(_follow_rank0, (rank0, rank, journal_lines), {})


def converge(role: NodeRole, check: tuple[str, ...]) -> tuple[OperationMeta, ...]:
    """Steps 1 to 5 of the module docstring on this node; returns the operations whose change
    means its server (re)started. The caller then gates rank 0 and calls :func:`follow` on
    the others, at a later line.

    + role: this node's place in the group
    + check: the command line of the all-reduce across the nodes (internode_check.py)
    """
    nodes = role.nodes
    # only where the group restarts: a no-op run reports no change on any node
    nodes_present(name=f"Every node of {', '.join(nodes)} in this run", nodes=nodes,
                  _if=lambda: restart_reason(nodes) is not None)

    def restarting() -> bool:
        reason = restart_reason(nodes)
        if reason:
            logger.info(f"{host.print_prefix}Nodes: the group restarts ({reason}): every "
                        "rank, rank 0 first")
        return reason is not None

    stop = unit_stopped(name=f"Stop {UNIT} on every node (the group restarts)", unit=UNIT,
                        _if=restarting)
    internode_checked(name=f"NCCL all-reduce across {', '.join(nodes)}", argv=check,
                      _if=stop.did_change)

    def starting() -> bool:
        # every node passed the all-reduce (a node that failed it is out of the run)
        return stop.did_change() and not _missing(state, nodes)

    if role.node_rank == 0:
        start = unit_started_now(name=f"Start {UNIT}: rank 0 first", unit=UNIT, _if=starting)
    else:
        start = unit_started_now(name=f"Start {UNIT}: rank {role.node_rank}, after rank 0",
                                 unit=UNIT, _if=starting)
    return stop, start


def follow(role: NodeRole, started: tuple[OperationMeta, ...]) -> None:
    """Step 7 on a rank >= 1, after rank 0's health gate."""
    follows_rank0(name=f"Follow rank 0's health gate ({role.rank0})", rank0=role.rank0,
                  rank=role.node_rank, _if=lambda: any(op.did_change() for op in started))
