"""The API gates in front of the server and the router: nginx from the distribution's archive
(Debian 12: 1.22, Ubuntu 24.04: 1.24), run by gpuhost's own units (sglang-gate.service,
sglang-router-gate.service) with a configuration of their own under CONF_DIR, the keys in a
root-only include written on the host from the key files (operations/files/gate_keys.py).

Why its own units and not Debian's nginx.service: a gate is part of what it guards (PartOf= the
server or the router: it stops and starts with it, its start is verified with it by the health
gate, operations/stages/server.py), and Debian's unit would serve its default site on port 80 of
every address. Debian's nginx.service is masked where gpuhost installs the package (while
installing: a runtime mask, which the package's postinst, ``deb-systemd-helper unmask``, leaves
alone, and invoke-rc.d does not start a masked unit).

Each gate (templates/gate-nginx.conf.j2):

- passes a request with ``Authorization: Bearer <key>`` for a key of its key files, refuses
  the rest with 401 from the head alone (in the server's rewrite phase, before the body is
  read or its size looked at); ``/health`` passes without a key (:data:`OPEN_PATHS`, limited
  per client address); with an allow-list (the router's), any other path is 404 whatever the
  key;
- refuses a query string with 400 before anything else (a key goes in the Authorization
  header only), but the router's own load query, passed without it (:data:`ROUTER_QUERIES`);
- speaks TLS as Mozilla's intermediate configuration (:data:`TLS_CIPHERS`);
- sends the server no client key: the backend key where it has one (the router's: smg's
  ``--api-key``), else no Authorization at all;
- bounds each client address (limit_conn, limit_req), the head and body timeouts, the body
  size; logs one line per request to the unit's journal, the path without its query string;
- reloads gracefully (``systemctl reload <unit>``: the keys written again, the configuration
  tested, then SIGHUP: nginx's new workers take over, the old finish their requests) when a key
  file changes (a path unit watches them) or a converge changed its configuration.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Final

from pyinfra import host
from pyinfra.api import operation
from pyinfra.api.operation import OperationMeta
from pyinfra.facts.deb import DebPackages
from pyinfra.operations import apt, files

from operations import REPO_ROOT
from operations.plans.unit_sandbox import SYSTEMCTL, Sandbox
from operations.stages.p2p import LIB_DIR
from operations.stages.service_users import GATE_USER
from operations.stages.systemd_units import systemd_quote

NGINX: Final = "/usr/sbin/nginx"
#: The gates' nginx configurations and their keys' includes.
CONF_DIR: Final = "/etc/gpuhost/nginx"
#: The distribution's package (Debian 12's and Ubuntu 24.04's nginx: the server itself).
PACKAGE: Final = "nginx"
#: The distribution's own unit, masked where gpuhost installs the package.
DISTRIBUTION_UNIT: Final = "nginx.service"
#: The paths every gate passes without a key: ``/health`` alone. smg 1.13.0 probes a worker it
#: registers once without the key before it sends its worker key (router_workers.py), and a
#: load balancer in front of the router asks it keyless. ``/health_generate`` needs the key:
#: nothing of the fleet calls it keyless (smg health-checks ``--health-check-endpoint``,
#: /health, with the worker's key as ``bearer_auth``: model_gateway/src/worker/worker.rs
#: http_health_check; its own /health_generate is a proxy_get_request to one worker with the
#: request's headers, which the router's gate sets to the fleet key: routers/http/router.rs;
#: the 1.13.0 wheel's smg_rs.abi3.so holds both), and it makes a GPU generate.
OPEN_PATHS: Final = ("/health",)
#: sglang 0.5.9's /health is its /health_generate too (entrypoints/http_server.py: one handler
#: for both, one token generated when the server is idle, unless
#: SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION, default true, environ.py): the open path is
#: limited per client address where it comes without a key, HEALTH_RATE a second with a burst
#: of HEALTH_BURST (smg's one keyless probe per registration, a load balancer's check every
#: few seconds); beyond, 429. Requests with the key are not counted (smg's checks every
#: gpuhost_router_health_check_interval_secs).
HEALTH_RATE: Final = 1
HEALTH_BURST: Final = 5
#: The request lines with a query string a gate passes, byte for byte, without their query
#: string (every other query string is refused with 400 before it reaches the server, whose
#: access log would keep it: sglang's uvicorn logs the whole request line): smg 1.13.0's load
#: monitor's call to each worker (the wheel's smg_rs.abi3.so holds
#: ``/v1/loads?include=core,disagg,queues,memory``, as model_gateway/src/worker/monitor.rs
#: formats it). sglang 0.5.9's /v1/loads without ``include`` answers every section, those
#: four among them (entrypoints/v1_loads.py: "Default: all").
ROUTER_QUERIES: Final = ("/v1/loads?include=core,disagg,queues,memory",)
#: Seconds for a whole request head (and an idle kept-alive connection): the lower bound of
#: Apache mod_reqtimeout's default (header=20-40,MinRate=500), what the home-made gate had.
HEAD_TIMEOUT: Final = 20
#: Seconds between two reads of a body or two writes of an answer: nginx's own default
#: (client_body_timeout, send_timeout).
IO_TIMEOUT: Final = 60
#: A request body at most: room for a long-context chat request (a 200k-token prompt is a few
#: MiB of JSON) many times over.
MAX_BODY: Final = "32m"
#: Requests in flight from one client address: half of what one worker process serves, so that
#: one client leaves room for everyone else, and the router, one address with a connection per
#: request in flight, still has room for a server's gpuhost_max_running_requests (64 by default)
#: and more.
PER_ADDRESS_CONNECTIONS: Final = 128
#: Requests a second from one client address, and the burst beyond it served at once
#: (limit_req ``nodelay``); more answer 429.
RATE: Final = 200
BURST: Final = 400
#: Seconds the server may take between two reads or writes (a long prefill before the first
#: byte of an answer).
BACKEND_TIMEOUT: Final = 600
#: TLS as Mozilla's intermediate configuration, guideline 5.7
#: (https://ssl-config.mozilla.org/guidelines/5.7.json, ``configurations.intermediate``: the
#: same file sslyze 6.3 grades with, sslyze/mozilla_tls_profile/5.7.json), as its generator
#: (mozilla/ssl-config-generator 858f8f7, src/js/helpers/nginx.js) writes it for Debian 12's
#: nginx 1.22.1 and OpenSSL 3.0: ``ssl_protocols`` its tls_versions, ``ssl_ecdh_curve`` its
#: tls_curves (the TLS 1.3 groups too), ``ssl_ciphers`` its ``ciphers.openssl`` (TLS 1.2; the
#: TLS 1.3 suites are OpenSSL's default, its ciphersuites), ``ssl_prefer_server_ciphers off``
#: (server_preferred_order false), ``ssl_session_tickets off`` (below nginx 1.23.2, which
#: rotates the ticket keys of a shared session cache: the generator's commit a172281),
#: ``ssl_session_timeout 1d``. The generator's ``ssl_dhparam`` (ffdhe2048)
#: is not given: without it nginx 1.22 uses no DHE suite (nginx.org ngx_http_ssl_module,
#: ssl_dhparam), and the three DHE-RSA suites could serve an RSA certificate alone, where
#: the fleet's are ECDSA (operations/stages/tls.py).
TLS_PROTOCOLS: Final = "TLSv1.2 TLSv1.3"
TLS_CURVES: Final = "X25519:prime256v1:secp384r1"
TLS_CIPHERS: Final = ("ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:"
                      "ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384:"
                      "ECDHE-ECDSA-CHACHA20-POLY1305:ECDHE-RSA-CHACHA20-POLY1305:"
                      "DHE-RSA-AES128-GCM-SHA256:DHE-RSA-AES256-GCM-SHA384:"
                      "DHE-RSA-CHACHA20-POLY1305")
WORKER_PROCESSES: Final = 2
WORKER_CONNECTIONS: Final = 4096
#: The gate's unit sandbox (operations/plans/unit_sandbox.py). The master starts its workers as
#: GATE_USER: setuid and setgid (initgroups), chown of their temporary folders (nginx's
#: ngx_create_paths); it tells them to reload or stop through their channel (a socketpair,
#: no signal: no CAP_KILL); it writes the keys' include (gate_keys.py) in CONF_DIR, reads the
#: key files and the certificate where the operator put them, and the workers setrlimit their
#: open files (worker_rlimit_nofile: @resources).
SANDBOX: Final = Sandbox(capabilities=("CAP_SETUID", "CAP_SETGID", "CAP_CHOWN"),
                         families=("AF_INET", "AF_INET6", "AF_UNIX"), writable=(CONF_DIR,),
                         home="read-only", privileged=True)


@dataclass(frozen=True)
class Gate:
    """One gate: its unit, where it listens, what it guards, with which keys."""

    unit: str
    description: str
    part_of: str
    runtime_dir: str
    listen_host: str
    listen_port: int
    backend_url: str
    key_files: tuple[str, ...]
    backend_key_file: str | None = None
    allow_paths: tuple[str, ...] = ()
    #: request lines with a query string passed without it (:data:`ROUTER_QUERIES`)
    allowed_queries: tuple[str, ...] = ()
    trusted_peers: tuple[str, ...] = ()
    #: The host's certificate and its key (operations/stages/tls.py gate_files) where the gate
    #: serves TLS: one file, or two given in host data
    tls_cert: str | None = None
    tls_key: str | None = None
    #: A file that exists while the host's GPUs failed (operations/plans/gpu_verdict.py): the
    #: worker's gate answers the open path (/health, the router's health check) 503 meanwhile
    failed_file: str | None = None

    @property
    def name(self) -> str:
        return self.unit.removesuffix(".service")

    @property
    def conf_path(self) -> str:
        return f"{CONF_DIR}/{self.name}.conf"

    @property
    def keys_path(self) -> str:
        return f"{CONF_DIR}/{self.name}.keys"

    @property
    def temp_dir(self) -> str:
        """nginx's temporary files: the unit's CacheDirectory= (systemd.exec(5): under
        /var/cache), named as its runtime folder."""
        return f"/var/cache/{self.runtime_dir}"

    @property
    def keys_unit(self) -> str:
        """The oneshot that reloads the gate, started by :attr:`path_unit`."""
        return f"{self.name}-keys.service"

    @property
    def path_unit(self) -> str:
        """The path unit watching the key files (systemd.path(5) PathChanged=)."""
        return f"{self.name}-keys.path"

    @property
    def listen(self) -> str:
        return (f"[{self.listen_host}]:{self.listen_port}" if ":" in self.listen_host
                else f"{self.listen_host}:{self.listen_port}")


def path_pattern(path: str) -> str:
    """A map source matching a request's ``$request_uri`` whose path is ``path`` exactly (with
    or without a query string): every character other than a letter, a digit or ``/`` as a PCRE
    ``\\xHH`` escape."""
    literal = "".join(c if c.isascii() and (c.isalnum() or c == "/") else f"\\x{ord(c):02x}"
                      for c in path)
    return f"~^{literal}(\\?|$)"


def conf_context(gate: Gate) -> dict:
    """What templates/gate-nginx.conf.j2 is rendered with."""
    for peer in gate.trusted_peers:
        ipaddress.ip_address(peer)  # validated in settings; never a word nginx would misread
    for path in gate.allow_paths:
        if not re.fullmatch(r"/[A-Za-z0-9_/.-]*", path):
            raise ValueError(f"not a plain path: {path!r}")
    for line in gate.allowed_queries:
        if not re.fullmatch(r"/[A-Za-z0-9_/.-]*\?[A-Za-z0-9_.,=&-]+", line):
            raise ValueError(f"not a plain path and query: {line!r}")
    if gate.failed_file and not re.fullmatch(r"/[A-Za-z0-9_/.-]+", gate.failed_file):
        raise ValueError(f"not a plain path: {gate.failed_file!r}")
    return {
        "description": gate.description,
        "unit": gate.unit,
        "worker_processes": WORKER_PROCESSES,
        "worker_connections": WORKER_CONNECTIONS,
        "rlimit_nofile": 4 * WORKER_CONNECTIONS,
        "pid_file": f"/run/{gate.runtime_dir}/nginx.pid",
        "worker_user": GATE_USER,
        "temp_dir": gate.temp_dir,
        "log_tag": gate.name.replace("-", "_"),
        "head_timeout": HEAD_TIMEOUT,
        "io_timeout": IO_TIMEOUT,
        "max_body": MAX_BODY,
        "per_address_connections": PER_ADDRESS_CONNECTIONS,
        "rate": RATE,
        "burst": BURST,
        "health_rate": HEALTH_RATE,
        "health_burst": HEALTH_BURST,
        "allowed_queries": list(gate.allowed_queries),
        "open_patterns": [path_pattern(p) for p in OPEN_PATHS],
        "allow_patterns": [path_pattern(p) for p in gate.allow_paths],
        "trusted_peers": list(gate.trusted_peers),
        "keys_file": gate.keys_path,
        "listen": gate.listen,
        "dual_stack": gate.listen_host == "::",
        "backend_url": gate.backend_url,
        "backend_timeout": BACKEND_TIMEOUT,
        "tls_cert": gate.tls_cert,
        "tls_key": gate.tls_key,
        "failed_file": gate.failed_file,
        "tls_protocols": TLS_PROTOCOLS,
        "tls_curves": TLS_CURVES,
        "tls_ciphers": TLS_CIPHERS,
    }


def keys_args(gate: Gate) -> list[str]:
    """gate_keys.py's arguments."""
    args = ["--out", gate.keys_path]
    for path in gate.key_files:
        args += ["--key-file", path]
    if gate.backend_key_file:
        args += ["--backend-key-file", gate.backend_key_file]
    return args


def unit_context(gate: Gate, inputs: list[str] | None, quote) -> dict:
    """What templates/gate.service.j2 is rendered with; ``inputs``: unit_inputs.py's
    arguments (what its start read, recorded under /run), or None; ``quote``: systemd's
    argument quoting (operations/stages/systemd_units.py systemd_quote)."""
    return {
        "description": gate.description,
        "listen": gate.listen,
        "backend_url": gate.backend_url,
        "part_of": gate.part_of,
        "runtime_dir": gate.runtime_dir,
        "lib_dir": LIB_DIR,
        "inputs_args": " ".join(quote(a) for a in inputs) if inputs else "",
        "keys_args": " ".join(quote(a) for a in keys_args(gate)),
        "nginx": NGINX,
        "conf": gate.conf_path,
        # nginx's master and workers: a few tasks; memory: some MiB and a few KiB per connection
        "memory_max": "256M",
        "tasks_max": 272,
        "nofile": 4 * WORKER_CONNECTIONS,
        "worker_user": GATE_USER,
        "cache_dir": gate.runtime_dir,
        "sandbox": SANDBOX.text(),
    }


def path_context(gate: Gate, quote) -> dict:
    """What templates/gate-keys.path.j2 and gate-keys.service.j2 are rendered with."""
    return {
        "gate_unit": gate.unit,
        "keys_unit": gate.keys_unit,
        # the keys, and the certificate and its key (a reload reads them again)
        "key_files": [quote(p) for p in dict.fromkeys(filter(None, (
            *gate.key_files, gate.backend_key_file, gate.tls_cert, gate.tls_key)))],
        "sandbox": SYSTEMCTL.text(),
    }


def gate_inputs(gate: Gate) -> list[str]:
    """What a gate reads at start (its key files aside: no digest of a secret)."""
    return [f"/etc/systemd/system/{gate.unit}", gate.conf_path, f"{LIB_DIR}/gate_keys.py",
            f"{LIB_DIR}/secret_file.py"]


@operation()
def nginx_installed():
    """The distribution's nginx installed, its own nginx.service masked (gpuhost's gates run
    the binary under their own units; Debian's would serve its default site on port 80): masked
    for the time of the install at run time too, so that the package's postinst does not start
    it (invoke-rc.d leaves a masked unit alone; the postinst unmasks only /etc's mask)."""
    installed = host.get_fact(DebPackages) or {}
    if PACKAGE in installed:
        host.noop(f"{PACKAGE} is installed")
        return
    yield f"systemctl mask --runtime {DISTRIBUTION_UNIT}"
    yield from apt.packages._inner(packages=[PACKAGE], no_recommends=True, update=True)
    yield f"systemctl mask {DISTRIBUTION_UNIT}"
    yield f"systemctl unmask --runtime {DISTRIBUTION_UNIT}"


def gate_files(g: Gate) -> list[OperationMeta]:
    """A gate's nginx configuration, its key files' path unit and the oneshot that reloads
    it (templates/gate-nginx.conf.j2, gate-keys.path.j2, gate-keys.service.j2): the
    configuration first, then the units."""
    paths = path_context(g, systemd_quote)
    return [
        files.template(name=f"nginx configuration of {g.unit}",
                       src=str(REPO_ROOT / "templates" / "gate-nginx.conf.j2"),
                       dest=g.conf_path, mode="644", create_remote_dir=True,
                       **conf_context(g)),
        files.template(name=f"Unit {g.path_unit}",
                       src=str(REPO_ROOT / "templates" / "gate-keys.path.j2"),
                       dest=f"/etc/systemd/system/{g.path_unit}", mode="644", **paths),
        files.template(name=f"Unit {g.keys_unit}",
                       src=str(REPO_ROOT / "templates" / "gate-keys.service.j2"),
                       dest=f"/etc/systemd/system/{g.keys_unit}", mode="644", **paths),
    ]
