"""Run the fleet's router: the SGLang model gateway in its own locked venv, as a systemd unit in
front of every serving host's server, checked from its own worker list.

Which router: ``smg`` (PyPI, smg-project/smg), not ``sglang-router``. Both wheels were read
(``pip download --no-deps``): sglang-router 0.3.2 (2026-01-15, its last release) already is "SGLang
Model Gateway" and installs the same program under three names (its entry_points.txt: amg,
sglang-router, smg); the project then moved to smg (1.0.1 on 2026-02-13), and sglang 0.5.9
(2026-02-23), the pinned server, reads smg's routing key header (``x-smg-routing-key`` in its
serving_base.py and utils/common.py). Only its test fixtures still start
``sglang_router.launch_router``. smg is the maintained one; locks/router.txt pins 1.13.0 and its
dependencies with hashes. Its flags and defaults are smg 1.13.0's own ``smg launch --help``:
``--host`` (default 0.0.0.0), ``--port``, ``--worker-urls``, ``--policy`` (ROUTER_POLICIES),
``--health-check-*`` and ``--health-failure/success-threshold`` (defaults 60 s interval, 5 s
timeout, 3 and 2; host data sets them), and Prometheus metrics on 0.0.0.0:29000 unless told
otherwise (seen with ``ss``: so the unit binds them to the loopback).

Binding and keys as for the server: the router binds ``gpuhost_router_host``; a wider bind
needs ``gpuhost_router_api_key_file`` and then the API key gate (operations/files/api_gate.py)
listens there and the router on 127.0.0.1:``gpuhost_router_backend_port``. smg's own
``--api-key`` would put the key on its command line (ps, the unit file).

What the router calls on a worker (seen from a worker's side, smg 1.13.0): at registration
``GET /server_info``, ``/model_info``, ``/v1/models``; then ``GET /health`` every interval,
``/v1/loads`` and ``/metrics`` for its load monitor; requests are forwarded as they came
(``/v1/chat/completions`` ...), without an Authorization header.
"""

from __future__ import annotations

import json
import shlex
from io import StringIO
from typing import Final

from pyinfra import host, logger, state
from pyinfra.api import FactBase, FunctionCommand, StringCommand, operation
from pyinfra.facts.deb import DebPackages
from pyinfra.operations import apt, files, systemd
from typing_extensions import override

from operations import REPO_ROOT, remote
from operations.disk import NO_SPACE
from operations.fleet import Worker
from operations.folders import top_folders
from operations.lock import read_lock
from operations.mlenv import LOCK_DIR, locked_packages, venv_that_runs
from operations.p2p import LIB_DIR
from operations.host import HostAddresses, address_problem
from operations.plan import fact, refuse
from operations.secret_files import check_secret_file
from operations.server import (
    GATE_MAX_CONNECTIONS,
    GATE_MEMORY_MAX,
    GATE_TASKS_MAX,
    PortListeners,
    systemd_quote,
)
from operations.settings import PREFIX, ROUTER_METRICS_PORT, Settings

UNIT: Final = "sglang-router.service"
UNIT_PATH: Final = f"/etc/systemd/system/{UNIT}"
GATE_UNIT: Final = "sglang-router-gate.service"
GATE_UNIT_PATH: Final = f"/etc/systemd/system/{GATE_UNIT}"
#: The router's Prometheus metrics, on the loopback (smg's default port, 29000).
METRICS_PORT: Final = ROUTER_METRICS_PORT
CHECK_SCRIPT: Final = f"{LIB_DIR}/router_workers.py"


def own_url(settings: Settings) -> str:
    """Where the router itself answers on its host: behind the gate on the loopback when it is
    public, else its bind."""
    if settings.router_is_public:
        return f"http://127.0.0.1:{settings.router_backend_port}"
    address = settings.router_host
    return f"http://{f'[{address}]' if ':' in address else address}:{settings.router_port}"


def unit_context(settings: Settings, workers: tuple[Worker, ...]) -> dict:
    """What templates/sglang-router.service.j2 is rendered with."""
    public = settings.router_is_public
    return {
        "workers": workers,
        "listen": f"{settings.router_host}:{settings.router_port}",
        "gate_unit": GATE_UNIT if public else None,
        "venv": settings.router_venv_path,
        "bind_host": "127.0.0.1" if public else settings.router_host,
        "bind_port": settings.router_backend_port if public else settings.router_port,
        "policy": settings.router_policy,
        "worker_urls": " ".join(systemd_quote(w.url) for w in workers),
        "health_check_interval_secs": settings.router_health_check_interval_secs,
        "health_check_timeout_secs": settings.router_health_check_timeout_secs,
        "health_failure_threshold": settings.router_health_failure_threshold,
        "health_success_threshold": settings.router_health_success_threshold,
        "metrics_port": METRICS_PORT,
    }


def gate_context(settings: Settings) -> dict:
    """What templates/sglang-router-gate.service.j2 is rendered with."""
    return {
        "router_unit": UNIT,
        "lib_dir": LIB_DIR,
        "listen": f"{settings.router_host}:{settings.router_port}",
        "listen_host": settings.router_host,
        "listen_port": settings.router_port,
        "backend_url": own_url(settings),
        "key_file": systemd_quote(settings.router_api_key_file or ""),
        "max_connections": GATE_MAX_CONNECTIONS,
        "memory_max": GATE_MEMORY_MAX,
        "tasks_max": GATE_TASKS_MAX,
    }


class RouterWorkers(FactBase[dict]):
    """The router's own worker list against the expected URLs (operations/files/
    router_workers.py, one look), where the router runs:

    .. code:: python

        {"listed": {"http://10.0.0.5:8000": True}, "missing": [], "unhealthy": [], "error": ""}
    """

    @override
    def requires_command(self, router: str, urls: tuple[str, ...]) -> str:
        return "python3"

    @override
    def command(self, router: str, urls: tuple[str, ...]) -> str:
        args = " ".join(shlex.quote(u) for u in urls)
        return (f"if [ -f {CHECK_SCRIPT} ]; then python3 {CHECK_SCRIPT} --timeout 0 --router "
                f"{shlex.quote(router)} {args}; else echo '{{\"error\": \"not installed\"}}'; fi")

    @override
    def process(self, output: list[str]) -> dict:
        try:
            return json.loads("\n".join(output))
        except ValueError:
            return {"error": f"cannot read {output[:2]!r}"}


def _expected(state, workers: tuple[tuple[str, str], ...]) -> tuple[list[str], list[str]]:
    """(URLs to check, names left out): a worker whose host failed in this run (a failed roll,
    a refused host) is left out: it stays out of the router until a run converges it."""
    failed = {h.name for h in state.failed_hosts}
    return ([url for name, url in workers if name not in failed],
            [name for name, _ in workers if name in failed])


@remote.callback("the router's worker check")
def _workers_listed(state, host, router: str, workers: tuple[tuple[str, str], ...],
                    timeout: int) -> bool:
    urls, left = _expected(state, workers)
    if left:
        logger.warning(f"{host.print_prefix}Router: not waiting for {', '.join(left)}, which "
                       "failed in this run")
    if not urls:
        return True
    ok, out = remote.shell(host, StringCommand("python3", CHECK_SCRIPT, "--router", router,
                                               "--timeout", str(timeout), "--register", *urls),
                           timeout=timeout + 60)
    for line in out.stdout_lines + out.stderr_lines:
        (logger.info if ok else logger.error)(f"{host.print_prefix}Router: {line}")
    return ok


def _look_now(router: str, workers: tuple[tuple[str, str], ...]) -> bool:
    """Whether the router, looked at now (the run's restarts and reboots before it done), lists
    a worker missing or unhealthy, or gives no list."""
    urls, _ = _expected(state, workers)
    if not urls:
        return False
    ok, out = remote.shell(host, StringCommand("python3", CHECK_SCRIPT, "--timeout", "0",
                                               "--router", router, *urls),
                           timeout=remote.POLL_TIMEOUT_S)
    seen = RouterWorkers().process(out.stdout_lines) if ok else {"error": "no look"}
    return bool(seen.get("error") or seen.get("missing") or seen.get("unhealthy"))


@operation()
def workers_registered(router: str, workers: tuple[tuple[str, str], ...], timeout: int,
                       restarted: bool):
    """The router lists every worker of ``workers`` (name, URL as its unit names it) as
    healthy, read from its own ``/workers``; a worker it does not list is registered again
    (router_workers.py ``--register``), and all are waited for (up to ``timeout`` seconds).
    Planned where the router (re)starts in this run or a look while planning found one missing
    or unhealthy; otherwise looked at again when the operation runs, after the run's restarts and
    reboots of servers (a worker rebooted for a driver, or the router host itself), and done
    then only where that look finds one missing or unhealthy (so a run that changes nothing
    reports no change). Workers whose host failed earlier in this run are left out.

    + router: the router's own URL on its host
    + workers: (host name, URL) of each worker
    + timeout: seconds
    + restarted: the router starts or restarts in this run
    """
    command = FunctionCommand(_workers_listed, (router, workers, timeout), {})
    urls = [url for _, url in workers]
    seen = host.get_fact(RouterWorkers, router=router, urls=urls)
    healthy = not seen.get("error") and not seen.get("missing") and not seen.get("unhealthy")
    if healthy and not restarted:
        if state.is_executing and _look_now(router, workers):
            yield command
            return
        host.noop(f"the router lists all {len(urls)} worker(s), healthy")
        return
    yield command


def _check_listen(settings: Settings) -> bool:
    """Refuse the router (and return False) where a port it or its gate would listen on
    (gpuhost_router_port, gpuhost_router_backend_port behind the gate, its metrics port) has
    a listener other than the router's own units on the host (sshd's 22, the server's...), or
    where gpuhost_router_host is not one of the host's addresses: checked while planning, as
    smg would only crash-loop on EADDRINUSE or EADDRNOTAVAIL."""
    ports = {f"{PREFIX}router_port": settings.router_port}
    if settings.router_is_public:
        ports[f"{PREFIX}router_backend_port"] = settings.router_backend_port
    ports["the router's metrics port"] = METRICS_PORT
    listeners = fact(PortListeners, ports=tuple(sorted(set(ports.values()))))
    ok = True
    for key, port in ports.items():
        others = [u for u in listeners.get(str(port), []) if u not in (UNIT, GATE_UNIT)]
        if others:
            refuse("Router", f"{key} = {port} is not allowed: a port no other unit listens on "
                             f"({', '.join(others)} listens on it)")
            ok = False
    problem = address_problem(f"{PREFIX}router_host", settings.router_host,
                              fact(HostAddresses), "the router binds it")
    if problem:
        refuse("Router", problem)
        ok = False
    return ok


def router(settings: Settings, workers: tuple[Worker, ...]) -> bool | None:
    """Converge the router on this host (one of the ``gpuhost_router`` group): its venv from
    ``gpuhost_router_lock``, its unit routing to ``workers``, the API key gate in front for a
    wider bind; restarted when the unit or the venv changed. Returns whether it starts or
    restarts in this run, for :func:`router_check` (None where refused). Raises LockError for a
    lock that does not parse. Refuses the stage (nothing of it planned) where the router's key
    file is not a root-only file of one line (operations/secret_files.py), as the server's."""
    lock = read_lock(settings.router_lock_path)
    if not _check_listen(settings):
        return None
    if settings.router_is_public and not check_secret_file(
            "Router", "router_api_key_file", settings.router_api_key_file or "", "key file"):
        return None
    venv = settings.router_venv_path
    top_folders()
    files.directory(name="Lock folder", path=LOCK_DIR, mode="755")
    files.directory(name="gpuhost library folder", path=LIB_DIR, mode="755")
    files.put(name=f"Router lock {lock.path.name}", src=StringIO(lock.requirements()),
              dest=f"{LOCK_DIR}/router.txt", mode="644", create_remote_dir=False)
    shipped = [files.put(name=f"Ship {script}", src=str(REPO_ROOT / "operations/files" / script),
                         dest=f"{LIB_DIR}/{script}", mode="644", create_remote_dir=False)
               for script in ("router_workers.py", "api_gate.py", "secret_file.py")]
    # venv_that_runs and locked_packages run through no_space.py, and python3 -m venv needs
    # Debian's and Ubuntu's python3-venv (ensurepip): on a serving host the ML venv stage ships
    # and installs them, a router host that serves no model has no such stage. apt's lists
    # are refreshed only where python3-venv is missing, as for rsync (operations/model_copy.py).
    files.put(name="Ship no_space.py for the router venv",
              src=str(REPO_ROOT / "operations/files/no_space.py"),
              dest=NO_SPACE, mode="644", create_remote_dir=False)
    installed = host.get_fact(DebPackages) or {}
    apt.packages(name="Python venv for the router", packages=["python3-venv"],
                 no_recommends=True, update="python3-venv" not in installed)
    venv_that_runs(name=f"Router venv {venv}", path=venv, python="python3")
    packages = locked_packages(
        name="Locked router", venv=venv, requirements=f"{LOCK_DIR}/router.txt",
        wanted=lock.versions(), index_url=settings.pip_index_url,
        remove_unlocked=[p.name for p in lock.pins])
    unit = files.template(name=f"Unit {UNIT}",
                          src=str(REPO_ROOT / "templates" / "sglang-router.service.j2"),
                          dest=UNIT_PATH, mode="644", **unit_context(settings, workers))
    changed = [unit, packages]
    if settings.router_is_public:
        gate = files.template(name=f"Unit {GATE_UNIT}",
                              src=str(REPO_ROOT / "templates" / "sglang-router-gate.service.j2"),
                              dest=GATE_UNIT_PATH, mode="644", **gate_context(settings))
        changed += [gate, *shipped[1:]]
    restart = any(op.will_change for op in changed)
    running = fact_running()
    systemd.service(name=f"Start {UNIT}", service=UNIT, running=True, enabled=True,
                    restarted=restart and running, daemon_reload=unit.will_change)
    if settings.router_is_public:
        systemd.service(name=f"Start {GATE_UNIT}", service=GATE_UNIT, running=True,
                        enabled=True, restarted=restart and running,
                        daemon_reload=changed[2].will_change)
    return restart or not running


def router_check(settings: Settings, workers: tuple[Worker, ...], restarted: bool) -> None:
    """The router's own worker list checked (:func:`workers_registered`), planned after every
    host's server stage (deploy.py), so that it runs after the run's restarts and reboots of
    the workers: on a router host that serves no model too, whose own operations pyinfra would
    otherwise run as early as its short sequence allows (pyinfra 3.x ``State.get_op_order``
    orders by each host's own sequence).

    + restarted: what :func:`router` returned: the router starts or restarts in this run
    """
    workers_registered(name=f"The router lists its {len(workers)} worker(s), healthy",
                       router=own_url(settings), workers=tuple((w.name, w.url) for w in workers),
                       timeout=settings.router_wait_timeout, restarted=restarted)


def fact_running() -> bool:
    """Whether the router's unit runs now (systemd's ActiveState)."""
    from pyinfra.facts.systemd import SystemdStatus

    return bool(fact(SystemdStatus, services=UNIT).get(UNIT))
