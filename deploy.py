"""Converge GPU inference hosts to a healthy SGLang server, stage by stage.

    pyinfra inventory/lab.py deploy.py          # converge every host
    pyinfra inventory/lab.py deploy.py --dry    # show, per host, what would change

Every host's data is validated before any host is touched. The hosts of the gpuhost_router
group also run the router in front of every serving host (operations/stages/fleet.py); a router host
with gpuhost_serving=False (a CPU-only VM) runs only the router, after a preflight of its own.
Servers that restart then roll, out of the router one position at a time
(operations/stages/roll.py). A branch or tag of the model is one commit per fleet, decided once a
run (operations/plans/model_revision.py).
The router's worker list is checked after every host's server stage; then come each GPU host's
node exporter and GPU readings, and Prometheus on a router host
(operations/stages/observability.py). Loopback ports behind the gates, and a server on the loopback,
admit root's processes only (operations/stages/loopback_guard.py; gpuhost_server_local_users may
name more for the latter). With a fleet CA in host data, the public gates serve TLS with
certificates it signs (operations/stages/tls.py). Each host is deployed by one run at a time (its
deploy lock). A stage that must not run on a host is refused while planning: --dry shows why; a real
run takes that host out before any change; both exit non-zero. With gpuhost_rollback=true a host is
only rolled back to its last known good; a rollback an earlier run did not finish is finished, and
nothing else done on that host (the run fails saying so; the next run applies host data).
"""

from pyinfra import host, inventory, state

from operations.runtime import (
    call_order,
    fact_cache,
    global_arguments,
    link,
    planned_facts,
    shipped_files,
)
from operations.runtime.remote import use_run_env
from operations.plans import model_revision, proxy
from operations.plans.plan import stop_if_refused
from operations.plans.settings import for_run
from operations.plans.stack_check import known_behaviour
from operations.stages import deploy_lock, fleet, roll, rollback, tls
from operations.stages.driver_rollback import fail_if_rolled_back
from operations.stages.loopback_guard import loopback_guard
from operations.stages.mlenv import mlenv
from operations.stages.nodes import node_role, nodes_env
from operations.stages.nvidia import nvidia
from operations.stages.observability import observability
from operations.stages.p2p import p2p
from operations.stages.preflight import preflight
from operations.stages.router import own_url, router, router_check
from operations.stages.server import sglang_server

the_fleet, fleet_settings = fleet.for_run(inventory, for_run(inventory))
settings = fleet_settings[host.name]
fleet_cas = tls.for_run(fleet_settings)  # the fleet CA, read on the controller
model_revision.configure(fleet_settings)  # the model's commit: once per fleet and run
roll.configure(the_fleet, {r: own_url(fleet_settings[r]) for r in the_fleet.routers},
               fleet_settings)
use_run_env()
link.watch(state, host)
call_order.install()
global_arguments.install()
fact_cache.install()
shipped_files.install()
planned_facts.install()
proxy.use_host_proxy(settings, fleet_settings, inventory)  # every download through it

if deploy_lock.held(settings):
    interrupted = rollback.unfinished() if settings.serving else None
    if settings.rollback and settings.serving or interrupted:
        rollback.rollback(settings, interrupted)
    else:
        preflight(settings)
        loopback_guard(fleet.guarded_ports(the_fleet, host.name, settings),
                       fleet.admitted_users(settings),
                       fleet.service_users(the_fleet, host.name, settings))
        if host.name in fleet_cas:  # the CA's certificate; the host's own for a public gate
            tls.certificates(settings, fleet_cas[host.name],
                             {r: [w.name for w in the_fleet.workers_of(r)]
                              for r in the_fleet.routers})
        if settings.serving:  # else a router host with no GPU, driver, ML venv nor server
            known_behaviour(settings)
            driver = nvidia(settings)
            venv_changes = mlenv(settings)
            p2p_changes = p2p(settings, driver_changes=bool(driver and driver.change))
            role = node_role(settings)
            sglang_server(settings, inputs=[*venv_changes, *p2p_changes,
                                            *nodes_env(role, settings)],
                          role=role, peers=fleet_settings)
        workers = the_fleet.workers_of(host.name)
        started = router(settings, workers, fleet_cas.get(host.name)) \
            if host.name in the_fleet.routers else None
        # every host plans it at this line: one operation, after each host's stages above
        fail_if_rolled_back()
        if started is not None:
            router_check(settings, workers, started)
        observability(fleet_settings, the_fleet)  # node exporter, GPU readings, Prometheus
        shipped_files.retired()  # library files an older gpuhost shipped
stop_if_refused()
planned_facts.save()
