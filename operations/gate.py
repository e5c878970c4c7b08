"""The API gates in front of the server and the router: nginx from the distribution's archive
(Debian 12: 1.22, Ubuntu 24.04: 1.24), run by gpuhost's own units (sglang-gate.service,
sglang-router-gate.service) with a configuration of their own under CONF_DIR, the keys in a
root-only include written on the host from the key files (operations/files/gate_keys.py).

Why its own units and not Debian's nginx.service: a gate is part of what it guards (PartOf= the
server or the router: it stops and starts with it, its start is verified with it by the health
gate, operations/server.py), and Debian's unit would serve its default site on port 80 of every
address. Debian's nginx.service is masked where gpuhost installs the package (while installing:
a runtime mask, which the package's postinst, ``deb-systemd-helper unmask``, leaves alone, and
invoke-rc.d does not start a masked unit).

Each gate (templates/gate-nginx.conf.j2):

- passes a request with ``Authorization: Bearer <key>`` for a key of its key files, refuses
  the rest with 401 from the head alone (in the server's rewrite phase, before the body is
  read or its size looked at); open paths (health) pass without a key; with an allow-list
  (the router's), any other path is 404 whatever the key;
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
from pyinfra.facts.deb import DebPackages
from pyinfra.operations import apt

from operations.p2p import LIB_DIR
from operations.service_users import GATE_USER
from operations.unit_sandbox import SYSTEMCTL, Sandbox

NGINX: Final = "/usr/sbin/nginx"
#: The gates' nginx configurations and their keys' includes.
CONF_DIR: Final = "/etc/gpuhost/nginx"
#: The distribution's package (Debian 12's and Ubuntu 24.04's nginx: the server itself).
PACKAGE: Final = "nginx"
#: The distribution's own unit, masked where gpuhost installs the package.
DISTRIBUTION_UNIT: Final = "nginx.service"
#: The paths every gate passes without a key (sglang and smg keep them open too).
OPEN_PATHS: Final = ("/health", "/health_generate")
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
#: The TLS versions a gate speaks: 1.2 and 1.3, Mozilla's "intermediate" configuration
#: (ssl-config.mozilla.org, guidelines 5.7), which every client of the fleet speaks.
TLS_PROTOCOLS: Final = "TLSv1.2 TLSv1.3"
WORKER_PROCESSES: Final = 2
WORKER_CONNECTIONS: Final = 4096
#: The gate's unit sandbox (operations/unit_sandbox.py). The master starts its workers as
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
    trusted_peers: tuple[str, ...] = ()
    #: The host's certificate and its key (operations/tls.py gate_files) where the gate serves
    #: TLS: one file, or two given in host data
    tls_cert: str | None = None
    tls_key: str | None = None

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
        "tls_protocols": TLS_PROTOCOLS,
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
    argument quoting (operations/server.py systemd_quote)."""
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
