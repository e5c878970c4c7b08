"""Measure the served model: sglang's bench_serving at each concurrency level, GPU telemetry,
a diagnosis per level, results on the controller; or a sweep of one server setting.

    pyinfra -y inventory/lab.py bench.py              # every host
    pyinfra -y inventory/lab.py bench.py --limit gpu1 # one host
    pyinfra -y inventory/lab.py bench.py --data gpuhost_bench_sweep='{"moe_runner_backend":
        ["flashinfer_cutlass", "cutlass"]}'           # each value served, benched, compared
    pyinfra -y inventory/lab.py bench.py --data gpuhost_bench_target=router  # the fleet, through
                                                      # the router (operations/stages/bench_fleet.py)

Host data is validated as for deploy.py (gpuhost_bench_* keys included) before any host is
touched; each host is benched under its deploy lock, and refused, before any load, when its
server does not pass the deploy's health gate. Results: bench-results/<host>/<UTC time>/.
"""

from pyinfra import host, inventory

from operations.runtime.remote import use_run_env
from operations.plans.plan import stop_if_refused
from operations.plans.settings import for_run
from operations.stages import bench_fleet, deploy_lock
from operations.stages.bench import RESULTS_ROOT, bench_run, prepare, say
from operations.stages.sweep import leftover_restored, sweep_run

everyone = for_run(inventory)
settings = everyone[host.name]
use_run_env()

the_fleet = bench_fleet.plan(inventory, everyone)
part = bench_fleet.prepare(the_fleet, everyone) if the_fleet else None
if part is not None:
    if part and deploy_lock.held(settings, job="bench") and prepare(settings):
        workers = the_fleet.workers_of(host.name)
        bench_fleet.fleet_bench_run(
            name=f"Bench the fleet ({len(workers)} workers) through the router at concurrency "
                 + ", ".join(str(n) for n in settings.bench_levels),
            settings=settings, workers=tuple((w.name, w.url) for w in workers),
            dest_root=str(RESULTS_ROOT))
elif not settings.serving:
    say("Bench: serves no model (gpuhost_serving = False): nothing to bench here")
elif deploy_lock.held(settings, job="bench") and prepare(settings):
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
