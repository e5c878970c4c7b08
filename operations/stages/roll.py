"""Rolling restarts behind the router: when a run restarts servers of the fleet, they restart
N at a time (``gpuhost_roll_size``, 1 by default), each out of the router while it does, and the
roll stops at the first host that fails, the others untouched and serving.

Per roll position k, in this order (operations at these lines, ``_if`` read when they run):

1. ``turn``: on each host of position k: the roll stopped (a host of an earlier position
   failed) or a router host is out of the run: this host fails, its server untouched and
   serving (a restart now could drop requests or leave the fleet short);
2. ``leave``: on each host of position k, for each router: first the roll state on the router
   host is read (operations/files/roll_state.py, written whole, kept across runs), and every
   other worker of the fleet it names as taken out by a roll that the router does not list
   serving (one an interrupted run drained, one whose link dropped before its restart) is
   registered again and waited for: smg's own health checks decide whether it serves again. A
   worker the router has never listed (a fleet's first deploy) is not out: neither waited for
   nor counted; its own ``join`` adds it. Then ``DELETE /workers/{id}`` of this host, unless
   it is the last serving worker (listed and serving, and no other listed worker serving; a
   fleet of one worker is drained, said) or ``gpuhost_roll_max_unavailable`` other workers are
   out by the roll state (those an earlier, interrupted run left out included); otherwise this
   host fails, its server untouched and serving, saying which hosts are where, and the roll
   stops.
   The host is waited for until the router lists it no more: smg drains it (``"status":
   "draining"``, no new requests) until its in-flight requests are done, bounded by
   ``gpuhost_roll_drain_timeout`` (operations/files/router_membership.py, run on the router
   host over that host's own connection, :func:`_membership`: a router host that serves no
   model plans no position, and one that serves is itself a host of some position); the roll
   state says ``drained``;
3. the roll state says ``restarting`` (where it names this host); what earlier stages left to the
   host's turn (:func:`in_turn`): on a host whose server runs, a driver change (the server stopped,
   the packages, the reboot, the driver's check: operations/stages/nvidia.py) and a P2P measurement
   (it stops the server: operations/stages/p2p.py) wait for it, out of the router, instead of
   stopping every host's server at once where their stages run;
   ``restart``: the server of each host of position k restarts;
4. ``gate``: the health gate (operations/stages/server_health.py ``serving``) on it;
5. ``join``: on each host of position k that passed, for each router: ``POST /workers`` of
   this host, waited for until the router lists it healthy (as ``leave``; a host that failed
   its gate runs nothing more, and stays out, ``restarting`` in the roll state: the next run
   counts it as out until the router's health checks pass); then it leaves the roll state.

A host that fails anywhere in its turn stops the roll (``turn`` of the next position). The
router check at the end of the run (operations/stages/router.py ``router_check``) registers again a
worker whose host failed after its drain and before its restart (``drained``: its server never
touched), and says, from the router's own list, which workers are listed and healthy, which
are out and why.

Why the positions run one after the other: pyinfra plans the deploy file host by host, then
executes operation by operation, each on every host that has it, and orders operations by a DAG
of each host's own sequence, tie-broken by the line numbers of their call stack (pyinfra 3.x,
``api/state.py`` ``State.get_op_order``: ``TopologicalSorter`` over every host's
``op_hash_order``; ``api/operation.py`` ``solve_operation_consistency``). An operation called
again at the same lines (a loop) gets the same hash plus ``-0``, ``-0-1``... and the loop count
appended to its order: on its own, iteration k's first line would sort before iteration
k-1's last. So every host of the roll plans every position's operations (those not its own are
skipped by ``_if``): each host's sequence then chains position k before k+1 in the DAG, and
no host's operation of position k+1 starts before every host finished position k.

Which hosts restart is read when the roll starts (every earlier operation has run on every
host by then): hosts with nothing to restart are in no position and converge in parallel as
without a router. While planning (and with ``--dry``) the expected order is printed once every
host of the roll has planned. A node group (``gpuhost_nodes``) restarts as a group
(operations/stages/group_restart.py), not in the roll.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.api.operation import OperationMeta

from operations import LIB_DIR, REPO_ROOT
from operations.runtime import remote
from operations.stages.fleet import CONTROL_KEY_FILE, Fleet

SCRIPT: Final = f"{LIB_DIR}/router_membership.py"
#: the roll state's reader and writer, beside it on the router host
STATE_SCRIPT: Final = f"{LIB_DIR}/roll_state.py"
STATE_SOURCE: Final = str(REPO_ROOT / "operations/files/roll_state.py")


@dataclass(frozen=True)
class InTurn:
    """What an earlier stage leaves to its host's turn: ``plan`` plans its operations, each
    with the ``_if`` given (called once per position: the turn's, at most one, runs);
    ``stops``, read at the next position, says why the roll must stop after it (a driver
    upgrade rolled back), or None."""

    label: str
    plan: Callable[[Callable[[], bool]], object]
    stops: Callable[[], str | None] | None = None


@dataclass
class Roll:
    """The fleet's roll: the hosts that may roll (in inventory order), the router hosts with
    their own URL, the workers' URLs, N, the bounds; each host's restart decision."""

    hosts: tuple[str, ...] = ()
    routers: dict[str, str] = field(default_factory=dict)
    urls: dict[str, dict[str, str]] = field(default_factory=dict)
    #: each router host's fleet key file (the key the router sends a worker it adds)
    worker_keys: dict[str, str | None] = field(default_factory=dict)
    size: int = 1
    max_unavailable: int = 1
    drain_timeout: int = 120
    join_timeout: int = 300
    restarts: dict[str, Callable[[], bool]] = field(default_factory=dict)
    turns: dict[str, list[InTurn]] = field(default_factory=dict)
    expected: dict[str, bool] = field(default_factory=dict)
    positions: list[list[str]] | None = None
    entered: list[str] = field(default_factory=list)


ROLL = Roll()


def configure(fleet: Fleet, router_urls: dict[str, str], settings) -> None:
    """Set the roll up from the fleet (every host's plan calls it: the same fleet keeps what
    the hosts planned so far). No router, or a serving router host in a node group: no roll
    (restarts as without a router). A router host that serves no model (``gpuhost_serving =
    False``, a CPU-only VM) is in no position: only its workers restart; like every router
    host, it must be in the run (``turn``)."""
    global ROLL
    first = fleet.routers[0] if fleet.routers else None
    hosts = tuple(w.name for w in fleet.workers_of(first) if not settings[w.name].nodes) \
        if first else ()
    if any(r not in hosts for r in fleet.routers if settings[r].serving):
        hosts = ()
    if hosts == ROLL.hosts and router_urls == ROLL.routers:
        return
    ROLL = Roll()
    if not hosts or first is None:
        return
    ROLL.hosts = hosts
    ROLL.routers = dict(router_urls)
    ROLL.urls = {r: {w.name: w.url for w in fleet.workers_of(r)} for r in fleet.routers}
    ROLL.worker_keys = {r: settings[r].fleet_key_file for r in fleet.routers}
    ROLL.size = settings[first].roll_size
    ROLL.max_unavailable = settings[first].roll_max_unavailable
    ROLL.drain_timeout = settings[first].roll_drain_timeout
    ROLL.join_timeout = settings[first].router_wait_timeout


def rolls(name: str) -> bool:
    """Whether host ``name``'s server restarts in the roll."""
    return name in ROLL.hosts


def _active() -> set[str]:
    return {h.name for h in state.active_hosts}


def _positions() -> list[list[str]]:
    """The roll's positions, decided once, when the roll starts."""
    if ROLL.positions is None:
        active = _active()
        going = [n for n in ROLL.hosts if n in active and n in ROLL.restarts
                 and ROLL.restarts[n]()]
        ROLL.positions = [going[i:i + ROLL.size] for i in range(0, len(going), ROLL.size)]
        if going:
            logger.info("Roll: " + describe(ROLL.positions))
    return ROLL.positions


def _at(k: int) -> list[str]:
    positions = _positions()
    return positions[k] if k < len(positions) else []


def describe(positions: list[list[str]]) -> str:
    """The roll's order in words, for the log and --dry."""
    routers = ", ".join(ROLL.routers)
    steps = "; ".join(f"{k + 1}. {', '.join(names)}" for k, names in enumerate(positions))
    return (f"servers restart {ROLL.size} at a time, each out of the router on {routers} "
            f"while it drains, restarts and passes the health gate, then back in: {steps}")


def in_turn(label: str, plan: Callable[[Callable[[], bool]], object], running: bool,
            stops: Callable[[], str | None] | None = None, reboots: bool = False) -> bool:
    """Leave ``label`` (planned by ``plan``, see :class:`InTurn`) to this host's turn in the
    roll, when the host rolls and its server runs (``running``): the host then restarts in
    the roll. False: the caller plans it in place (no roll, or nothing serving to keep)."""
    name = host.name
    if not (rolls(name) and running):
        return False
    if reboots and name in ROLL.routers:
        logger.warning(f"{host.print_prefix}Roll: {label} reboots this host in its turn, and "
                       "the router runs here: requests through it fail until it is back (a "
                       "router host that serves no model avoids it)")
    ROLL.turns.setdefault(name, []).append(InTurn(label, plan, stops))
    return True


def has_turn() -> bool:
    """Whether this host left something to its turn (:func:`in_turn`)."""
    return bool(ROLL.turns.get(host.name))


def _stopped(failed: set[str]) -> str | None:
    """Why the roll stops before the next position: a host that had its turn failed, or what
    it left to its turn says so."""
    for name in ROLL.entered:
        if name in failed:
            return f"{name} failed its upgrade"
        for t in ROLL.turns.get(name, ()):
            why = t.stops() if t.stops else None
            if why:
                return f"{name}: {why}"
    return None


@remote.callback("the roll")
def _turn(state, host, k: int) -> bool:
    stopped = _stopped({h.name for h in state.failed_hosts})
    away = [r for r in ROLL.routers if r not in _active()]
    if stopped or away:
        why = (stopped if stopped else
               f"the router host {', '.join(away)} is out of this run")
        logger.error(f"{host.print_prefix}Roll: stopped ({why}): {host.name} not restarted, "
                     "its server left as it is, serving")
        return False
    ROLL.entered.append(host.name)
    logger.info(f"{host.print_prefix}Roll: position {k + 1} of {len(_positions())}: leaving "
                "the router")
    return True


@operation(is_idempotent=False)
def turn(k: int):
    """Fail this host, untouched, when the roll stopped before position ``k``."""
    yield FunctionCommand(_turn, (k,), {})


@operation(is_idempotent=False)
def membership(action: str, timeout: int):
    """``leave`` or ``join`` every router, for this host (:func:`_membership`)."""
    yield FunctionCommand(_membership, (action, timeout), {})


@remote.callback("the roll's router membership")
def _membership(state, host, action: str, timeout: int) -> bool:
    """router_membership.py ``action`` for this host's URL, on each router host over that
    host's own connection (sent there first: a router host that serves no model plans no
    position, so the script goes with the call). A router host whose link drops fails this
    host, not the router host's own connection handling (remote.callback would close this
    host's)."""
    script = str(REPO_ROOT / "operations/files/router_membership.py")
    for router, own_url in ROLL.routers.items():
        url = ROLL.urls.get(router, {}).get(host.name)
        if not url:
            continue
        target = state.inventory.get_host(router)
        keys = ["--control-key-file", CONTROL_KEY_FILE,
                *(["--worker-key-file", ROLL.worker_keys[router]]
                  if ROLL.worker_keys.get(router) else [])]
        command = StringCommand("python3", SCRIPT, action, "--router", own_url, "--url", url,
                                "--timeout", str(timeout), *keys, "--host", host.name,
                                *_fleet_args(state, router, action))
        try:
            remote.put(target, script, SCRIPT)
            remote.put(target, STATE_SOURCE, STATE_SCRIPT)
            ok, out = remote.shell(target, command, timeout=_limit(action, timeout))
        except remote.ConnectionLost as exc:
            raise OperationError(f"connection to the router host {router} lost ({exc})") \
                from None
        for line in out.stdout_lines:
            logger.info(f"{host.print_prefix}Roll: on {router}: {line}")
        for line in out.stderr_lines if ok else ():
            logger.warning(f"{host.print_prefix}Roll: on {router}: {line}")
        if not ok:
            said = (out.stderr_lines or out.stdout_lines or ["said nothing"])[-1]
            raise OperationError(f"the router on {router}: {action} of {url} failed: {said}")
    return True


def _limit(action: str, timeout: int) -> int:
    """Seconds router_membership.py ``action`` may take on the router host: ``leave`` waits up
    to ``--resume-timeout`` for the workers an earlier roll took out, then up to ``timeout``
    for the drain; each action polls (``remote.POLL_TIMEOUT_S`` for the last answer)."""
    resume = ROLL.join_timeout if action == "leave" else 0
    return timeout + resume + remote.POLL_TIMEOUT_S


def _fleet_args(state, router: str, action: str) -> list[str]:
    """``leave``'s view of the fleet: every worker of this router whose host has not failed in
    this run (NAME=URL), the unavailable budget, how long a worker out of the router is waited
    for (router_membership.py)."""
    if action != "leave":
        return []
    failed = {h.name for h in state.failed_hosts}
    pairs = [f"{name}={url}" for name, url in ROLL.urls.get(router, {}).items()
             if name not in failed]
    return [*(a for p in pairs for a in ("--fleet", p)), "--max-unavailable",
            str(ROLL.max_unavailable), "--resume-timeout", str(ROLL.join_timeout)]


def rolled_restart(unit: str, must_restart: Callable[[], bool], expected: bool,
                   gate: Callable[..., OperationMeta],
                   restart: Callable[..., OperationMeta]) -> list[OperationMeta]:
    """Plan this host's part of every position (module docstring); returns its restart
    operations (one per position, at most one of them runs).

    + unit: the server's unit
    + must_restart: read when the roll starts: whether this host's server restarts
    + expected: the same, as planning sees it (for the order printed while planning)
    + gate: plans the health gate with the ``_if`` given
    + restart: plans the unit's restart (systemd_units.py's ``unit_restarted``: given by server.py,
      which calls this module)
    """

    name = host.name
    turns = list(ROLL.turns.get(name, ()))
    # what waits for the turn restarts the server: the host must have one
    ROLL.restarts[name] = lambda: bool(turns) or must_restart()
    ROLL.expected[name] = bool(turns) or expected
    if set(ROLL.expected) >= set(ROLL.hosts) & _active():
        going = [n for n in ROLL.hosts if ROLL.expected.get(n)]
        if going:
            logger.info("Roll (planned): " + describe(
                [going[i:i + ROLL.size] for i in range(0, len(going), ROLL.size)]))
    restarts = []
    for k in range(len(ROLL.hosts)):
        mine = lambda k=k: name in _at(k)  # noqa: E731
        turn(name=f"Roll position {k + 1}: this host's turn", k=k, _if=mine)
        membership(name=f"Roll position {k + 1}: out of the router, drained",
                   action="leave", timeout=ROLL.drain_timeout, _if=mine)
        membership(name=f"Roll position {k + 1}: restarting (the roll state)",
                   action="restarting", timeout=ROLL.drain_timeout, _if=mine)
        for t in turns:
            t.plan(mine)
        restarts.append(restart(name=f"Roll position {k + 1}: restart {unit}", unit=unit,
                                _if=mine))
        gate(_if=mine)
        membership(name=f"Roll position {k + 1}: back in the router, healthy",
                   action="join", timeout=ROLL.join_timeout, _if=mine)
    return restarts
