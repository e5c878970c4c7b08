"""The bench's sweep: one server setting, each value served through a runtime drop-in, benched,
recorded; then the server as deploy.py configured it again, verified healthy."""

from __future__ import annotations

import shlex
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import jinja2
from pyinfra import host
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.facts.files import File
from pyinfra.api.exceptions import OperationError

from operations import REPO_ROOT
from operations.runtime import remote
from operations.plans.settings import PREFIX, Settings
from operations.reports import sweep_report
from operations.stages.bench import (
    PROGRESS_EVERY,
    RUN_UNIT,
    gate_or_refuse,
    results_dir,
    run_levels,
    say,
)
from operations.stages.server_health import _wait_serving, settings_gate_argv
from operations.stages.server_unit import GATE_UNIT, SWEEP_DROPIN, UNIT, server_env, unit_context

#: Journal lines kept for a value whose server failed.
JOURNAL_LINES: Final = 20


def dropin_text(settings: Settings, key: str, value: Any) -> str:
    """The runtime drop-in that serves ``key = value``: the unit's own ExecStart line, rendered
    from templates/sglang.service.j2 with that one setting changed (systemd.unit(5): an empty
    ``ExecStart=`` first clears the unit's), and the environment that value adds to the
    server's (MTP on: ``SGLANG_ENABLE_SPEC_V2=True``, see server.server_env; an
    ``Environment=`` line of a drop-in adds to the unit's, and the server's EnvironmentFile
    does not set it where the host data has MTP off, systemd.exec(5))."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(REPO_ROOT / "templates")),
                             keep_trailing_newline=True)
    unit = env.get_template("sglang.service.j2").render(
        **unit_context(replace(settings, **{key: value})))
    (exec_start,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    configured = server_env(settings)
    added = {k: v for k, v in server_env(replace(settings, **{key: value})).items()
             if configured.get(k) != v}
    environment = "".join(f"Environment={k}={v}\n" for k, v in sorted(added.items()))
    return (f"# gpuhost bench.py sweep: {key} = {value}; removed when the sweep ends (or by the "
            f"next bench or deploy)\n[Service]\n{environment}ExecStart=\n{exec_start}\n")


def _units(settings: Settings) -> list[str]:
    return [UNIT, GATE_UNIT] if settings.server_is_public else [UNIT]


def _restart(host, text: str | None) -> None:
    """Write (or, with None, remove) the sweep's drop-in and restart the server without
    waiting (the gate shows the progress)."""
    folder = SWEEP_DROPIN.rsplit("/", 1)[0]
    write = (f"mkdir -p {folder} && printf %s {shlex.quote(text)} > {SWEEP_DROPIN}" if text
             else f"rm -f {SWEEP_DROPIN}")
    ok, output = remote.shell(host, f"{write} && systemctl daemon-reload && "
                              f"(systemctl reset-failed {UNIT} 2>/dev/null; true) && "
                              f"systemctl restart --no-block {UNIT}")
    if not ok:
        raise OperationError("could not restart the server: "
                             + " ".join(output.stderr_lines[-3:]))


def restore(state, host, settings: Settings) -> None:
    """The server as deploy.py configured it: the drop-in removed, restarted, the deploy's gate
    passed (which records it verified). OperationError when it does not pass."""
    say("sweep: restoring the server as deploy.py configured it")
    _restart(host, None)
    if not _wait_serving(state, host, settings_gate_argv(settings), settings.health_timeout,
                         _units(settings)):
        raise OperationError(f"{UNIT} as deploy.py configured it does not pass the health gate "
                             "after the sweep (above): run deploy.py")


def _gate(host, settings: Settings) -> tuple[bool, str]:
    """The deploy's health gate on one sweep value, its progress printed every PROGRESS_EVERY
    seconds: (passed, why not: the gate's "server not ready: ..." words)."""
    waited, began = 0.0, time.monotonic()
    while True:
        command = StringCommand(*settings_gate_argv(settings), "--poll-for", str(PROGRESS_EVERY),
                                "--elapsed-offset", f"{waited:.0f}")
        ok, output = remote.shell(host, command, _success_exit_codes=[0, 3],
                                  timeout=PROGRESS_EVERY + remote.POLL_TIMEOUT_S + 60)
        waited = time.monotonic() - began
        lines = output.stdout_lines + output.stderr_lines
        why = next((line for line in lines if line.startswith("server not ready")), "")
        for line in lines:
            if line.startswith(("waiting", "ready after", "server not ready")):
                say(f"sweep: {line}", error=bool(why))
        if why or not ok:
            return False, why.removeprefix("server not ready: ") or "the health gate failed"
        if any(line.startswith("ready after") for line in lines):
            return True, ""


def _journal(host) -> list[str]:
    _, output = remote.shell(host, f"journalctl -u {UNIT} -n {JOURNAL_LINES} --no-pager -o cat",
                             _success_exit_codes=[0, 1])
    return output.stdout_lines


@remote.callback("the sweep", f"the bench goes on on the host ({RUN_UNIT}); the next bench "
                 "or deploy restores the server")
def _sweep(state, host, settings: Settings, dest_root: str) -> bool:
    """Gate; the configured server's levels as the baseline (when the sweep does not name its
    value); per value: restart with it, the deploy's gate, the levels, record (the first value
    to complete every request twice, for the run-to-run spread); restore."""
    gate_or_refuse(host, settings)
    ((key, values),) = settings.bench_sweep.items()
    configured = getattr(settings, key)
    dest = results_dir(dest_root, host)
    outcomes: list[dict[str, Any]] = []
    repeated = False

    def levels_of(one: Settings, value: Any, label: str, baseline: bool = False) -> None:
        """The levels of one value; the first value whose levels complete every request runs
        them again right away, on the same server: the run-to-run spread a winner must beat."""
        nonlocal repeated
        results, _, complete = run_levels(host, one, dest / f"{key}={value}", label=label)
        outcome = {"value": value, "status": "ok" if complete else "failed",
                   "reason": "" if complete else "bench_serving failed at a level",
                   "results": results, **({"baseline": True} if baseline else {})}
        outcomes.append(outcome)
        if complete and not repeated and all(lv.get("complete") for lv in results["levels"]):
            repeated = True
            say(f"sweep: {key} = {value} again, on the same server: the run-to-run spread")
            again, _, complete = run_levels(host, one, dest / f"{key}={value}" / "repeat",
                                            label=f"{label} (repeat)")
            if complete:
                outcome["repeat"] = again

    try:
        if configured not in values:
            say(f"sweep: {key} = {configured} (configured): the baseline, as it serves now")
            levels_of(settings, configured, f"{configured} (configured)", baseline=True)
        for value in values:
            say(f"sweep: {key} = {value}: restarting {UNIT} with it (weights load again)")
            _restart(host, dropin_text(settings, key, value))
            passed, why = _gate(host, settings)
            if not passed:
                outcomes.append({"value": value, "status": "failed", "journal": _journal(host),
                                 "reason": f"the server failed the health gate: {why}"})
                say(f"sweep: {key} = {value}: failed ({why}); the sweep goes on", error=True)
                continue
            levels_of(replace(settings, **{key: value}), value, str(value))
    finally:
        restore(state, host, settings)
    text = sweep_report.write_sweep(dest, host.name, key, configured, outcomes)
    for line in text.splitlines():
        say(line)
    for name in ("results.json", "summary.md", "bench.png"):
        if (dest / name).exists():
            say(f"bench: {dest / name}")
    if not any(o["status"] == "ok" for o in outcomes):
        raise OperationError(f"no value of {PREFIX}bench_sweep's {key} served (above)")
    return True


@remote.callback("restoring the server after an interrupted sweep")
def _restore_leftover(state, host, settings: Settings) -> bool:
    say(f"sweep: {SWEEP_DROPIN} is left from an interrupted sweep", error=True)
    restore(state, host, settings)
    return True


@operation(is_idempotent=False)
def leftover_restored(settings: Settings):
    """Restore the server when an interrupted sweep left its drop-in (see :func:`restore`).

    + settings: the host's validated settings
    """
    if not host.get_fact(File, path=SWEEP_DROPIN):
        host.noop("no sweep drop-in is left")
        return
    yield FunctionCommand(_restore_leftover, (settings,), {})


@operation(is_idempotent=False)
def sweep_run(settings: Settings, dest_root: str):
    """Sweep one server setting (gpuhost_bench_sweep) and bench each value (see bench.bench).

    + settings: the host's validated settings
    + dest_root: the controller's folder for results (bench-results/)
    """
    yield FunctionCommand(_sweep, (settings, dest_root), {})
