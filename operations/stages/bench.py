"""Bench the served model: sglang's bench_serving against the host's own server at each
concurrency level, GPU telemetry sampled meanwhile, results and a diagnosis on the controller."""

from __future__ import annotations

import json
import shlex
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Final

from pyinfra import host, logger
from pyinfra.api import FactBase, FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.files import File
from pyinfra.operations import files
from typing_extensions import override

from operations import REPO_ROOT
from operations.runtime import remote
from operations.plans.plan import fact, refuse
from operations.plans.settings import PREFIX, Settings
from operations.reports import bench_report
from operations.stages.observability import GPU_METRICS_FILE
from operations.stages.preflight import InitSystem
from operations.stages.server_unit import GATE_UNIT, UNIT, UNIT_PATH, backend_url, public_url
from operations.stages.tls import CA_PATH

#: Where bench.py keeps its scripts and the run's raw outputs on the host (not deploy.py's).
BENCH_DIR: Final = "/var/lib/gpuhost/bench"
RUN_DIR: Final = f"{BENCH_DIR}/run"
#: The transient unit the run goes in (systemd-run): a dropped link does not stop it.
RUN_UNIT: Final = "gpuhost-bench.service"
#: Where the results go on the controller: <root>/<host>/<UTC time>/.
RESULTS_ROOT: Final = REPO_ROOT / "bench-results"
#: Seconds between two progress lines while the run goes on.
PROGRESS_EVERY: Final = 10
#: Seconds the health gate gives a server that should already serve.
GATE_TIMEOUT: Final = 60
SCRIPTS: Final = ("bench_run.py", "health_check.py", "secret_file.py")


class ModelContextLength(FactBase):
    """The model's context length in tokens, from ``<model>/config.json``
    (``max_position_embeddings``, as transformers' configs name it); None when the file or the
    field is missing. Example: ``202752``."""

    @override
    def command(self, path: str) -> str:
        return f"cat {shlex.quote(path)}/config.json 2>/dev/null || true"

    @override
    def process(self, output) -> int | None:
        try:
            value = json.loads("\n".join(output)).get("max_position_embeddings")
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, int) else None


def context_length(settings: Settings, from_config: int | None) -> int | None:
    """What the server allows: ``--context-length`` in gpuhost_server_extra_args, else the
    model's own."""
    args = list(settings.server_extra_args)
    for i, arg in enumerate(args):
        if arg.startswith("--context-length="):
            return int(arg.split("=", 1)[1])
        if arg == "--context-length" and i + 1 < len(args):
            return int(args[i + 1])
    return from_config


def _gate_argv(settings: Settings) -> list[str]:
    argv = ["python3", f"{BENCH_DIR}/health_check.py", "--url", backend_url(settings),
            "--model", settings.served_model_name, "--unit", UNIT,
            "--timeout", str(GATE_TIMEOUT), "--keep-unit"]
    if settings.server_is_public:
        url = public_url(settings)
        argv += ["--public-url", url, "--api-key-file", settings.api_key_file,
                 "--gate-unit", GATE_UNIT]
        if url.startswith("https://"):
            argv += ["--ca-file", CA_PATH]
    return argv


def _run_argv(settings: Settings, endpoint: tuple[str, str | None, str] | None = None
              ) -> list[str]:
    """bench_run.py's command line: against the host's own server, or ``endpoint`` (URL, API
    key file or None, bench_serving backend: operations/stages/bench_fleet.py's router)."""
    if endpoint is None:
        url = public_url(settings) or backend_url(settings)
        key_file = settings.api_key_file if settings.server_is_public else None
        backend = None
    else:
        url, key_file, backend = endpoint
    argv = ["python3", f"{BENCH_DIR}/bench_run.py", "--python",
            f"{settings.venv_path}/bin/python", "--url", url,
            "--model", settings.served_model_name, "--tokenizer", settings.model_path,
            "--levels", ",".join(str(n) for n in settings.bench_levels),
            "--input-len", str(settings.bench_input_len),
            "--output-len", str(settings.bench_output_len),
            "--prompts", str(settings.bench_prompts), "--out", RUN_DIR,
            "--gpu-metrics", GPU_METRICS_FILE]
    if key_file:
        argv += ["--api-key-file", key_file]
    if url.startswith("https://"):
        argv += ["--ca-file", CA_PATH]
    if backend:
        argv += ["--backend", backend]
    return argv


def say(line: str, error: bool = False) -> None:
    """A line on the controller's screen, under the current host's prefix."""
    (logger.error if error else logger.info)(f"{host.print_prefix}{line}")


def gate_or_refuse(host, settings: Settings) -> None:
    """The deploy's health gate, leaving the unit as it is; OperationError when it fails."""
    ok, output = remote.shell(host, StringCommand(*map(shlex.quote, _gate_argv(settings))),
                              timeout=GATE_TIMEOUT + 120)
    lines = output.stdout_lines + output.stderr_lines
    if not ok or not any(line.startswith("ready after") for line in lines):
        for line in lines:
            say(line, error=True)
        raise OperationError(f"refused: {UNIT} is not healthy (the deploy's health gate "
                             "failed, above): no load was sent; run deploy.py to put it right")


def run_levels(host, settings: Settings, dest: Path, label: str | None = None,
               argv: list[str] | None = None, endpoint: dict | None = None):
    """Run bench_run.py in RUN_UNIT (``argv``, else against the host's own server), print its
    progress, fetch its outputs to ``dest/raw`` and report them into ``dest`` (``endpoint``:
    what was benched, when not the host's own server); returns (results, summary text, whether
    every level ran)."""
    run = " ".join(shlex.quote(a) for a in (argv or _run_argv(settings)))
    _, state = remote.shell(host, f"systemctl is-active {RUN_UNIT}", _success_exit_codes=[0, 3])
    if state.stdout_lines[:1] in (["active"], ["activating"]):
        raise OperationError(f"a bench is still running on the host ({RUN_UNIT}, from an earlier "
                             f"run whose link dropped): wait for it, or stop it with systemctl "
                             f"stop {RUN_UNIT}")
    ok, started = remote.shell(
        host, f"systemctl reset-failed {RUN_UNIT} 2>/dev/null; rm -rf {RUN_DIR} && "
        f"mkdir -p {RUN_DIR} && systemd-run --quiet --unit={RUN_UNIT} --collect "
        f"-p StandardOutput=append:{RUN_DIR}/progress.log "
        f"-p StandardError=append:{RUN_DIR}/progress.log {run}")
    if not ok:
        raise OperationError(f"could not start {RUN_UNIT}: "
                             + " ".join(started.stderr_lines[-3:]))
    shown, began = 0, time.monotonic()
    while True:
        _, poll = remote.shell(
            host, f"systemctl is-active {RUN_UNIT}; tail -n +{shown + 1} {RUN_DIR}/progress.log",
            timeout=remote.POLL_TIMEOUT_S, _success_exit_codes=[0, 1, 3])
        active, *new = poll.stdout_lines or ["unknown"]
        for line in new:
            say(f"bench: {line}")
        shown += len(new)
        if active not in ("active", "activating"):
            break
        if not new:
            say(f"bench: running for {time.monotonic() - began:.0f} s")
        time.sleep(PROGRESS_EVERY)
    raw = dest / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    _, listing = remote.shell(host, f"ls {RUN_DIR}")
    for name in listing.stdout_lines:
        remote.get(host, f"{RUN_DIR}/{name}", str(raw / name))
    if not (raw / "done").is_file():
        raise OperationError(f"the bench run ended without finishing ({RUN_UNIT}'s output is "
                             f"in {raw}/progress.log)")
    try:
        results, text = bench_report.write(raw, dest, host.name, label, endpoint, settings)
    except (bench_report.ReportError, ValueError) as exc:
        raise OperationError(f"the raw outputs in {raw} do not report: {exc}") from None
    remote.shell(host, f"rm -rf {RUN_DIR}")
    return results, text, (raw / "done").read_text().strip() == "ok"


def results_dir(dest_root: str, host) -> Path:
    """``<dest_root>/<host>/<UTC time>/``."""
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ")
    return Path(dest_root) / host.name / started


@remote.callback("the bench", f"the bench goes on on the host ({RUN_UNIT})")
def _bench(state, host, settings: Settings, dest_root: str) -> bool:
    """Gate, run, poll, fetch, report (see :func:`bench`)."""
    gate_or_refuse(host, settings)
    dest = results_dir(dest_root, host)
    results, text, complete = run_levels(host, settings, dest)
    report(text, complete, dest, results)
    return True


def report(text: str, complete: bool, dest, results: dict | None = None) -> None:
    """Say the report, each level that failed requests, and where its files are;
    OperationError when bench_serving failed at a level."""
    for line in text.splitlines():
        say(line)
    for level in (results or {}).get("levels", []):
        failed = bench_report.failed_words(level)
        if failed and level.get("rc", 0) == 0:
            say(f"bench: concurrency {level['concurrency']}: {failed} (results.json's "
                "\"requests\", summary.md and bench.png mark it)", error=True)
    for name in ("results.json", "summary.md", "bench.png"):
        say(f"bench: {dest / name}")
    if not complete:
        raise OperationError("bench_serving failed at a level (above); the levels before it "
                             f"are reported in {dest}")


@operation(is_idempotent=False)
def bench_run(settings: Settings, dest_root: str):
    """Run the bench on the host and fetch and report its results (see :func:`bench`).

    + settings: the host's validated settings
    + dest_root: the controller's folder for results (bench-results/)
    """
    yield FunctionCommand(_bench, (settings, dest_root), {})


def prepare(settings: Settings) -> bool:
    """Plan what every bench needs: refuse (False) when PID 1 is not systemd, no server unit is
    deployed, or input plus output length exceed the model's context length; else ship the
    host-side scripts to BENCH_DIR (nothing deploy.py manages) and say True.

    The bench itself (:func:`bench_run`, or operations/stages/sweep.py's sweep_run) then refuses
    when the server does not pass the deploy's health gate (which here leaves the unit as it is),
    loads it with sglang's bench_serving at each of gpuhost_bench_levels while nvidia-smi
    samples every GPU (operations/files/bench_run.py, in the transient unit RUN_UNIT, progress
    every 10 s), fetches the raw outputs to ``bench-results/<host>/<UTC time>/raw/`` and
    writes results.json, summary.md and bench.png there (operations/reports/bench_report.py),
    printing the summary and the paths.
    """
    if fact(InitSystem) != "systemd":
        refuse("Bench", "PID 1 is not systemd: the server runs as a systemd unit")
        return False
    if not fact(File, path=UNIT_PATH):
        refuse("Bench", f"no server is deployed ({UNIT_PATH} is missing): run deploy.py first")
        return False
    limit = context_length(settings, fact(ModelContextLength, path=settings.model_path))
    total = settings.bench_input_len + settings.bench_output_len
    if limit is not None and total > limit:
        refuse("Bench", f"{PREFIX}bench_input_len + {PREFIX}bench_output_len = "
               f"{settings.bench_input_len} + {settings.bench_output_len} = {total} is not "
               f"allowed: at most the model's context length ({limit} tokens)")
        return False
    files.directory(name="Bench folder", path=BENCH_DIR, mode="700")
    for script in SCRIPTS:
        files.put(name=f"Ship {script} for the bench",
                  src=str(REPO_ROOT / "operations/files" / script),
                  dest=f"{BENCH_DIR}/{script}", mode="644")
    return True
