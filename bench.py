"""Measure the served model: sglang's bench_serving at each concurrency level, GPU telemetry,
a diagnosis per level, results on the controller.

    pyinfra inventory/lab.py bench.py                 # every host
    pyinfra inventory/lab.py bench.py --limit gpu1    # one host

Host data is validated as for deploy.py (gpuhost_bench_* keys included) before any host is
touched; each host is benched under its deploy lock, and refused, before any load, when its
server does not pass the deploy's health gate. Results: bench-results/<host>/<UTC time>/.
"""

from pyinfra import host, inventory

from operations import deploy_lock
from operations.bench import bench
from operations.plan import stop_if_refused
from operations.remote import use_run_env
from operations.settings import for_run

settings = for_run(inventory)[host.name]
use_run_env()

if deploy_lock.held(settings):
    bench(settings)
stop_if_refused()
