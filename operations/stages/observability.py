"""See the fleet while it serves: GPU metrics under DCGM exporter's names from the node exporter
on every GPU host, and Prometheus with gpuhost's alert rules on a router host, scraping every
server, the router and every node exporter.

What is measured where (docs/observability.md):

- each SGLang server: its own ``/metrics`` (``--enable-metrics``, operations/plans/sglang.py), on
the
  bind the router reaches it at (the router's worker URL, operations/stages/fleet.py), through the
  API key gate in front, which admits the router by the fleet key (``gpuhost_fleet_key_file``) and
  everyone else by the clients' key: Prometheus sends the fleet key as the router does
  (prometheus.yml's ``authorization: {type: Bearer, credentials_file: ...}``, Prometheus 2.42's
  scrape_config, read at each scrape), from its own copy on its host (:data:`PROMETHEUS_KEY`,
  root:prometheus 0640: the fleet key file is root's alone, and Prometheus runs as
  ``prometheus``);
- the router (smg 1.13.0): its metrics on 127.0.0.1:29000 of its host (operations/stages/router.py):
  no other host reaches the loopback, and on the host the loopback guard admits root's and the
  ``prometheus`` user's sockets only (operations/stages/loopback_guard.py);
- each GPU host: Debian's and Ubuntu's ``prometheus-node-exporter`` (1.5.0 in Debian 12), with
  its textfile collector reading what operations/files/gpu_metrics.py writes from nvidia-smi
  every ``gpuhost_gpu_metrics_interval`` seconds (a systemd timer), and its systemd collector
  the server's units (failed: the health gate refused a start). It listens on the host's
  ``gpuhost_fleet_address`` where the Prometheus host is another, else on the loopback, and
  answers only with its credential: HTTP basic auth from its own web configuration
  (``--web.config.file``, exporter-toolkit's ``basic_auth_users`` with a bcrypt hash, in the
  1.5.0 package; read again at each request), whose password is derived from the fleet key
  (operations/files/metrics_credentials.py), and which Prometheus sends from a file
  (``basic_auth: password_file:``, :data:`PROMETHEUS_PASSWORD`). Why that rather than the
  loopback and a gate in front: it is the exporter's own feature, one file and no process
  more, and the same on the loopback (where every local user reaches it) as on the fleet
  address. Hosts without a fleet key use a key made on the host (:data:`METRICS_KEY_FILE`);
- Prometheus (the ``prometheus`` package, 2.42 in Debian 12, 2.45 in Ubuntu 24.04): on the
  loopback of its host (``gpuhost_prometheus_port``; its UI through an SSH tunnel), its API and
  UI behind the metrics password too (``--web.config.file``, the same exporter-toolkit basic
  auth as the node exporters': the loopback is every local user's), data kept
  ``gpuhost_prometheus_retention_days`` days and at most ``gpuhost_prometheus_retention_gib``
  GiB (Prometheus' size units are powers of two: its ``--storage.tsdb.retention.size`` help).

The packages start their service at installation, with their defaults: the node exporter on
every interface (``:9100``, its ``--help``), Prometheus too (``0.0.0.0:9090``). So a unit is
masked before its package is installed and unmasked once its /etc/default file (a conffile of
the package, kept by later upgrades under --force-confold) names gpuhost's addresses.

Scrape targets are file_sd files (/etc/prometheus/gpuhost-targets/<job>.json) that Prometheus
rereads when they change: a fleet that changes needs no restart. Every target has a ``host``
label, the inventory's name; a server target also ``worker_url``, the URL its router uses
(the HostMissingFromRouter rule compares it with smg's ``smg_worker_health{worker=...}``).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from io import StringIO
from typing import Final
from urllib.parse import urlsplit

from pyinfra import host
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.files import Link
from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import apt, files, server, systemd

from operations import LIB_DIR, REPO_ROOT
from operations.runtime.run_exit import end_run
from operations.plans.gpu_verdict import FAILED_FILE, GPU_METRICS_FILE, RUNTIME_DIR, TEXTFILE_DIR
from operations.plans.lock import read_lock
from operations.plans.plan import fact
from operations.plans.settings import PREFIX, ROUTER_METRICS_PORT, Settings
from operations.plans.unit_sandbox import GPU_DEVICES, Sandbox
from operations.stages.fleet import Fleet
from operations.stages.loopback_guard import metrics_guard
from operations.stages.metrics_auth import credential
from operations.stages.router import key_made
from operations.stages.secret_template import secret_template
from operations.stages.tls import CA_PATH, needs_tls

NODE_EXPORTER: Final = "prometheus-node-exporter"
NODE_EXPORTER_DEFAULTS: Final = "/etc/default/prometheus-node-exporter"
#: Debian's build of the node exporter reads this folder by default (its --help).
#: The deploy's info series of the server (status.py's version).
SERVER_INFO_FILE: Final = f"{TEXTFILE_DIR}/gpuhost-server.prom"
GPU_METRICS_UNIT: Final = "gpuhost-gpu-metrics"
#: nvidia-smi's needs: the GPUs' devices, /proc/driver/nvidia, no network; dmesg's: the
#: kernel's ring buffer (the driver's Xid lines, operations/files/gpu_health.py); it writes the
#: textfile folder only.
GPU_METRICS_SANDBOX: Final = Sandbox(capabilities=("CAP_SYSLOG",), writable=(TEXTFILE_DIR,),
                                     devices=(*GPU_DEVICES, "/dev/kmsg r"), network=False,
                                     proc="all", kernel_log=True)
#: The units the node exporter's systemd collector reports (the server, its gate, the readings).
WATCHED_UNITS: Final = ("sglang", "sglang-gate", GPU_METRICS_UNIT)
PROMETHEUS: Final = "prometheus"
PROMETHEUS_DEFAULTS: Final = "/etc/default/prometheus"
PROMETHEUS_CONFIG: Final = "/etc/prometheus/prometheus.yml"
ALERTMANAGER: Final = "prometheus-alertmanager"
ALERTMANAGER_DEFAULTS: Final = "/etc/default/prometheus-alertmanager"
#: gpuhost's own file beside the package's alertmanager.yml (a conffile, left as shipped).
ALERTMANAGER_CONFIG: Final = "/etc/prometheus/gpuhost-alertmanager.yml"
RULES_DIR: Final = "/etc/prometheus/gpuhost-rules"
TARGETS_DIR: Final = "/etc/prometheus/gpuhost-targets"
JOBS: Final = ("sglang", "smg", "node")
#: The group that may read the metrics credentials: the node exporter and Prometheus run as
#: ``prometheus`` (the packages' units, ``User=prometheus``).
CREDENTIAL_GROUP: Final = "prometheus"
#: The user name the node exporters admit (basic auth).
NODE_EXPORTER_USER: Final = "prometheus"
#: The node exporter's web configuration (root:prometheus 0640).
NODE_EXPORTER_WEB_CONFIG: Final = "/etc/gpuhost/node-exporter-web.yml"
#: The key the metrics credentials come from where host data names no fleet key: made on the
#: host, root's alone (a host whose node exporter no other host scrapes).
METRICS_KEY_FILE: Final = "/etc/gpuhost/metrics.key"
#: Prometheus' copy of the fleet key, sent to the servers' gates, and the metrics password
#: (the node exporters' and Prometheus' own; root:prometheus 0640).
PROMETHEUS_KEY: Final = "/etc/prometheus/gpuhost-fleet.key"
PROMETHEUS_PASSWORD: Final = "/etc/prometheus/gpuhost-metrics.password"
#: Prometheus' own web configuration: its API and UI admit the metrics password only.
PROMETHEUS_WEB_CONFIG: Final = "/etc/prometheus/gpuhost-web.yml"


def metrics_key_file(settings: Settings) -> str:
    """The root-only key the host's metrics credentials are made from: the fleet key where
    host data names one, else :data:`METRICS_KEY_FILE`."""
    return settings.fleet_key_file or METRICS_KEY_FILE


def prometheus_hosts(fleet: Fleet, settings: Mapping[str, Settings]) -> tuple[str, ...]:
    """The router hosts that run a Prometheus: those with ``gpuhost_prometheus = True``, else
    the first whose ``gpuhost_prometheus`` is not False. Raises ValueError naming each host that
    asks for one outside the ``gpuhost_router`` group (only the router hosts' addresses are
    admitted by the workers' gates without the key)."""
    problems = [f"host {name}: {PREFIX}prometheus = True is not allowed outside the "
                "gpuhost_router group: the workers' API key gates admit the router hosts' "
                "addresses only; put it on a router host, or None"
                for name, s in settings.items() if s.prometheus and name not in fleet.routers]
    if problems:
        raise ValueError("\n".join(problems))
    chosen = tuple(r for r in fleet.routers if settings[r].prometheus)
    if chosen:
        return chosen
    return tuple(r for r in fleet.routers if settings[r].prometheus is None)[:1]


def node_listen(name: str, settings: Mapping[str, Settings], prometheus: tuple[str, ...]) -> str:
    """Where a GPU host's node exporter listens: its fleet address where a Prometheus on
    another host scrapes it, else its loopback."""
    s = settings[name]
    others = [p for p in prometheus if p != name]
    return s.fleet_address if others and s.fleet_address else "127.0.0.1"


def _hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _server_target(prom: str, name: str, url: str, s: Settings) -> str:
    """Where Prometheus on ``prom`` scrapes ``name``'s server: the router's URL for it, except
    for its own host's server behind a gate: the router reaches that one at the loopback port
    behind the gate, which the loopback guard keeps to root's sockets (operations/stages/fleet.py
    guarded_ports), so Prometheus (user ``prometheus``) goes through the gate, with the fleet
    key as every scrape of a server. A server on the loopback of Prometheus' own host has no
    gate; its port is root's too (and ``gpuhost_server_local_users``'): that target stays
    down, said in docs/observability.md."""
    if name != prom or not s.server_is_public:
        return urlsplit(url).netloc
    wildcard = ipaddress.ip_address(s.server_host).is_unspecified
    return _hostport("127.0.0.1" if wildcard else s.server_host, s.server_port)


def _server_scheme(prom: str, name: str, url: str, s: Settings) -> str:
    """The scheme Prometheus scrapes :func:`_server_target` with: https through a gate that
    serves TLS (operations/stages/tls.py; the certificate names the loopback too), as a target
    group's ``__scheme__`` label (Prometheus' configuration docs, <scrape_config>: a target's
    ``__scheme__`` label is the scheme it is scraped with)."""
    if name == prom and s.server_is_public:
        return "https" if needs_tls(s) else "http"
    return urlsplit(url).scheme


def scrape_targets(prom: str, fleet: Fleet, settings: Mapping[str, Settings],
                   prometheus: tuple[str, ...]) -> dict[str, list[dict]]:
    """file_sd target groups of the Prometheus on host ``prom``, by job: its router's workers
    at the router's URLs (``worker_url``), its own router's metrics on the loopback, and every
    GPU host's node exporter (those without a fleet address, other than ``prom``, are left
    out: nothing reaches them)."""
    servers = [{"targets": [_server_target(prom, w.name, w.url, settings[w.name])],
                "labels": {"host": w.name, "worker_url": w.url}}
               for w in fleet.workers_of(prom)]
    for group, w in zip(servers, fleet.workers_of(prom)):
        if _server_scheme(prom, w.name, w.url, settings[w.name]) == "https":
            group["labels"]["__scheme__"] = "https"  # http is the job's default
    router = [{"targets": [_hostport("127.0.0.1", ROUTER_METRICS_PORT)], "labels": {"host": prom}}]
    nodes = []
    for name, s in settings.items():
        if not s.serving or (name != prom and not s.fleet_address):
            continue
        listen = "127.0.0.1" if name == prom else node_listen(name, settings, prometheus)
        nodes.append({"targets": [_hostport(listen, s.node_exporter_port)],
                      "labels": {"host": name}})
    return {"sglang": servers, "smg": router, "node": nodes}


def _label(value: str) -> str:
    """A label value in Prometheus' text format: backslash, double quote and newline escaped
    (its exposition_formats.md)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def server_info(settings: Settings) -> str:
    """The textfile collector's file of the server's info series: value 1, labelled with the
    lock's sglang version and the served model name (status.py's version, as node_uname_info
    carries the kernel's)."""
    pin = read_lock(settings.lock_path).get("sglang")
    labels = {"served_model_name": settings.served_model_name,
              "sglang": pin.version if pin else "unknown"}
    listed = ",".join(f'{k}="{_label(v)}"' for k, v in sorted(labels.items()))
    return ("# HELP gpuhost_server_info The SGLang server gpuhost deployed here: the lock's "
            "sglang version and the served model name.\n"
            "# TYPE gpuhost_server_info gauge\n"
            f"gpuhost_server_info{{{listed}}} 1\n")


def node_exporter_args(listen: str, settings: Settings) -> str:
    """The node exporter's command line (its ARGS in /etc/default/prometheus-node-exporter):
    the units' start times too (status.py's uptime). ``[.]`` rather than ``\\.``: systemd's
    EnvironmentFile reads backslashes in quotes."""
    units = "|".join(WATCHED_UNITS)
    return (f"--web.listen-address={_hostport(listen, settings.node_exporter_port)} "
            f"--web.config.file={NODE_EXPORTER_WEB_CONFIG} "
            f"--collector.textfile.directory={TEXTFILE_DIR} "
            f"--collector.systemd --collector.systemd.unit-include=({units})[.]service "
            "--collector.systemd.enable-start-time-metrics")


def prometheus_args(settings: Settings) -> str:
    """Prometheus' command line (its ARGS in /etc/default/prometheus)."""
    return (f"--config.file={PROMETHEUS_CONFIG} "
            f"--web.listen-address=127.0.0.1:{settings.prometheus_port} "
            f"--web.config.file={PROMETHEUS_WEB_CONFIG} "
            f"--storage.tsdb.retention.time={settings.prometheus_retention_days}d "
            f"--storage.tsdb.retention.size={settings.prometheus_retention_gib}GB")


def alertmanager_args(settings: Settings) -> str:
    """Alertmanager's command line (its ARGS in /etc/default/prometheus-alertmanager): its
    API and UI on the loopback (the package's default is every interface, ``:9093``), and no
    cluster (``--cluster.listen-address`` empty: its default gossips on 0.0.0.0:9094;
    Alertmanager 0.25's --help)."""
    return (f"--config.file={ALERTMANAGER_CONFIG} "
            f"--web.listen-address=127.0.0.1:{settings.alertmanager_port} "
            "--cluster.listen-address=")


def thresholds_context(settings: Settings) -> dict:
    """What templates/gpuhost-thresholds.yml.j2 is rendered with."""
    return {"ttft_p99": float(settings.alert_ttft_p99), "itl_p99": float(settings.alert_itl_p99),
            "kv_cache_usage": float(settings.alert_kv_cache_usage)}


def prometheus_context(prom: str, settings: Settings) -> dict:
    """What templates/prometheus.yml.j2 is rendered with."""
    return {"host": prom, "port": settings.prometheus_port, "rules_dir": RULES_DIR,
            "targets_dir": TARGETS_DIR, "jobs": JOBS, "key_file": PROMETHEUS_KEY,
            "node_user": NODE_EXPORTER_USER, "password_file": PROMETHEUS_PASSWORD,
            "alertmanager": (f"127.0.0.1:{settings.alertmanager_port}"
                             if settings.alert_webhook_url else None),
            "ca_file": CA_PATH if settings.tls_ca_cert_file else None}


def _installed_quietly(package: str, unit: str, defaults: str, args: str):
    """``package`` installed with its service held (masked) until ``defaults`` (its
    /etc/default file) holds ``args``; returns that file's operation."""
    installed = fact(DebPackages) or {}
    unit_file = f"/etc/systemd/system/{unit}.service"
    masked = (fact(Link, path=unit_file) or {}).get("link_target") == "/dev/null"
    fresh = package not in installed
    if fresh and not masked:
        server.shell(name=f"Hold {unit} back until it is configured",
                     commands=[f"systemctl mask {unit}.service"])
    apt.packages(name=f"{package} (Debian's and Ubuntu's package)", packages=[package],
                 no_recommends=True, update=fresh)
    written = files.put(name=f"{defaults}: gpuhost's addresses",
                        src=StringIO("# Managed by gpuhost from host data; edit the inventory, "
                                     f"not this file.\nARGS=\"{args}\"\n"),
                        dest=defaults, mode="644")
    if fresh or masked:
        server.shell(name=f"Release {unit}", commands=[f"systemctl unmask {unit}.service"])
    return written


def _bcrypt(what: str) -> None:
    """The distribution's python3-bcrypt, which metrics_credentials.py hashes a web
    configuration's password with (a CPU-only router host has no other reason for it)."""
    installed = fact(DebPackages) or {}
    apt.packages(name=f"bcrypt for {what} (python3-bcrypt)", packages=["python3-bcrypt"],
                 no_recommends=True, update="python3-bcrypt" not in installed)


def _running(unit: str) -> bool:
    return bool(fact(SystemdStatus, services=f"{unit}.service").get(f"{unit}.service"))


def gpu_metrics_context(interval: int, gpu_count: int) -> dict:
    """What templates/gpuhost-gpu-metrics.{service,timer}.j2 are rendered with (``interval``:
    seconds between two readings; ``gpu_count``: the GPUs the host data expects)."""
    return {"lib_dir": LIB_DIR, "output": GPU_METRICS_FILE, "textfile_dir": TEXTFILE_DIR,
            "runtime_dir": RUNTIME_DIR, "failed_file": FAILED_FILE, "interval": interval,
            "gpu_count": gpu_count, "sandbox": GPU_METRICS_SANDBOX.text()}


def node_exporter(name: str, settings: Mapping[str, Settings],
                  prometheus: tuple[str, ...]) -> None:
    """The node exporter and the GPU readings on a GPU host."""
    s = settings[name]
    files.directory(name="gpuhost library folder", path=LIB_DIR, mode="755")
    shipped = [files.put(name=f"Ship {dest}", src=str(REPO_ROOT / src), dest=f"{LIB_DIR}/{dest}",
                         mode="644", create_remote_dir=False)
               for src, dest in (("operations/facts/telemetry.py", "telemetry.py"),
                                 ("operations/files/gpu_health.py", "gpu_health.py"),
                                 ("operations/files/gpu_metrics.py", "gpu_metrics.py"))]
    listen = node_listen(name, settings, prometheus)
    _bcrypt("the node exporter's credential")
    defaults = _installed_quietly(NODE_EXPORTER, NODE_EXPORTER, NODE_EXPORTER_DEFAULTS,
                                  node_exporter_args(listen, s))
    # after the package, which makes the prometheus user; read again at each request
    credential(name=f"The node exporter's credential {NODE_EXPORTER_WEB_CONFIG}",
               mode="web-config", key_file=metrics_key_file(s), dest=NODE_EXPORTER_WEB_CONFIG,
               group=CREDENTIAL_GROUP, user=NODE_EXPORTER_USER)
    context = gpu_metrics_context(s.gpu_metrics_interval, s.gpu_count)
    units = [files.template(name=f"Unit {GPU_METRICS_UNIT}.{kind}",
                            src=str(REPO_ROOT / "templates" / f"{GPU_METRICS_UNIT}.{kind}.j2"),
                            dest=f"/etc/systemd/system/{GPU_METRICS_UNIT}.{kind}", mode="644",
                            **context)
             for kind in ("service", "timer")]
    files.put(name=f"The server's info series {SERVER_INFO_FILE}", src=StringIO(server_info(s)),
              dest=SERVER_INFO_FILE, mode="644", create_remote_dir=False)
    running = _running(NODE_EXPORTER)
    systemd.service(name=f"Start {NODE_EXPORTER}", service=f"{NODE_EXPORTER}.service",
                    running=True, enabled=True, restarted=defaults.will_change and running)
    systemd.service(name=f"Start {GPU_METRICS_UNIT}.timer", service=f"{GPU_METRICS_UNIT}.timer",
                    running=True, enabled=True,
                    restarted=any(op.will_change for op in [*units, *shipped]),
                    daemon_reload=any(u.will_change for u in units))


def alertmanager(prom: str, s: Settings) -> None:
    """Debian's and Ubuntu's Alertmanager beside the Prometheus on ``prom``, where host data
    names a webhook (``gpuhost_alert_webhook_url``): every alert to it, firing and resolved
    (templates/gpuhost-alertmanager.yml.j2); its file root:prometheus 0640 and, under --diff,
    masked (a webhook URL may hold a token). Where none is named, an Alertmanager an earlier
    deploy set up is stopped and disabled (Prometheus no longer sends to it)."""
    if not s.alert_webhook_url:
        if ALERTMANAGER in (fact(DebPackages) or {}):
            systemd.service(name=f"Stop {ALERTMANAGER}: no gpuhost_alert_webhook_url",
                            service=f"{ALERTMANAGER}.service", running=False, enabled=False)
        return
    defaults = _installed_quietly(ALERTMANAGER, ALERTMANAGER, ALERTMANAGER_DEFAULTS,
                                  alertmanager_args(s))
    config = secret_template(name=f"{ALERTMANAGER_CONFIG}: the webhook",
                             src=str(REPO_ROOT / "templates" / "gpuhost-alertmanager.yml.j2"),
                             dest=ALERTMANAGER_CONFIG, mode="640", user="root",
                             group=CREDENTIAL_GROUP, host=prom, url=s.alert_webhook_url)
    running = _running(ALERTMANAGER)
    systemd.service(name=f"Start {ALERTMANAGER}", service=f"{ALERTMANAGER}.service",
                    running=True, enabled=True, restarted=defaults.will_change and running,
                    reloaded=running and not defaults.will_change and config.will_change)


def prometheus(prom: str, fleet: Fleet, settings: Mapping[str, Settings],
               prometheus_on: tuple[str, ...]) -> None:
    """Prometheus on router host ``prom``: its configuration, gpuhost's alert rules and the
    thresholds from host data, the targets; reloaded when the configuration or the rules
    change, restarted when its command line does."""
    s = settings[prom]
    defaults = _installed_quietly(PROMETHEUS, PROMETHEUS, PROMETHEUS_DEFAULTS,
                                  prometheus_args(s))
    for folder in (RULES_DIR, TARGETS_DIR):
        files.directory(name=f"{folder}", path=folder, mode="755")
    # read at each scrape: a new key needs no reload
    credential(name=f"Prometheus' copy of the fleet key {PROMETHEUS_KEY}", mode="copy",
               key_file=metrics_key_file(s), dest=PROMETHEUS_KEY, group=CREDENTIAL_GROUP)
    credential(name=f"The metrics password {PROMETHEUS_PASSWORD}", mode="password",
               key_file=metrics_key_file(s), dest=PROMETHEUS_PASSWORD, group=CREDENTIAL_GROUP)
    _bcrypt("Prometheus' own credential")
    credential(name=f"Prometheus' own credential {PROMETHEUS_WEB_CONFIG}", mode="web-config",
               key_file=metrics_key_file(s), dest=PROMETHEUS_WEB_CONFIG,
               group=CREDENTIAL_GROUP, user=NODE_EXPORTER_USER)
    config = files.template(name=f"{PROMETHEUS_CONFIG}: gpuhost's jobs",
                            src=str(REPO_ROOT / "templates" / "prometheus.yml.j2"),
                            dest=PROMETHEUS_CONFIG, mode="644", **prometheus_context(prom, s))
    rules = files.put(name="Alert rules", src=str(REPO_ROOT / "templates" / "gpuhost-alerts.yml"),
                      dest=f"{RULES_DIR}/gpuhost-alerts.yml", mode="644",
                      create_remote_dir=False)
    limits = files.template(name="Alert thresholds from host data",
                            src=str(REPO_ROOT / "templates" / "gpuhost-thresholds.yml.j2"),
                            dest=f"{RULES_DIR}/gpuhost-thresholds.yml", mode="644",
                            **thresholds_context(s))
    for job, groups in scrape_targets(prom, fleet, settings, prometheus_on).items():
        files.put(name=f"Scrape targets: {job}",
                  src=StringIO(json.dumps(groups, indent=2, sort_keys=True) + "\n"),
                  dest=f"{TARGETS_DIR}/{job}.json", mode="644", create_remote_dir=False)
    guarded = (ROUTER_METRICS_PORT, *((s.alertmanager_port,) if s.alert_webhook_url else ()))
    alertmanager(prom, s)
    metrics_guard(guarded, (PROMETHEUS,))  # the user the packages made
    running = _running(PROMETHEUS)
    systemd.service(name=f"Start {PROMETHEUS}", service=f"{PROMETHEUS}.service", running=True,
                    enabled=True, restarted=defaults.will_change and running,
                    reloaded=running and not defaults.will_change
                    and any(op.will_change for op in (config, rules, limits)))


def observability(settings: Mapping[str, Settings], fleet: Fleet) -> None:
    """This host's part: the node exporter where it serves a model, Prometheus where it is
    the Prometheus host. Ends the run (before any host is touched, at the first host's
    planning) where ``gpuhost_prometheus`` names a host outside the router group."""
    try:
        prometheus_on = prometheus_hosts(fleet, settings)
    except ValueError as exc:
        end_run("gpuhost: observability refused, no host was touched:\n  - "
                + str(exc).replace("\n", "\n  - "))
    s = settings[host.name]
    if s.serving or host.name in prometheus_on:
        files.directory(name="gpuhost settings folder", path="/etc/gpuhost", mode="755")
        if not s.fleet_key_file:
            key_made(name="The metrics key", path=METRICS_KEY_FILE, what="the metrics key")
    if s.serving:
        node_exporter(host.name, settings, prometheus_on)
    if host.name in prometheus_on:
        prometheus(host.name, fleet, settings, prometheus_on)
    elif host.name in fleet.routers:
        metrics_guard((ROUTER_METRICS_PORT,), ())
