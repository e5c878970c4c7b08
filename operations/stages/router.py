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

Three planes, each with its own credential (docs/security.md):

- clients: the client key (``gpuhost_router_api_key_file``, required). The API key gate
  (nginx, operations/stages/gate.py) listens on ``gpuhost_router_host:gpuhost_router_port``, the
  loopback included (a router on the loopback has its gate too): it
  admits the client key on the inference paths only (:data:`CLIENT_PATHS`; the control plane
  is not among them, whatever the key) and passes them to smg on
  127.0.0.1:``gpuhost_router_backend_port`` with the fleet key (:func:`api_key_file`; the
  router's own backend key, :data:`BACKEND_KEY_FILE`, where it has no fleet key), smg's
  ``--api-key``.
- the control plane (``/workers``: list, add, remove): smg's ``--control-plane-api-keys``, a
  key made on the router host (:data:`CONTROL_KEY_FILE`, root-only) that only the deploy's
  scripts there read; smg refuses the client and backend keys there (seen, 401).
- router to workers: the fleet key (``gpuhost_fleet_key_file``). smg 1.13.0 sends a worker the
  ``api_key`` it was added with on its own calls (health checks, loads, registration) but
  forwards a client's request with the ``Authorization`` the request came with (seen: a worker
  added with one key got the client's on ``/v1/chat/completions``); so each worker is added
  with the fleet key, and the gate hands smg the fleet key: every call a worker gets from the
  router carries it, and the workers' gates admit it (operations/stages/fleet.py). No
  ``--worker-urls``: membership changes at run time (``POST``/``DELETE /workers``), without a
  restart; the unit's ExecStartPost adds the last verified list (:data:`MEMBERS_FILE`) after
  each start.

Every key stays in its root-only file: operations/files/router_launch.py reads them and hands
them to smg inside its process (smg takes keys only as flags, which ps and the unit would show).

What the router calls on a worker (seen from a worker's side, smg 1.13.0): at registration
``GET /health`` (without the key), ``/v1/models``, ``/server_info``, ``/model_info``; then ``GET
/health`` every interval, ``/v1/loads`` and ``/metrics`` for its load monitor; requests are
forwarded as they came (``/v1/chat/completions`` ...), with the request's own Authorization.
"""

from __future__ import annotations

import json
import shlex
from io import StringIO
from typing import Final

from pyinfra import host, logger, state
from pyinfra.api import FactBase, FunctionCommand, StringCommand, operation
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.files import File
from pyinfra.operations import apt, files, systemd
from typing_extensions import override

from operations import REPO_ROOT
from operations.runtime import remote
from operations.facts.host import HostAddresses, address_problem
from operations.plans.lock import read_lock
from operations.plans.plan import fact, refuse
from operations.plans.settings import PREFIX, ROUTER_METRICS_PORT, Settings
from operations.plans.unit_sandbox import Sandbox
from operations.stages import gate, tls
from operations.stages.disk import NO_SPACE
from operations.stages.fleet import CONTROL_KEY_FILE, Worker
from operations.stages.folders import top_folders
from operations.stages.mlenv import LOCK_DIR
from operations.stages.p2p import LIB_DIR
from operations.stages.secret_files import check_secret_file
from operations.stages.server_state import PortListeners
from operations.stages.service_users import ROUTER_USER, service_user
from operations.stages.systemd_units import path_restarted, systemd_quote, unit_enabled
from operations.stages.venv_install import locked_packages, venv_that_runs

UNIT: Final = "sglang-router.service"
UNIT_PATH: Final = f"/etc/systemd/system/{UNIT}"
GATE_UNIT: Final = "sglang-router-gate.service"
GATE_UNIT_PATH: Final = f"/etc/systemd/system/{GATE_UNIT}"
#: The router's unit sandbox (operations/plans/unit_sandbox.py): no capability, no device, no
#: writable path, no home folder (its keys come as the unit's credentials, the fleet CA is
#: /etc/gpuhost/tls's); the network (its port, its workers, the host's interfaces:
#: AF_NETLINK); /proc whole (tokio and Python read the CPUs' count and memory there).
SANDBOX: Final = Sandbox(families=("AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"),
                         proc="all")
#: The router's Prometheus metrics, on the loopback (smg's default port, 29000).
METRICS_PORT: Final = ROUTER_METRICS_PORT
CHECK_SCRIPT: Final = f"{LIB_DIR}/router_workers.py"
KEY_DIR: Final = "/etc/gpuhost"
#: smg's ``--api-key`` behind the gate of a wider bind where the host has no fleet key: the gate
#: sends it, clients never see it (the client key can change without a restart of smg: the
#: gate reads its file again).
BACKEND_KEY_FILE: Final = f"{KEY_DIR}/router-backend.key"
#: The workers' URLs the last run verified (JSON list), added again after each start.
MEMBERS_FILE: Final = f"{KEY_DIR}/router-workers.json"
#: The roll's state (operations/files/roll_state.py): the workers a roll took out, kept
#: across runs; the worker check registers again one it drained and did not restart.
ROLL_STATE_FILE: Final = f"{KEY_DIR}/roll-state.json"
#: The paths the client key reaches through the gate: OpenAI's and SGLang's native generation
#: paths, the model list and health (smg 1.13.0 serves them; everything else, /workers first,
#: answers 404 at the gate).
CLIENT_PATHS: Final = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/generate",
                       "/health", "/health_generate", "/readiness", "/liveness")


def own_url(settings: Settings) -> str:
    """Where the router itself answers on its host: behind its gate, on the loopback."""
    return f"http://127.0.0.1:{settings.router_backend_port}"


def api_key_file(settings: Settings) -> str:
    """smg's ``--api-key``, what its gate hands it and what it forwards to workers with a
    request: the fleet key, or without one (no worker behind a gate elsewhere) the backend key
    made on the host."""
    return settings.fleet_key_file or BACKEND_KEY_FILE


def _ca_note(settings: Settings, ca: tls.FleetCA | None) -> str:
    """The unit's line naming each CA smg trusts (its SHA-256 fingerprint): a trust bundle's
    every CA during a rotation (operations/plans/ca_rotation.py), so that a change of the bundle
    restarts smg, which reads ``--ca-cert-paths`` at its start alone."""
    if ca is None or not settings.tls_ca_cert_file:
        return "No fleet CA: smg reaches its workers in plain HTTP"
    prints = ", ".join(tls.fingerprint(c.public_bytes(tls.serialization.Encoding.PEM).decode())
                       for c in ca.bundle)
    return (f"smg verifies its workers with the fleet CA{'s' if len(ca.bundle) > 1 else ''} "
            f"(SHA-256 {prints}), read at its start: a new CA restarts it")


def unit_context(settings: Settings, ca: tls.FleetCA | None = None) -> dict:
    """What templates/sglang-router.service.j2 is rendered with (``ca``: the fleet CA, whose
    fingerprint the unit names: smg reads ``--ca-cert-paths`` once, at its start, and went on
    refusing every worker with "UnknownIssuer" after the CA changed, until a restart)."""
    return {
        "ca_note": _ca_note(settings, ca),
        "listen": f"{settings.router_host}:{settings.router_port}",
        "gate_unit": GATE_UNIT,
        "venv": settings.router_venv_path,
        "lib_dir": LIB_DIR,
        "own_url": own_url(settings),
        # LoadCredential='s path: the rest of its line, as it is (settings allow no space)
        "api_key_path": api_key_file(settings),
        "service_user": ROUTER_USER,  # not "user": files.template's owner of the file
        "control_key_file": CONTROL_KEY_FILE,
        "worker_key_args": (f" --worker-key-file {systemd_quote(settings.fleet_key_file)}"
                            if settings.fleet_key_file else ""),
        "members_file": MEMBERS_FILE,
        "bind_host": "127.0.0.1",
        "bind_port": settings.router_backend_port,
        "policy": settings.router_policy,
        "health_check_interval_secs": settings.router_health_check_interval_secs,
        "health_check_timeout_secs": settings.router_health_check_timeout_secs,
        "health_failure_threshold": settings.router_health_failure_threshold,
        "health_success_threshold": settings.router_health_success_threshold,
        "metrics_port": METRICS_PORT,
        # its workers' TLS verified with the fleet CA alone (smg 1.13.0 ``--ca-cert-paths``:
        # seen refusing a worker whose certificate another CA signed, "UnknownIssuer")
        "ca_args": f" --ca-cert-paths {tls.CA_PATH}" if settings.tls_ca_cert_file else "",
        "sandbox": SANDBOX.text(),
    }


def router_gate(settings: Settings) -> gate.Gate:
    """The API key gate in front of the router (operations/stages/gate.py): the client key, the
    inference paths only, smg's ``--api-key`` sent on."""
    return gate.Gate(
        unit=GATE_UNIT, description="API key gate in front of the SGLang model gateway",
        part_of=UNIT, runtime_dir="gpuhost-sglang-router-gate", listen_host=settings.router_host,
        listen_port=settings.router_port, backend_url=own_url(settings),
        key_files=(settings.router_api_key_file or "",),
        backend_key_file=api_key_file(settings), allow_paths=CLIENT_PATHS,
        **tls.gate_files(settings, settings.router_is_public))


def gate_context(settings: Settings) -> dict:
    """What templates/gate.service.j2 is rendered with for the router's gate."""
    return gate.unit_context(router_gate(settings), None, systemd_quote)


class RouterWorkers(FactBase[dict]):
    """The router's own worker list against the expected URLs (operations/files/
    router_workers.py, one look), where the router runs:

    .. code:: python

        {"listed": {"http://10.0.0.5:8000": True}, "missing": [], "unhealthy": [],
         "others": [], "error": ""}
    """

    @override
    def requires_command(self, router: str, urls: tuple[str, ...]) -> str:
        return "python3"

    @override
    def command(self, router: str, urls: tuple[str, ...]) -> str:
        args = " ".join(shlex.quote(u) for u in urls)
        return (f"if [ -f {CHECK_SCRIPT} ] && [ -f {CONTROL_KEY_FILE} ]; then python3 "
                f"{CHECK_SCRIPT} --timeout 0 --control-key-file {CONTROL_KEY_FILE} --router "
                f"{shlex.quote(router)} {args}; else echo '{{\"error\": \"not installed\"}}'; fi")

    @override
    def process(self, output: list[str]) -> dict:
        try:
            return json.loads("\n".join(output))
        except ValueError:
            return {"error": f"cannot read {output[:2]!r}"}


def _expected(state, workers: tuple[tuple[str, str], ...]) -> tuple[list[str], list[str],
                                                                    list[str]]:
    """(URLs to check, names left out, their URLs): a worker whose host failed in this run (a
    failed roll, a refused host) is left out and its entry kept as it is, neither added nor
    removed: the run could not verify it."""
    failed = {h.name for h in state.failed_hosts}
    return ([url for name, url in workers if name not in failed],
            [name for name, _ in workers if name in failed],
            [url for name, url in workers if name in failed])


def _check_args(router: str, worker_key_file: str | None) -> list[str]:
    return ["--router", router, "--control-key-file", CONTROL_KEY_FILE,
            *(["--worker-key-file", worker_key_file] if worker_key_file else [])]


@remote.callback("the router's worker check")
def _workers_listed(state, host, router: str, workers: tuple[tuple[str, str], ...],
                    timeout: int, worker_key_file: str | None) -> bool:
    urls, left, kept = _expected(state, workers)
    if left:
        logger.warning(f"{host.print_prefix}Router: not waiting for {', '.join(left)}, which "
                       "failed in this run: not added nor removed, but registered again where "
                       "the roll drained it and did not touch its server (the roll state)")
    if not urls:
        return True  # nothing this run verified: the list stays as it is
    keep = [a for url in kept for a in ("--keep", url)]
    names = [a for name, url in workers for a in ("--name", f"{name}={url}")]
    ok, out = remote.shell(host, StringCommand("python3", CHECK_SCRIPT,
                                               *_check_args(router, worker_key_file),
                                               "--timeout", str(timeout), "--register",
                                               "--remove-others", "--save", MEMBERS_FILE,
                                               "--roll-state", ROLL_STATE_FILE,
                                               *names, *keep, *urls),
                           timeout=timeout + 60)
    for line in out.stdout_lines + out.stderr_lines:
        (logger.info if ok else logger.error)(f"{host.print_prefix}Router: {line}")
    return ok


def _look_now(router: str, workers: tuple[tuple[str, str], ...]) -> bool:
    """Whether the router, looked at now (the run's restarts and reboots before it done), lists
    a worker missing or unhealthy, one gpuhost did not configure, or gives no list."""
    urls, _, kept = _expected(state, workers)
    if not urls:
        return True  # nothing this run verified: the list stays as it is
    keep = [a for url in kept for a in ("--keep", url)]
    ok, out = remote.shell(host, StringCommand("python3", CHECK_SCRIPT, *_check_args(router, None),
                                               "--timeout", "0", *keep, *urls),
                           timeout=remote.POLL_TIMEOUT_S)
    seen = RouterWorkers().process(out.stdout_lines) if ok else {"error": "no look"}
    return bool(seen.get("error") or seen.get("missing") or seen.get("unhealthy")
                or seen.get("others"))


@operation()
def workers_registered(router: str, workers: tuple[tuple[str, str], ...], timeout: int,
                       restarted: bool, worker_key_file: str | None = None):
    """The router lists every worker of ``workers`` (name, URL) as healthy and no other, read
    from its own ``/workers`` with the control-plane key; a worker it does not list is added
    (router_workers.py ``--register``, with the fleet key as the key the router sends it), one
    it lists that gpuhost did not configure is removed, and said (``--remove-others``); all are
    waited for (up to ``timeout`` seconds). Planned where the router (re)starts in this run or
    a look while planning found one missing, unhealthy or foreign; otherwise looked at again
    when the operation runs, after the run's restarts and reboots of servers (a worker rebooted
    for a driver, or the router host itself), and done then only where that look finds a
    difference (so a run that changes nothing reports no change). Workers whose host failed
    earlier in this run keep their entries as they are.

    + router: the router's own URL on its host
    + workers: (host name, URL) of each worker
    + timeout: seconds
    + restarted: the router starts or restarts in this run
    + worker_key_file: the fleet key's file on the router host (the key sent to workers)
    """
    command = FunctionCommand(_workers_listed, (router, workers, timeout, worker_key_file), {})
    urls = [url for _, url in workers]
    seen = host.get_fact(RouterWorkers, router=router, urls=urls)
    healthy = not seen.get("error") and not seen.get("missing") and not seen.get("unhealthy")
    if healthy and not seen.get("others") and not restarted:
        if state.is_executing and _look_now(router, workers):
            yield command
            return
        host.noop(f"the router lists {len(seen.get('listed', {}))} worker(s), each healthy "
                  "and configured")
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


@operation()
def key_made(path: str, what: str):
    """A root-only file at ``path`` holding a new random key (32 bytes of Python's
    ``secrets.token_urlsafe``), made on the host where missing: the key never leaves it.

    + path: absolute path
    + what: for messages
    """
    info = host.get_fact(File, path=path)
    if info:
        host.noop(f"{what} exists")
        return
    tmp = f"{path}.new"
    yield StringCommand(
        "sh", "-c", f"umask 077 && python3 -c 'import secrets; print(secrets.token_urlsafe(32))' "
        f"> {shlex.quote(tmp)} && chown root:root {shlex.quote(tmp)} && chmod 600 "
        f"{shlex.quote(tmp)} && mv {shlex.quote(tmp)} {shlex.quote(path)}")


def router(settings: Settings, workers: tuple[Worker, ...],
           ca: tls.FleetCA | None = None) -> bool | None:
    """Converge the router on this host (one of the ``gpuhost_router`` group): its venv from
    ``gpuhost_router_lock``, its unit (keys read by router_launch.py, no worker on its command
    line), the API key gate in front (the client key, the inference paths only); restarted when
    the unit (the fleet CA ``ca`` included), the venv or a key it holds changed (the gate alone
    for its own changes); its worker list is kept by :func:`router_check`, without a restart.
    Returns whether it starts or restarts in this run, for :func:`router_check` (None where
    refused). Raises LockError for a lock that does not parse. Refuses the stage (nothing of it
    planned) where the client key file or the fleet key file is not a root-only file of one
    line (operations/stages/secret_files.py), as the server's."""
    lock = read_lock(settings.router_lock_path)
    if not _check_listen(settings):
        return None
    if not check_secret_file("Router", "router_api_key_file",
                             settings.router_api_key_file or "", "key file"):
        return None
    if settings.fleet_key_file and not check_secret_file(
            "Router", "fleet_key_file", settings.fleet_key_file, "key file"):
        return None
    venv = settings.router_venv_path
    top_folders()
    files.directory(name="Lock folder", path=LOCK_DIR, mode="755")
    files.directory(name="gpuhost library folder", path=LIB_DIR, mode="755")
    files.directory(name="gpuhost settings folder", path=KEY_DIR, mode="755")
    keys = [key_made(name="The router's control-plane key", path=CONTROL_KEY_FILE,
                     what="the control-plane key")]
    if not settings.fleet_key_file:
        keys.append(key_made(name="The router's backend key", path=BACKEND_KEY_FILE,
                             what="the backend key"))
    files.put(name=f"Router lock {lock.path.name}", src=StringIO(lock.requirements()),
              dest=f"{LOCK_DIR}/router.txt", mode="644", create_remote_dir=False)
    shipped = [files.put(name=f"Ship {script}", src=str(REPO_ROOT / "operations/files" / script),
                         dest=f"{LIB_DIR}/{script}", mode="644", create_remote_dir=False)
               for script in ("router_workers.py", "gate_keys.py", "secret_file.py",
                              "router_launch.py", "roll_state.py")]
    # venv_that_runs and locked_packages run through no_space.py, and python3 -m venv needs
    # Debian's and Ubuntu's python3-venv (ensurepip): on a serving host the ML venv stage ships
    # and installs them, a router host that serves no model has no such stage. apt's lists
    # are refreshed only where python3-venv is missing, as for rsync
    # (operations/stages/model_copy.py).
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
    service_user(name=f"User {ROUTER_USER}", user=ROUTER_USER)
    unit = files.template(name=f"Unit {UNIT}",
                          src=str(REPO_ROOT / "templates" / "sglang-router.service.j2"),
                          dest=UNIT_PATH, mode="644", **unit_context(settings, ca))
    changed = [unit, packages, *keys, shipped[3]]
    front = router_gate(settings)
    gate.nginx_installed(name="nginx (the API key gate)")
    gate_unit = files.template(name=f"Unit {GATE_UNIT}",
                               src=str(REPO_ROOT / "templates" / "gate.service.j2"),
                               dest=GATE_UNIT_PATH, mode="644", **gate_context(settings))
    conf, path_unit, keys_unit = gate.gate_files(front)
    restart = any(op.will_change for op in changed)
    running = fact_running()
    systemd.service(name=f"Start {UNIT}", service=UNIT, running=True, enabled=True,
                    restarted=restart and running, daemon_reload=unit.will_change)
    # the gate alone restarts for its own changes (the router keeps serving behind it), and
    # reloads gracefully for a change of its configuration alone
    gate_running = fact_running(GATE_UNIT)
    gate_restart = any(op.will_change for op in (gate_unit, *shipped[1:3]))
    systemd.service(name=f"Start {GATE_UNIT}", service=GATE_UNIT, running=True,
                    enabled=True, restarted=gate_restart and gate_running,
                    reloaded=conf.will_change and gate_running and not gate_restart,
                    daemon_reload=any(op.will_change for op in (gate_unit, path_unit,
                                                                keys_unit)))
    unit_enabled(name=f"Enable {front.path_unit}", unit=front.path_unit)
    path_restarted(name=f"Watch the key files ({front.path_unit})", unit=front.path_unit,
                   changed=path_unit.will_change)
    return restart or not running


def router_check(settings: Settings, workers: tuple[Worker, ...], restarted: bool) -> None:
    """The router's own worker list checked and kept (:func:`workers_registered`), planned after
    every host's server stage (deploy.py), so that it runs after the run's restarts and reboots
    of the workers: on a router host that serves no model too, whose own operations pyinfra
    would otherwise run as early as its short sequence allows (pyinfra 3.x
    ``State.get_op_order`` orders by each host's own sequence). The list it verified is kept for
    the router's next start (:data:`MEMBERS_FILE`, the unit's ExecStartPost adds it): a host
    failed or refused in this run keeps its entry there as in the router.

    + restarted: what :func:`router` returned: the router starts or restarts in this run
    """
    workers_registered(
        name=f"The router lists its {len(workers)} worker(s), healthy, and no other",
        router=own_url(settings), workers=tuple((w.name, w.url) for w in workers),
        timeout=settings.router_wait_timeout, restarted=restarted,
        worker_key_file=settings.fleet_key_file)


def fact_running(unit: str = UNIT) -> bool:
    """Whether ``unit`` runs now (systemd's ActiveState)."""
    from pyinfra.facts.systemd import SystemdStatus

    return bool(fact(SystemdStatus, services=unit).get(unit))
