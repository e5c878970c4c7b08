"""The SGLang server's last known good: the commands that record and check it, whether the
record agrees with what serves, its rewrite where it does not, and the pruning of the venvs it
no longer keeps."""

from __future__ import annotations

import shlex

from pyinfra import host, logger
from pyinfra.api import FactBase, FunctionCommand, operation
from typing_extensions import override

from operations.runtime import remote
from operations.plans.settings import Settings
from operations.stages import last_known_good
from operations.stages.p2p import ENV_FILE as P2P_ENV_FILE
from operations.stages.p2p import RECORD as P2P_RECORD
from operations.stages.server_unit import DROPIN_DIR, GATE_UNIT_PATH, SERVER_ENV_FILE, UNIT_PATH
from operations.stages.venvs import VENVS_DIR, digest_of_venv, host_venv


def record_command(settings: Settings, action: str = "record") -> str:
    """The command that records the last known good once the health gate passed: the venv the
    unit names, the files the server and its gate read (operations/stages/last_known_good.py); with
    ``action="check"``, the one that says whether the record agrees with them."""
    venv = host_venv(settings.lock_path)
    return last_known_good.record_command(
        venv=venv, lock_digest=digest_of_venv(venv), model=settings.model,
        revision=settings.model_revision,
        files=[UNIT_PATH, SERVER_ENV_FILE, P2P_ENV_FILE, P2P_RECORD, GATE_UNIT_PATH],
        folders=[DROPIN_DIR], keep=settings.venvs_kept, venvs_dir=VENVS_DIR, action=action)


class LastGoodState(FactBase[str]):
    """Whether the last known good record agrees with what serves: the first line of
    ``last_known_good.py check`` ("fresh", "unverified", "stale: <why>"); "absent: ..." where
    the script is not on the host yet (a fresh host: nothing recorded, nothing stale),
    "stale: ..." where it cannot say.

    .. code:: python

        "stale: /etc/gpuhost/server.env differ from what it recorded"
    """

    @override
    def command(self, check: str) -> str:
        script = shlex.quote(last_known_good.SCRIPT)
        return (f"if [ -f {script} ]; then {check} 2>/dev/null || echo 'stale: check failed'; "
                "else echo 'absent: no last_known_good.py on the host yet'; fi")

    @override
    def process(self, output) -> str:
        return output[0].strip() if output and output[0].strip() else "stale: no answer"


@remote.callback("recording the last known good", "the server goes on serving")
def _record_if_stale(state, host, check: str, record: str) -> bool:
    ok, out = remote.shell(host, check, _success_exit_codes=[0])
    said = (out.stdout_lines or ["stale"])[0]
    if ok and not said.startswith("stale"):
        return True
    ok, out = remote.shell(host, record, _success_exit_codes=[0, last_known_good.WRITE_FAILED])
    lines = out.stdout_lines + out.stderr_lines
    failed = not ok or any(line.startswith("could not write") for line in lines)
    for line in lines:
        (logger.error if failed else logger.warning)(
            f"{host.print_prefix}last known good: {line}")
    return not failed


@operation()
def last_good_recorded(check: str, record: str, state_now: str):
    """The last known good record rewritten where it disagrees with what serves, verified (a
    record a full disk kept from being written, edited by hand, or of another venv): read
    again when it runs, as the health gate earlier in the run may have recorded it.

    + check, record: last_known_good.py's check and record commands (:func:`record_command`)
    + state_now: :class:`LastGoodState` while planning
    """
    if state_now.startswith("stale"):
        # a fresh host's first record ("absent") is no news: the gate's pass records it
        logger.info(f"{host.print_prefix}last known good: {state_now}: recording it again")
    yield FunctionCommand(_record_if_stale, (check, record), {})


@operation()
def venvs_pruned(venvs_dir: str, keep: int, kept: list[str], remove: list[str]):
    """Remove the venvs ``remove`` under ``venvs_dir`` (those of failed lock changes, those
    retention no longer keeps), never one of ``kept`` (the one serving, the last known good's,
    the one this run converges); the shipped script checks the record again when it runs.

    + venvs_dir: VENVS_DIR
    + keep: gpuhost_venvs_kept
    + kept: venvs never removed here
    + remove: what planning found to remove
    """
    if not remove:
        host.noop("no venv to prune")
        return
    logger.info(f"{host.print_prefix}ML venv: removing the venvs {', '.join(remove)} "
                f"(gpuhost_venvs_kept = {keep}; kept: {', '.join(kept)})")
    yield last_known_good.prune_command(venvs_dir, keep, kept)
