"""A host's GPU verdict where the deploy and the worker's gate act on it: the host's own GPU
metrics textfile, judged by operations/files/gpu_health.py ``gpu_faults`` (the same readings and
the same verdict as status.py's and the bench's).

- The GPU readings unit (gpuhost-gpu-metrics.service, operations/stages/observability.py) writes
  :data:`FAILED_FILE` with the verdict's words while the host's GPUs failed (a fatal Xid, a GPU
  missing, an uncorrectable ECC error, a failed row remapping) and removes it once they are
  healthy again; the worker's API key gate answers ``/health`` with 503 while it exists
  (templates/gate-nginx.conf.j2). The router's health checks are smg's own: ``GET
  --health-check-endpoint`` (/health) every ``--health-check-interval-secs``; any answer but a
  2xx is a failure; ``--health-failure-threshold`` failures in a row take the worker out of the
  selection pool, ``--health-success-threshold`` passes in a row bring it back
  (lightseekorg/smg docs/concepts/reliability/health-checks.md, "Worker Health Endpoint" and
  "State Transitions"; smg 1.13.0 keeps such a worker listed, not healthy, and takes it back
  once it answers: operations/files/router_workers.py, seen in tests/e2e/test_observability.py).
  That page also describes a terminal ``Failed`` state after 3 x the failure threshold in later
  smg: read it again before moving locks/router.txt past 1.13.0.
- The server stage refuses, while planning, to start or restart the server on GPUs that failed
  (:func:`restart_refusal`): the restart would load the weights onto a GPU whose results cannot
  be trusted or that is gone, and fail the health gate after gpuhost_health_timeout.
"""

from __future__ import annotations

from typing import Final

from pyinfra import host

from operations.facts.host import FileText
from operations.plans.plan import fact, refuse
from operations.files.gpu_health import gpu_faults

#: The node exporter's textfile folder (Debian's prometheus-node-exporter reads it with
#: ``--collector.textfile.directory``) and the GPU readings' file in it.
TEXTFILE_DIR: Final = "/var/lib/prometheus/node-exporter"
GPU_METRICS_FILE: Final = f"{TEXTFILE_DIR}/gpuhost-gpu.prom"
#: The GPU readings unit's RuntimeDirectory= (kept between its runs: RuntimeDirectoryPreserve=)
#: and the file there that exists while the host's GPUs failed.
RUNTIME_DIR: Final = "gpuhost-gpu-health"
FAILED_FILE: Final = f"/run/{RUNTIME_DIR}/failed"


def restart_refusal(host_name: str, textfile: str | None, action: str) -> str | None:
    """The refusal of the server stage for ``host_name`` whose GPU textfile (None: absent) says
    its GPUs failed, where the server would be ``action`` ("restarted" or "started"); None
    where they did not (or were never read). One line: the host, the GPUs, each reason with
    what to do."""
    if not textfile:
        return None
    faults = gpu_faults(textfile)
    if faults.state != "failed":
        return None
    return (f"{host_name}'s GPUs failed, so its server is not {action}: "
            + "; ".join(faults.reasons)
            + ". Drain it, then reset the GPU (nvidia-smi -r -i <GPU>), reboot the host or "
            "replace the GPU as said, and deploy again once status.py says its GPUs are healthy")


def refusal(running: bool, changes: bool) -> None:
    """While planning the server stage (operations/stages/server.py): refuse its start (not
    ``running``) or its restart (``changes``: something it reads changed) where the host's GPUs
    failed. Their readings are read only then: a run that leaves the server alone asks the host
    nothing more, and is never refused for them."""
    action = "started" if not running else "restarted" if changes else None
    if action is None:
        return
    said = restart_refusal(host.name, fact(FileText, path=GPU_METRICS_FILE), action)
    if said:
        refuse("SGLang server", said)
