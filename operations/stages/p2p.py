"""Measure GPU peer-to-peer on the host and keep the NCCL settings that follow from it."""

from __future__ import annotations

import hashlib
import json
import shlex
from io import StringIO
from typing import Final

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, deploy, operation
from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import files

from operations import LIB_DIR, REPO_ROOT
from operations.runtime import remote
from operations.facts.gpu import NvidiaDriver
from operations.facts.host import FileText
from operations.facts.virt import Platform, VirtInfo
from operations.plans import p2p_policy
from operations.plans.plan import fact
from operations.plans.settings import Settings
from operations.stages import roll
from operations.stages.venvs import host_venv

ENV_FILE: Final = "/etc/gpuhost/p2p.env"
RECORD: Final = "/var/lib/gpuhost/p2p.json"
SHIPPED: Final = ("facts/nvsmi.py", "plans/p2p_policy.py", "files/p2p_check.py")
#: operations/stages/server_unit.py's UNIT (it imports this module, not the other way round): the
#: server holds every GPU, so a measurement stops it first.
SERVER_UNIT: Final = "sglang.service"


def _sha256(relative: str) -> str:
    return hashlib.sha256((REPO_ROOT / "operations" / relative).read_bytes()).hexdigest()


def policy_sha256() -> str:
    """sha256 of the decision table as shipped: a new table means a new decision."""
    return _sha256("plans/p2p_policy.py")


def check_sha256() -> str:
    """sha256 of the check as shipped: a new check means a new measurement."""
    return _sha256("files/p2p_check.py")


def _load(record_text: str | None) -> dict | None:
    if not record_text:
        return None
    try:
        record = json.loads(record_text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def record_is_current(record_text: str | None, driver_version: str | None,
                      gpu_uuids: list[str], override: str | None) -> bool:
    """Whether the decision recorded on the host still holds: measured on this driver and
    these GPUs, with this override, this decision table and this check."""
    record = _load(record_text)
    if record is None or driver_version is None:
        return False
    return (
        record.get("measured_on") == {"driver_version": driver_version, "gpu_uuids": gpu_uuids}
        and record.get("override") == override
        and record.get("policy_sha256") == policy_sha256()
        and record.get("check_sha256") == check_sha256()
    )


def platform_hints(platform: VirtInfo, decision: dict) -> list[str]:
    """Warnings that the guest's own platform adds to a decision that found P2P broken."""
    if not decision.get("warnings") or decision.get("p2p") != "off":
        return []
    hints = []
    if platform.machine_type == "i440fx":
        hints.append("this guest is a QEMU i440FX machine: its GPUs sit on a conventional PCI "
                     "bus, without PCIe root ports; on Proxmox use machine q35 and hostpci ... "
                     "pcie=1")
    if platform.acs_redirecting:
        hints.append("ACS redirects peer traffic on " + ", ".join(platform.acs_redirecting))
    return hints


@remote.callback("the P2P report")
def _report(state, host, hints: tuple[str, ...] = ()) -> None:
    """Print the measurement just written (the record's summary), per host; ``hints`` (from the
    platform, see platform_hints) follow a decision that found P2P broken."""
    ok, out = remote.shell(host, StringCommand("cat", RECORD))
    record = _load("\n".join(out.stdout_lines)) if ok else None
    if record is None:
        logger.warning(f"{host.print_prefix}P2P: no record at {RECORD} after the check")
        return
    for line in record.get("summary", []):
        if line.startswith("WARNING: "):
            logger.warning(f"{host.print_prefix}P2P: {line[len('WARNING: '):]}")
        else:
            logger.info(f"{host.print_prefix}P2P: {line}")
    decision = record.get("decision", {})
    if decision.get("p2p") == "off" and decision.get("warnings"):
        for hint in hints:
            logger.warning(f"{host.print_prefix}P2P: {hint}")


def plan(state, record_text: str | None, override: str | None,
         remeasure: bool) -> tuple[bool, str, list[str]]:
    """Whether the check must run, and what to print about it: the recorded decision (and its
    warnings) when the record holds, else what will be measured and why.

    + state: the NvidiaDriver fact (operations.facts.nvsmi.DriverState)
    + record_text: /var/lib/gpuhost/p2p.json on the host, or None
    """
    record = _load(record_text)
    uuids = [g.uuid for g in state.gpus]
    if state.status == "ok" and not remeasure and record_is_current(
        record_text, state.driver_version, uuids, override
    ):
        decision = record.get("decision", {}) if record else {}
        line = (f"P2P {decision.get('p2p')}: {decision.get('reason')} (measured "
                f"{record.get('measured_at', '?')} on driver {state.driver_version}, "
                f"{len(uuids)} GPU(s))")
        return False, line, list(decision.get("warnings", []))
    if state.status != "ok":
        why = f"will be measured after the driver loads (nvidia-smi: {state.status})"
    elif remeasure:
        why = "will be measured again: gpuhost_p2p_remeasure is set"
    elif record:
        why = ("will be measured again: the driver, the GPUs, the override or the check "
               f"changed since {record.get('measured_at', 'the last measurement')}")
    else:
        why = "will be measured: no measurement recorded on the host"
    return True, f"P2P {why}; {SERVER_UNIT} is stopped first if it runs", []


@operation()
def measured(venv: str, override: str | None, remeasure: bool = False, timeout: int = 120,
             hints: tuple[str, ...] = ()):
    """Run the P2P check on the host unless its record still holds (same driver version, GPU
    UUIDs, override, decision table and check) and no measurement was asked for; then print
    what it measured and decided, per host.

    + venv: the ML venv whose python runs the check
    + override: "on", "off" or None (gpuhost_p2p_override)
    + remeasure: measure even when the record holds (gpuhost_p2p_remeasure)
    + timeout: seconds the peer copies, and the all-reduce, may take (gpuhost_p2p_check_timeout)
    + hints: what the platform adds to a decision that finds P2P broken (platform_hints)

    A measurement first stops the server (it holds every GPU; the check refuses to run
    while any process does); the server stage starts it again with the new decision.
    """
    needed, _, _ = plan(host.get_fact(NvidiaDriver), host.get_fact(FileText, path=RECORD),
                        override, remeasure)
    if not needed:
        host.noop("P2P: the recorded measurement holds")
        return
    yield f"systemctl stop {SERVER_UNIT} 2>/dev/null || true"
    command = [f"{venv}/bin/python", f"{LIB_DIR}/p2p_check.py", "--env-file", ENV_FILE,
               "--record", RECORD, "--timeout", str(timeout)]
    if override:
        command += ["--override", override]
    yield StringCommand(*(shlex.quote(c) for c in command))
    yield FunctionCommand(_report, (hints,), {})


def recorded_env(record_text: str | None) -> str | None:
    """/etc/gpuhost/p2p.env as the P2P check wrote it from the record's decision
    (p2p_policy.env_file), or None when the record holds no usable decision."""
    decision = (_load(record_text) or {}).get("decision")
    if not isinstance(decision, dict):
        return None
    try:
        return p2p_policy.env_file(p2p_policy.Decision(
            **{**decision, "server_args": tuple(decision.get("server_args", ())),
               "warnings": tuple(decision.get("warnings", ()))}))
    except (TypeError, ValueError):
        return None


@deploy("P2P")
def p2p(settings: Settings, driver_changes: bool = False):
    """Ship the P2P check and run it when needed; the decision lands in /etc/gpuhost/p2p.env,
    which the server's unit reads. Returns the operations whose change means the server must
    restart.

    ``driver_changes``: the NVIDIA stage changes the driver's version in this run (its
    DriverPlan's ``change``). The record names the old driver then, so the plan says the
    measurement follows the change (--dry included), and p2p.env is left to the check: the
    check's operation reads the driver again when it runs, after the reboot."""
    prefix = host.print_prefix
    platform = fact(Platform)
    logger.info(f"{prefix}P2P platform: {platform.describe()}")
    record_text = fact(FileText, path=RECORD)
    needed, line, warnings = plan(fact(NvidiaDriver), record_text, settings.p2p_override,
                                  settings.p2p_remeasure)
    if driver_changes and not needed:
        line = (f"P2P will be measured again after the driver change (the record is of driver "
                f"{fact(NvidiaDriver).driver_version}); {SERVER_UNIT} is stopped first if it "
                "runs")
        needed, warnings = True, []
    logger.info(f"{prefix}{line}")
    record = _load(record_text) or {}
    if warnings:
        for warning in [*warnings, *platform_hints(platform, record.get("decision", {}))]:
            logger.warning(f"{prefix}P2P: {warning}")
    files.directory(name="gpuhost library folder", path=LIB_DIR, mode="755")
    for name in SHIPPED:
        files.put(name=f"Ship {name.split('/')[-1]}", src=str(REPO_ROOT / "operations" / name),
                  dest=f"{LIB_DIR}/{name.split('/')[-1]}", mode="644",
                  create_remote_dir=False)  # the folder is the operation above

    def measure(when=None):
        return measured(name="Measure P2P between GPUs", venv=host_venv(settings.lock_path),
                        override=settings.p2p_override, remeasure=settings.p2p_remeasure,
                        timeout=settings.p2p_check_timeout, hints=tuple(platform_hints(
                            platform, {"p2p": "off", "warnings": ["?"]})),
                        _if=[when] if when else [])

    # A measurement stops the server: on a rolling host it waits for the host's turn, and so
    # does the check when the turn changes something first (the driver: the record then names
    # the old one).
    changes = [] if (needed or roll.has_turn()) and roll.in_turn(
        "the P2P measurement", measure, running=bool(fact(
            SystemdStatus, services=SERVER_UNIT).get(SERVER_UNIT))) else [measure()]
    env_text = None if needed else recorded_env(record_text)
    if env_text is None:
        return changes
    # The record is the source of truth: a hand-edited p2p.env is rewritten before the server
    # stage decides on a restart.
    env = files.put(name=f"{ENV_FILE} from the recorded measurement", src=StringIO(env_text),
                    dest=ENV_FILE, mode="644")
    return [*changes, env]
