"""The fleet's state, from its Prometheus: one line per host and one for the fleet. Changes
nothing on any host (only the Prometheus host is asked, through its HTTP API on its loopback).

    pyinfra inventory/lab.py status.py

Per host: serving or not, the server's sglang version and uptime, requests and output tokens
per second over the last 5 minutes, requests running and queued, the GPUs' power against their
limit, the clock event reasons holding them back, the last bench's figures (bench-results/ on
the controller; operations/reports/status.py says where each figure comes from); for a host without
a server, what it runs instead (the router, Prometheus); and a picture of the last hour per
host, status-results/fleet-<UTC time>.png.
"""

from datetime import datetime, timezone
from pathlib import Path

from pyinfra import host, inventory

from operations.runtime.run_exit import end_answered, end_run
from operations.plans.settings import for_run
from operations.reports.status import (
    PrometheusAnswers,
    PrometheusHour,
    duties,
    fleet_line,
    host_line,
    last_bench,
    plot,
)
from operations.stages import fleet
from operations.stages.bench import RESULTS_ROOT
from operations.stages.observability import (
    NODE_EXPORTER_USER,
    PROMETHEUS_PASSWORD,
    prometheus_hosts,
)

#: Where the pictures go, on the controller (beside bench.py's bench-results/).
PICTURES = Path("status-results")

everyone = for_run(inventory)
the_fleet, _ = fleet.for_run(inventory, everyone)
try:
    on = prometheus_hosts(the_fleet, everyone)
except ValueError as exc:
    end_run(f"gpuhost: {exc}")
if not on:
    end_run("gpuhost: no Prometheus in this inventory: it runs on a host of the gpuhost_router "
            "group (docs/observability.md)")
if on[0] not in {h.name for h in inventory.get_active_hosts()}:
    end_run(f"gpuhost: status.py asks the Prometheus on {on[0]}: leave {on[0]} in --limit")
if host.name == on[0]:
    # its API admits the metrics password only (operations/stages/observability.py)
    asked = {"port": everyone[host.name].prometheus_port, "user": NODE_EXPORTER_USER,
             "password_file": PROMETHEUS_PASSWORD}
    answers = host.get_fact(PrometheusAnswers, **asked)
    if "error" in answers:
        end_run(f"gpuhost: the Prometheus on {host.name}: {answers['error']}")
    names = [h.name for h in inventory]
    print("\n".join([*(host_line(n, answers, last_bench(RESULTS_ROOT, n),
                                  duties(n, the_fleet.routers, on, everyone)) for n in names),
                     fleet_line(names, answers)]), flush=True)
    hour = host.get_fact(PrometheusHour, **asked)
    if "error" not in hour:
        picture = PICTURES / f"fleet-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.png"
        plot(hour, picture)
        print(f"the last hour: {picture}", flush=True)
    # nothing to run: no "Press enter to execute", whether or not -y was given
    end_answered()
