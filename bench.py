"""Measure the served model: sglang's bench_serving at each concurrency level, GPU telemetry,
a diagnosis per level, results on the controller; or a sweep of one server setting.

    pyinfra inventory/lab.py bench.py                 # every host
    pyinfra inventory/lab.py bench.py --limit gpu1    # one host
    pyinfra inventory/lab.py bench.py --data gpuhost_bench_sweep='{"moe_runner_backend":
        ["flashinfer_cutlass", "cutlass"]}'           # each value served, benched, compared

Host data is validated as for deploy.py (gpuhost_bench_* keys included) before any host is
touched; each host is benched under its deploy lock, and refused, before any load, when its
server does not pass the deploy's health gate. Results: bench-results/<host>/<UTC time>/.
"""

from pyinfra import host, inventory

from operations import deploy_lock
from operations.bench import RESULTS_ROOT, bench_run, prepare
from operations.plan import stop_if_refused
from operations.remote import use_run_env
from operations.settings import for_run
from operations.sweep import leftover_restored, sweep_run

settings = for_run(inventory)[host.name]
use_run_env()

if deploy_lock.held(settings) and prepare(settings):
    leftover_restored(name="Restore the server if an interrupted sweep left it changed",
                      settings=settings)
    levels = ", ".join(str(n) for n in settings.bench_levels)
    if settings.bench_sweep:
        ((key, values),) = settings.bench_sweep.items()
        sweep_run(name=f"Sweep {key} over {', '.join(map(str, values))} at concurrency {levels}",
                  settings=settings, dest_root=str(RESULTS_ROOT))
    else:
        bench_run(name=f"Bench {settings.served_model_name} at concurrency {levels}",
                  settings=settings, dest_root=str(RESULTS_ROOT))
stop_if_refused()
