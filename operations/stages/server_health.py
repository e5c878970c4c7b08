"""The SGLang server's health gate: wait until it serves a real completion, record the units
that passed it, and roll the server back to the last known good where it fails."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from typing import Final

from pyinfra import logger
from pyinfra.api import FunctionCommand, StringCommand, operation

from operations.runtime import remote
from operations.plans.settings import Settings
from operations.stages import last_known_good, tls
from operations.stages.p2p import LIB_DIR
from operations.stages.server_unit import GATE_UNIT, UNIT, VERIFIED_FILE, backend_url, public_url

#: Seconds between two progress lines of the health gate.
PROGRESS_EVERY: Final = 10


def health_gate(host, argv: list[str]) -> bool:
    """Run the health gate in rounds of PROGRESS_EVERY seconds, printing its progress through
    pyinfra's logger (shown without -v); False when it failed, after showing why, the journal
    and that the unit was stopped."""
    waited, began = 0.0, time.monotonic()
    while True:
        command = StringCommand(*argv, "--poll-for", str(PROGRESS_EVERY),
                                "--elapsed-offset", f"{waited:.0f}")
        ok, output = remote.shell(host, command, _success_exit_codes=[0, 3],
                                  timeout=PROGRESS_EVERY + remote.POLL_TIMEOUT_S + 60)
        waited = time.monotonic() - began
        lines = output.stdout_lines + output.stderr_lines
        failed = not ok or any(line.startswith("server not ready") for line in lines)
        log = logger.error if failed else logger.info
        for line in lines:
            log(f"{host.print_prefix}{line}")
        if failed:
            return False
        if any(line.startswith("ready after") for line in lines):
            return True


def mark_verified(host, units: list[str]) -> bool:
    names = " ".join(shlex.quote(u) for u in units)
    return remote.shell(
        host, f"mkdir -p {shlex.quote(VERIFIED_FILE.rsplit('/', 1)[0])} && "
        f"systemctl show -p InvocationID --value {names} > {VERIFIED_FILE}.tmp && "
        f"chmod 644 {VERIFIED_FILE}.tmp && sync {VERIFIED_FILE}.tmp && "
        f"mv {VERIFIED_FILE}.tmp {VERIFIED_FILE}")[0]


@remote.callback("the health gate", "the server goes on starting on the host")
def _wait_serving(state, host, argv: list[str], timeout: int, units: list[str],
                  record: str | None = None,
                  change: str | Callable[[], str] = "") -> bool:
    """Run the health gate (:func:`health_gate`). When it passed, VERIFIED_FILE gets the
    InvocationIDs of ``units`` (the next deploy gates again only a unit started since) and
    ``record`` runs: the last known good (operations/stages/last_known_good.py). When it failed and
    ``record`` is given, the server is rolled back to the last known good, restarted and
    gated again (:func:`operations.stages.last_known_good.roll_back`); False either way, saying
    ``change``, what this run changed."""
    if health_gate(host, argv):
        if not mark_verified(host, units):
            return False
        if record is None:
            return True
        ok, out = remote.shell(host, record,
                               _success_exit_codes=[0, last_known_good.WRITE_FAILED])
        lines = out.stdout_lines + out.stderr_lines
        if any(line.startswith("could not write") for line in lines):
            # the host passed its gate and serves: it goes back in the router; the record is
            # written again at the end of the stage (last_good_recorded), which says why not
            return True
        for line in lines:
            (logger.info if ok else logger.error)(f"{host.print_prefix}last known good: {line}")
        return ok
    if record is None:
        return False
    what = change() if callable(change) else change
    why = (f"the server with {what} as this run changed it" if what else "the server") + \
        " failed the health gate (its journal above)"

    def again() -> bool:
        return health_gate(host, argv) and mark_verified(host, units)

    return last_known_good.roll_back(
        host, why, again, f"systemctl reset-failed {UNIT} 2>/dev/null; "
        f"systemctl restart --no-block {UNIT}")


def gate_argv(url: str, model: str, timeout: int, public_url: str | None = None,
              api_key_file: str | None = None) -> list[str]:
    """health_check.py's command line for :func:`serving` (its arguments, the same)."""
    argv = ["python3", f"{LIB_DIR}/health_check.py", "--url", shlex.quote(url),
            "--model", shlex.quote(model), "--unit", UNIT, "--timeout", str(timeout)]
    if public_url and api_key_file:
        argv += ["--public-url", shlex.quote(public_url),
                 "--api-key-file", shlex.quote(api_key_file), "--gate-unit", GATE_UNIT]
        if public_url.startswith("https://"):
            argv += ["--ca-file", tls.CA_PATH]
    return argv


def settings_gate_argv(settings: Settings) -> list[str]:
    """The health gate's command line for the server host data configures."""
    return gate_argv(backend_url(settings), settings.served_model_name, settings.health_timeout,
                     public_url(settings), settings.api_key_file)


@operation(is_idempotent=False)
def serving(url: str, model: str, timeout: int, public_url: str | None = None,
            api_key_file: str | None = None, units: tuple[str, ...] = (UNIT,),
            record: str | None = None, change: str | Callable[[], str] = ""):
    """Wait until the server serves ``model`` and answers a fixed greedy chat completion with
    text that is neither empty nor degenerate (operations/files/health_check.py), printing
    progress every 10 s; with a public URL, also that the API key gate refuses a request
    without the key and that /get_server_info does not contain it.

    + url: the server's own base URL as seen from the host, e.g. http://127.0.0.1:8000
    + model: the served model name
    + timeout: seconds before giving up; the unit is then stopped and its journal shown
    + public_url: the API key gate's base URL, when the server is public
    + api_key_file: root-only file holding the key (read on the host, never shown)
    + units: the units whose InvocationIDs VERIFIED_FILE records once the gate passed
    + record: the command recording the last known good once the gate passed; with it, a
      failed gate rolls the server back to the recorded one (operations/stages/last_known_good.py)
    + change: what this run changed, for the failure's message
    """
    argv = gate_argv(url, model, timeout, public_url, api_key_file)
    yield FunctionCommand(_wait_serving, (argv, timeout, list(units), record, change), {})
