"""Manage the SGLang server: its model weights, systemd unit and environment, the API key gate
for a public bind, restarts only on change, and a health gate that needs a real completion."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.api.operation import OperationMeta
from pyinfra.facts.files import File
from pyinfra.operations import files, systemd

from operations import REPO_ROOT
from operations.facts.host import FileText
from operations.plans import gpu_verdict, model_revision
from operations.plans.node_group import NodeRole
from operations.plans.plan import fact
from operations.plans.settings import PREFIX, Settings
from operations.stages import gate, group_restart, last_known_good, roll
from operations.stages import model_copy, model_peers
from operations.stages import model as model_ops
from operations.stages.folders import folders_down_to, top_folders
from operations.stages.kernel_cache import (
    KernelCacheFolders,
    cache_key,
    kernel_cache,
    remove_superseded,
)
from operations.stages.mlenv import VenvAt
from operations.stages.nodes import NODES_ENV_FILE, internode_argv
from operations.stages.p2p import ENV_FILE as P2P_ENV_FILE
from operations.stages.p2p import LIB_DIR
from operations.stages.secret_template import secret_template
from operations.stages.server_health import serving
from operations.stages.server_last_good import (
    LastGoodState,
    last_good_recorded,
    record_command,
    venvs_pruned,
)
from operations.stages.server_refusals import refuses
from operations.stages.server_state import (
    DropIns,
    ServiceState,
    UnitJournal,
    UnitState,
    failed_message,
    foreign_dropins,
    stale_message,
    unverified_message,
)
from operations.stages.server_unit import (
    DROPIN_DIR,
    GATE_UNIT,
    GATE_UNIT_PATH,
    RUNTIME_DIRS,
    SERVER_ENV_FILE,
    SWEEP_DROPIN,
    UNIT,
    UNIT_PATH,
    VERIFIED_FILE,
    backend_url,
    env_context,
    gate_context,
    gate_inputs,
    public_url,
    server_inputs,
    unit_context,
    worker_gate,
)
from operations.stages.service_users import SERVER_USER, service_user
from operations.stages.systemd_units import (
    path_restarted,
    unit_enabled,
    unit_reloaded,
    unit_restarted,
    unit_started,
)
from operations.stages.venvs import (
    VENVS_DIR,
    VenvFolders,
    host_venv,
    recorded_venvs,
    unit_venv,
    venv_link,
)

#: GiB that must stay free on the model's file system after a download.
DISK_HEADROOM_GIB: Final = 1.0
#: The programs the server and its gate run on the host, shipped to LIB_DIR (model_fetch.py
#: imports no_space.py too, which the ML venv stage ships).
PROGRAMS: Final = ("health_check.py", "model_fetch.py", "model_config.py", "gate_keys.py",
                   "unit_inputs.py", "secret_file.py", "last_known_good.py")


@dataclass(frozen=True)
class Found:
    """The server's unit and its gate's as planning found them: their states, the units the
    health gate covers, the InvocationIDs VERIFIED_FILE recorded, whether the server runs
    unverified, and whether the gate's nginx configuration alone changed since its start."""

    server: UnitState
    gate: UnitState
    gated: tuple[str, ...]
    verified: list[str]
    unverified: bool
    gate_conf_stale: bool


@dataclass(frozen=True)
class Starts:
    """The server's start and restart operations: ``restarts`` those after which the health
    gate runs (a roll's, one per position), ``ungated`` those whose change alone means it runs
    (a roll gates its own)."""

    started: OperationMeta
    restarted: OperationMeta | None
    restarts: list[OperationMeta]
    ungated: list[OperationMeta]


@deploy("SGLang server")
def sglang_server(settings: Settings, inputs: Iterable[OperationMeta] = (),
                  role: NodeRole | None = None, peers: Mapping[str, Settings] | None = None):
    """Download the model, template the unit and its environment (and the API key gate's unit
    when the server binds more than the loopback), start the server, restart it only when
    something it reads changed, and wait until it serves good answers. The unit places the
    kernel caches in a folder keyed by flashinfer, torch, CUDA and the compute capability
    (operations/stages/kernel_cache.py); the folders of other keys are removed once it serves.

    What it reads may have changed in this run, or in an earlier one that stopped before the
    restart: the digest the running server recorded at its start (:class:`ServiceState`) tells.
    A server started but never verified (a run stopped during the health gate, or systemd
    restarted it since) is verified again, without a restart.

    + settings: the host's validated settings
    + inputs: operations of earlier stages whose change means a restart (the venv, the P2P
      decision)
    + role: the host's place in a server across nodes (operations/stages/nodes.py), else None
    + peers: every inventory host's settings: a peer serving the same model may hold a copy
      of the weights (operations/stages/model_copy.py; ``gpuhost_model_copy_from_peers``)

    Refused while planning: PID 1 not systemd; a token or key file that is not a secret file
    (operations/stages/secret_files.py: missing, a symlink, readable by others, not one line of
    header-safe text); a port another unit listens on; failed GPUs
    (operations/plans/gpu_verdict.py). A start or restart of the API key gate alone is verified by
    the health gate in the same run.
    """
    if refuses(settings):
        return
    found = units_found(settings, role)
    say_found(settings, found)
    shipped = programs_shipped()
    weights = model_weights(settings, peers) if not settings.model_is_local else []
    kernels, kernel_folders = cache_key(settings), fact(KernelCacheFolders)
    service_user(name=f"User {SERVER_USER}", user=SERVER_USER)  # its kernel caches' owner
    kernel_cache(kernels, SERVER_USER)
    env = environment(settings)
    worker = worker_gate(settings)
    units, removed, gate_conf = unit_files(settings, role, worker)
    need_reload = found.server.need_reload or found.gate.need_reload
    systemd.daemon_reload(name="Reload systemd units",
                          _if=lambda: need_reload or any(u.did_change() for u in units))
    unit_enabled(name=f"Enable {UNIT}", unit=UNIT)
    changed = [*weights, *removed, env, units[0], *inputs]
    gpu_verdict.refusal(found.server.running,
                        found.server.stale or any(o.will_change for o in changed))
    what = [("the ML venv or the P2P decision", list(inputs)), ("the unit", units),
            ("the server environment", [env]), ("the model", weights)]
    change = what_changed(what)
    starts = (started_alone(settings, found, changed, change) if role is None
              else started_in_group(settings, role, found, changed))
    # A start or restart of the gate alone is verified in this run too (its key, its answers).
    gate_changes: list[OperationMeta] = []
    gate_url = None
    if settings.server_is_public:
        gate_changes = gate_started(found, worker, [units[1], shipped["gate_keys.py"],
                                                    shipped["secret_file.py"]],
                                    gate_conf, starts.restarts)
        gate_url = public_url(settings)
    gated_op = health_gated(settings, role, found, starts, gate_changes, gate_url, change)
    # after the restart: the server that read them is gone
    remove_superseded(kernels, kernel_folders)
    # past the health gate (a failed one ends the host's run before this)
    venv = host_venv(settings.lock_path)
    venv_link(name=f"{settings.venv_path}: the venv that serves", path=settings.venv_path,
              target=venv, health=fact(VenvAt, venv=settings.venv_path))
    if role is None:
        last_good(settings, lambda: (starts.started, *starts.restarts, *gate_changes,
                                     *filter(None, [gated_op])))
    venvs_kept(settings, venv)


def units_found(settings: Settings, role: NodeRole | None) -> Found:
    """The server's and its gate's units as they are before the deploy changes anything."""
    server_state = fact(ServiceState, unit=UNIT, runtime_dir=RUNTIME_DIRS[UNIT],
                        inputs=server_inputs(settings))
    gate_state = fact(ServiceState, unit=GATE_UNIT, runtime_dir=RUNTIME_DIRS[GATE_UNIT],
                      inputs=gate_inputs(settings))
    gated = (UNIT, GATE_UNIT) if settings.server_is_public else (UNIT,)
    verified = (fact(FileText, path=VERIFIED_FILE) or "").split()
    # A rank >= 1 of a server across nodes serves no model: rank 0's gate covers the group.
    unverified = server_state.running and verified != [
        s.invocation for s in (server_state, gate_state)[: len(gated)]] and not (
        role is not None and role.node_rank > 0)
    # the gate's nginx configuration alone changed since its start (by hand, or by a run that
    # stopped before reloading it): a graceful reload, not a restart
    gate_conf_stale = gate_state.stale and bool(gate_state.changed) and set(
        gate_state.changed) <= {worker_gate(settings).conf_path}
    return Found(server_state, gate_state, gated, verified, unverified, gate_conf_stale)


def say_found(settings: Settings, found: Found) -> None:
    """Warn of a unit found stale, failed (with its journal), unread by systemd since its file
    changed, or running unverified."""
    for name, unit_state in ((UNIT, found.server), (GATE_UNIT, found.gate)):
        if unit_state.stale:
            said = stale_message(name, unit_state)
            if name == GATE_UNIT and found.gate_conf_stale:
                said = said.replace(": restarting it", ": reloading it")
            logger.warning(f"{host.print_prefix}SGLang server: {said}")
        if unit_state.active == "failed" and (name == UNIT or settings.server_is_public):
            logger.warning(f"{host.print_prefix}SGLang server: " + failed_message(
                name, unit_state, fact(UnitJournal, unit=name)))
        if unit_state.need_reload:
            logger.warning(f"{host.print_prefix}SGLang server: systemd has not read {name}'s "
                           "unit file since it changed: reloading")
    if found.unverified and not found.server.stale:
        logger.warning(f"{host.print_prefix}SGLang server: " + unverified_message(
            found.gated, (found.server, found.gate)[: len(found.gated)], found.verified))


def programs_shipped() -> dict[str, OperationMeta]:
    """gpuhost's folders, and PROGRAMS shipped into LIB_DIR, by file name."""
    files.directory(name="gpuhost config folder", path="/etc/gpuhost", mode="755")
    files.directory(name="gpuhost library folder", path=LIB_DIR, mode="755")
    return {
        script: files.put(name=f"Ship {script}", src=str(REPO_ROOT / "operations/files" / script),
                          dest=f"{LIB_DIR}/{script}", mode="644", create_remote_dir=False)
        for script in PROGRAMS
    }


def model_weights(settings: Settings, peers: Mapping[str, Settings] | None) -> list[OperationMeta]:
    """The model's folders and weights (from a peer's copy where one may hold them), and the
    copy access to and from peers; the weights' operation, in a list."""
    top_folders()
    # mode only: gpuhost_model_dir may be a mount whose owner is not root's to set
    for folder in folders_down_to(settings.model_dir, settings.model_path):
        files.directory(name=f"Folder {folder}", path=folder, mode="755")
    files.directory(name="Model folder", path=settings.model_path, mode="755")
    model_copy.copy_access(settings)
    sources = (model_peers.peers(host.name, peers, {h.name: h.data.dict()
                                                    for h in host.inventory})
               if peers and settings.model_copy_from_peers else [])
    weights = [model_ops.weights(
        name=f"Model {settings.model}@{settings.model_revision}",
        repo=settings.model, revision=settings.model_revision, dest=settings.model_path,
        endpoint=settings.hf_endpoint, python=f"{host_venv(settings.lock_path)}/bin/python",
        token_file=settings.hf_token_file, headroom_gib=DISK_HEADROOM_GIB,
        architecture=settings.model_architecture, peers=sources,
        bwlimit_kib=settings.model_copy_bwlimit, mirror=settings.model_mirror,
        mtp=settings.speculative_algorithm is not None,
        commit=model_revision.fleet_commit(settings))]
    model_copy.copy_key(settings)
    return weights


def environment(settings: Settings) -> OperationMeta:
    """The server's environment file (secrets: 0600), and the last known good record made
    root's alone where an earlier gpuhost left it readable."""
    env = secret_template(
        name="Server environment",
        src=str(REPO_ROOT / "templates" / "server.env.j2"),
        dest=SERVER_ENV_FILE,
        mode="600",
        **env_context(settings),
    )
    record = fact(File, path=last_known_good.RECORD)
    if record and record.get("mode") != 600:
        # left 0644 by an earlier gpuhost: it holds server.env's sha256, against which a guess
        # at a secret there could be checked offline (last_known_good.py writes it 0600)
        files.file(name="Last known good record: root's alone", path=last_known_good.RECORD,
                   mode="600")
    return env


def unit_files(settings: Settings, role: NodeRole | None, worker: gate.Gate
               ) -> tuple[list[OperationMeta], list[OperationMeta], list[OperationMeta]]:
    """The server's unit, the drop-ins removed, and the gate's unit and files (or their
    removal where the server binds the loopback only): (every unit file's operation, the
    server's first and the gate's second where public; the removals; the gate's files)."""
    unit = files.template(
        name=f"Unit {UNIT}",
        src=str(REPO_ROOT / "templates" / "sglang.service.j2"),
        dest=UNIT_PATH,
        mode="644",
        **unit_context(settings, role),
    )
    units = [unit]
    removed = dropins_removed(settings)
    gate_conf: list[OperationMeta] = []
    if settings.server_is_public:
        gate.nginx_installed(name="nginx (the API key gate)")
        units.append(files.template(
            name=f"Unit {GATE_UNIT}",
            src=str(REPO_ROOT / "templates" / "gate.service.j2"),
            dest=GATE_UNIT_PATH,
            mode="644",
            **gate_context(settings),
        ))
        gate_conf = gate.gate_files(worker)
        units += gate_conf[1:]
    elif fact(File, path=GATE_UNIT_PATH):
        for unit_name in (worker.path_unit, GATE_UNIT):
            systemd.service(name=f"Stop {unit_name} (the server binds the loopback only)",
                            service=unit_name, running=False, enabled=False)
        units.append(files.file(name=f"Remove {GATE_UNIT}", path=GATE_UNIT_PATH, present=False))
        for unit_name in (worker.path_unit, worker.keys_unit):
            files.file(name=f"Remove {unit_name}", path=f"/etc/systemd/system/{unit_name}",
                       present=False)
    units += removed  # after the gate's, which gate_started finds at units[1]
    return units, removed, gate_conf


def dropins_removed(settings: Settings) -> list[OperationMeta]:
    """The server's drop-ins that are not gpuhost's and host data does not allow, and one an
    interrupted bench.py sweep left, removed (said either way)."""
    removed: list[OperationMeta] = []
    remove, kept = foreign_dropins(fact(DropIns, path=DROPIN_DIR), settings.allowed_dropins)
    for name in kept:
        logger.info(f"{host.print_prefix}SGLang server: drop-in {DROPIN_DIR}/{name} is not "
                    f"gpuhost's: kept ({PREFIX}allowed_dropins)")
    for name in remove:
        logger.warning(f"{host.print_prefix}SGLang server: drop-in {DROPIN_DIR}/{name} is not "
                       f"gpuhost's and host data does not allow it: removing it (allow it "
                       f"with {PREFIX}allowed_dropins)")
        removed.append(files.file(name=f"Remove the foreign drop-in {name}",
                                  path=f"{DROPIN_DIR}/{name}", present=False))
    if fact(File, path=SWEEP_DROPIN):
        logger.warning(f"{host.print_prefix}SGLang server: {SWEEP_DROPIN} is left from an "
                       "interrupted bench.py sweep: removing it and restarting the server with "
                       "what host data configures")
        removed.append(files.file(name="Remove the interrupted sweep's drop-in",
                                  path=SWEEP_DROPIN, present=False))
    return removed


def what_changed(what: list[tuple[str, list[OperationMeta]]]) -> Callable[[], str]:
    """What this run changed, read when it runs, for a failed health gate's message: the
    labels of ``what`` whose operations changed, joined with "and"."""
    return lambda: " and ".join(label for label, ops in what
                                if any(op.did_change() for op in ops))


def started_alone(settings: Settings, found: Found, changed: list[OperationMeta],
                  change: Callable[[], str]) -> Starts:
    """The server of one host started, or restarted where what it reads ``changed`` (or it
    runs stale); in a roll, out of the router, restarted, gated and back in at its turn."""
    was_running, server_state = found.server.running, found.server
    started = unit_started(name=f"Start {UNIT}", unit=UNIT)

    # A unit started just now (an earlier stage stopped it) read the files as they are: a
    # restart would only kill that start.
    def must_restart() -> bool:
        return was_running and not started.did_change() and (
            server_state.stale or any(op.did_change() for op in changed))

    if roll.rolls(host.name):
        # out of the router, restarted, gated and back in, one position at a time
        rolled = roll.rolled_restart(UNIT, must_restart, was_running and not (
            started.will_change) and (server_state.stale or any(
                op.will_change for op in changed)), gate=lambda **kw: serving(
            name=f"Wait until {settings.served_model_name} answers", url=backend_url(
                settings), model=settings.served_model_name, timeout=settings.health_timeout,
            public_url=public_url(settings), api_key_file=settings.api_key_file,
            units=found.gated, record=record_command(settings), change=change,
            **kw), restart=unit_restarted)
        return Starts(started, None, rolled, [])
    restarted = unit_restarted(
        name=f"Restart {UNIT} (what it reads changed)",
        unit=UNIT,
        _if=must_restart,
    )
    return Starts(started, restarted, [restarted], [restarted])


def started_in_group(settings: Settings, role: NodeRole, found: Found,
                     changed: list[OperationMeta]) -> Starts:
    """A node of a server across hosts started or restarted with its group
    (operations/stages/group_restart.py)."""
    server_state, was_running = found.server, found.server.running
    must_start = (f"{UNIT} is not running ({server_state.active})" if not was_running
                  else "it runs with other inputs than the files now"
                  if server_state.stale else None)
    group_restart.register(role, changed, must_start,
                           None if was_running else server_state.stopped_at)
    started, restarted = group_restart.converge(
        role, internode_argv(settings, role, (P2P_ENV_FILE, NODES_ENV_FILE)))
    return Starts(started, restarted, [restarted], [restarted])


def gate_started(found: Found, worker: gate.Gate, gate_ops: list[OperationMeta],
                 gate_conf: list[OperationMeta], restarts: list[OperationMeta]
                 ) -> list[OperationMeta]:
    """The API key gate enabled and started; restarted where its unit or programs
    (``gate_ops``) changed, reloaded where its configuration alone did, neither where the
    server's restart restarted it; its key files watched. Its start, restart and reload."""
    gate_was_running, gate_state = found.gate.running, found.gate
    gate_changes: list[OperationMeta] = []
    unit_enabled(name=f"Enable {GATE_UNIT}", unit=GATE_UNIT)
    gate_changes.append(unit_started(name=f"Start {GATE_UNIT}", unit=GATE_UNIT))
    # A restart of the server restarts the gate too (PartOf=).
    gate_changes.append(unit_restarted(
        name=f"Restart {GATE_UNIT} (its unit or program changed)",
        unit=GATE_UNIT,
        _if=lambda: gate_was_running and not any(r.did_change() for r in restarts)
        and ((gate_state.stale and not found.gate_conf_stale)
             or any(op.did_change() for op in gate_ops)),
    ))
    # its configuration alone: a graceful reload (the clients' connections stay)
    gate_changes.append(unit_reloaded(
        name=f"Reload {GATE_UNIT} (its configuration changed)",
        unit=GATE_UNIT,
        _if=lambda: gate_was_running and not any(
            r.did_change() for r in (*restarts, *gate_changes[:2]))
        and (found.gate_conf_stale or gate_conf[0].did_change()),
    ))
    unit_enabled(name=f"Enable {worker.path_unit}", unit=worker.path_unit)
    path_restarted(name=f"Watch the key files ({worker.path_unit})", unit=worker.path_unit,
                   changed=gate_conf[1].will_change)
    return gate_changes


def health_gated(settings: Settings, role: NodeRole | None, found: Found, starts: Starts,
                 gate_changes: list[OperationMeta], gate_url: str | None,
                 change: Callable[[], str]) -> OperationMeta | None:
    """The health gate, where the server or its gate started, restarted or runs unverified
    (on rank 0 of a node group; the other ranks follow it); its operation, or None."""
    if role is None or role.node_rank == 0:
        return serving(
            name=f"Wait until {settings.served_model_name} answers",
            url=backend_url(settings),
            model=settings.served_model_name,
            timeout=settings.health_timeout,
            public_url=gate_url,
            api_key_file=settings.api_key_file,
            units=found.gated,
            # a node group is not rolled back by one node: its ranks restart together
            # (group_restart.py), so rank 0 alone must not go back to another venv
            record=record_command(settings) if role is None else None,
            change=change,
            _if=lambda: found.unverified or any(
                op.did_change() for op in (starts.started, *starts.ungated, *gate_changes)),
        )
    # at a later line than the gate: pyinfra runs it after rank 0's gate (group_restart.py)
    group_restart.follow(role, (starts.started, starts.restarted))
    return None


def last_good(settings: Settings, ops: Callable[[], tuple[OperationMeta, ...]]) -> None:
    """The last known good record rewritten where it disagrees with what serves, or where
    one of ``ops`` (the server's and gate's starts, restarts and health gate) changed."""
    check = record_command(settings, action="check")
    last_good_recorded(name="Last known good: as what serves",
                       check=check, record=record_command(settings),
                       state_now=(now := fact(LastGoodState, check=check)),
                       _if=lambda: not now.startswith(("fresh", "unverified")) or any(
                           op.did_change() for op in ops()))


def venvs_kept(settings: Settings, venv: str) -> None:
    """The venvs no longer kept pruned, where a last known good is recorded: never the one
    that serves, the recorded ones, or the one the unit names."""
    record_text = fact(FileText, path=last_known_good.RECORD)
    recorded = recorded_venvs(record_text)
    if recorded:
        kept = sorted({venv, *recorded, *filter(None, [unit_venv(fact(FileText,
                                                                      path=UNIT_PATH))])})
        found = fact(VenvFolders, path=VENVS_DIR)
        venvs_pruned(name="Prune the venvs no longer kept", venvs_dir=VENVS_DIR,
                     keep=settings.venvs_kept, kept=kept,
                     remove=[v for v in found if v not in kept])
