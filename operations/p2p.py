"""Measure GPU peer-to-peer on the host and keep the NCCL settings that follow from it."""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import Final

from pyinfra import host, logger
from pyinfra.api import StringCommand, deploy, operation
from pyinfra.operations import files

from operations.gpu import NvidiaDriver
from operations.host import FileText
from operations import REPO_ROOT
from operations.settings import Settings

LIB_DIR: Final = "/opt/gpuhost/lib"
ENV_FILE: Final = "/etc/gpuhost/p2p.env"
RECORD: Final = "/var/lib/gpuhost/p2p.json"
SHIPPED: Final = ("nvsmi.py", "p2p_policy.py", "files/p2p_check.py")


def policy_sha256() -> str:
    """sha256 of the decision table as shipped: a new table means a new decision."""
    return hashlib.sha256((REPO_ROOT / "operations" / "p2p_policy.py").read_bytes()).hexdigest()


def record_is_current(record_text: str | None, driver_version: str | None,
                      gpu_uuids: list[str], override: str | None) -> bool:
    """Whether the decision recorded on the host still holds: measured on this driver and
    these GPUs, with this override and this decision table."""
    if not record_text or driver_version is None:
        return False
    try:
        record = json.loads(record_text)
    except ValueError:
        return False
    return (
        record.get("measured_on") == {"driver_version": driver_version, "gpu_uuids": gpu_uuids}
        and record.get("override") == override
        and record.get("policy_sha256") == policy_sha256()
    )


@operation()
def measured(venv: str, override: str | None):
    """Run the P2P check on the host unless its record still holds (same driver version, GPU
    UUIDs, override and decision table).

    + venv: the ML venv whose python runs the check
    + override: "on", "off" or None (gpuhost_p2p_override)
    """
    state = host.get_fact(NvidiaDriver)
    record = host.get_fact(FileText, path=RECORD)
    uuids = [g.uuid for g in state.gpus]
    if state.status == "ok" and record_is_current(record, state.driver_version, uuids, override):
        decision = json.loads(record or "{}").get("decision", {})
        host.noop(f"P2P {decision.get('p2p')}: {decision.get('reason')} "
                  f"(measured on driver {state.driver_version})")
        return
    if record and state.status == "ok":
        logger.info(f"{host.print_prefix}P2P will be measured again: driver, GPUs or policy "
                    "changed since the last measurement")
    command = [f"{venv}/bin/python", f"{LIB_DIR}/p2p_check.py",
               "--env-file", ENV_FILE, "--record", RECORD]
    if override:
        command += ["--override", override]
    yield StringCommand(*(shlex.quote(c) for c in command))


@deploy("P2P")
def p2p(settings: Settings):
    """Ship the P2P check and run it when needed; the decision lands in /etc/gpuhost/p2p.env,
    which the server's unit reads. Returns the operations whose change means the server must
    restart."""
    files.directory(name="gpuhost library folder", path=LIB_DIR, mode="755")
    for name in SHIPPED:
        files.put(name=f"Ship {name.split('/')[-1]}", src=str(REPO_ROOT / "operations" / name),
                  dest=f"{LIB_DIR}/{name.split('/')[-1]}", mode="644")
    check = measured(name="Measure P2P between GPUs", venv=settings.venv_path,
                     override=settings.p2p_override)
    return [check]
