"""The checks of what a host exposes against each other: binds, ports, keys, peers, TLS, serving."""

from __future__ import annotations

import ipaddress

from operations.plans.settings_fleet import ROUTER_METRICS_PORT
from operations.plans.settings_rules import PREFIX, _fail
from operations.plans.settings_schema import Settings


def _check_server_exposure(host: str, s: Settings) -> None:
    if s.server_is_public and s.server_local_users:
        raise _fail(
            host, "server_local_users", list(s.server_local_users),
            f"no users with {PREFIX}server_host = {s.server_host!r}: a server bound wider than the "
            "loopback is reached through its gate with the API key, never past it")
    if s.server_is_public and s.api_key_file is None:
        raise _fail(
            host, "server_host", s.server_host,
            f"a loopback address (127.0.0.1, ::1), or set {PREFIX}api_key_file to a root-only "
            "file holding the API key: a wider bind without a key is open to the network",
        )
    if s.server_is_public and s.server_backend_port == s.server_port:
        raise _fail(
            host, "server_backend_port", s.server_backend_port,
            f"a port other than {PREFIX}server_port ({s.server_port}): the API key gate listens "
            "there and the server behind it on 127.0.0.1",
        )


def _check_router_exposure(host: str, s: Settings) -> None:
    """The router's bind as the server's: a wider bind needs a key (the API key gate in front,
    operations/stages/router.py, on the loopback too), and the gate's port is not the router's
    own."""
    if s.router_is_public and s.router_api_key_file is None:
        raise _fail(
            host, "router_host", s.router_host,
            f"a loopback address (127.0.0.1, ::1), or set {PREFIX}router_api_key_file to a "
            "root-only file holding the API key: a wider bind without a key is open to the "
            "network",
        )
    if s.router_backend_port == s.router_port:
        raise _fail(
            host, "router_backend_port", s.router_backend_port,
            f"a port other than {PREFIX}router_port ({s.router_port}): the API key gate listens "
            "there and the router behind it on 127.0.0.1",
        )
    for loopback in ("router_backend_port", *(() if s.router_is_public else ("router_port",))):
        if getattr(s, loopback) == ROUTER_METRICS_PORT:
            raise _fail(host, loopback, ROUTER_METRICS_PORT,
                        f"a port other than {ROUTER_METRICS_PORT}: the router's own metrics "
                        f"listen on 127.0.0.1:{ROUTER_METRICS_PORT}, where the router would "
                        "listen too")
    taken = {s.server_port: "server_port", s.server_backend_port: "server_backend_port"} \
        if s.serving else {}
    for key in ("router_port", "router_backend_port"):
        port = getattr(s, key)
        if port in taken:
            raise _fail(host, key, port, f"a port other than {PREFIX}{taken[port]}'s ({port}): "
                        "the router may run on a serving host")


def _check_trusted_peers(host: str, s: Settings) -> None:
    """Each trusted peer once, and none of this host's own addresses (its fleet address, its
    server's and router's binds): every process of the host, every local user included, would
    pass the gate without the key from there. An IPv4-mapped IPv6 address is its IPv4 one."""
    def same(address: str) -> str:
        ip = ipaddress.ip_address(address)
        return (getattr(ip, "ipv4_mapped", None) or ip).compressed

    seen: set[str] = set()
    own = {same(a): key for key, a in (("fleet_address", s.fleet_address),
                                        ("server_host", s.server_host),
                                        ("router_host", s.router_host)) if a}
    for peer in s.api_gate_trusted_peers:
        if same(peer) in seen:
            raise _fail(host, "api_gate_trusted_peers", list(s.api_gate_trusted_peers),
                        f"each address once ({peer} is listed twice)")
        seen.add(same(peer))
        if same(peer) in own:
            raise _fail(host, "api_gate_trusted_peers", list(s.api_gate_trusted_peers),
                        f"other hosts' addresses only ({peer} is this host's own "
                        f"{PREFIX}{own[same(peer)]}: every local user would pass without the "
                        "key)")


def _check_dist_init_port(host: str, s: Settings) -> None:
    """The rendezvous port on rank 0 is torch.distributed's TCP store there (sglang 0.5.9,
    ``--dist-init-addr``): it cannot be a port the server or its gate listens on."""
    if not s.nodes:
        return
    taken = {s.server_port: "server_port"}
    if s.server_is_public:
        taken[s.server_backend_port] = "server_backend_port"
    if s.dist_init_port in taken:
        raise _fail(host, "dist_init_port", s.dist_init_port,
                    f"a port other than {PREFIX}{taken[s.dist_init_port]} "
                    f"({s.dist_init_port}): rank 0 listens there for the nodes' rendezvous")


def _check_serving(host: str, s: Settings) -> None:
    """A host that serves no model is no node of a server across nodes (operations/stages/fleet.py
    refuses one outside the gpuhost_router group: it knows the groups)."""
    if s.serving:
        return
    if s.nodes:
        raise _fail(host, "serving", s.serving,
                    f"True on a host of a node group ({PREFIX}nodes = {list(s.nodes)}): each "
                    "node serves its ranks of the group's model")


def _check_observability_ports(host: str, s: Settings) -> None:
    """Prometheus and Alertmanager (on the loopback of their host) and the node exporter (on the
    fleet address or the loopback) listen beside the server, its gate, the router and the
    router's metrics: no two of them on one port."""
    taken = {ROUTER_METRICS_PORT: "the router's metrics (127.0.0.1)"}
    for key in ("server_port", "server_backend_port", "router_port", "router_backend_port"):
        taken.setdefault(getattr(s, key), PREFIX + key)
    names = {"prometheus_port": "Prometheus", "node_exporter_port": "the node exporter",
             "alertmanager_port": "Alertmanager"}
    for key in ("prometheus_port", "node_exporter_port", "alertmanager_port"):
        port = getattr(s, key)
        if port in taken:
            raise _fail(host, key, port, f"a port other than {taken[port]}'s ({port}): "
                        f"{names[key]} listens there")
        taken[port] = PREFIX + key


def _check_tls(host: str, s: Settings) -> None:
    """The fleet CA's certificate and key go together; names need the CA."""
    if s.tls_ca_key_file is not None and s.tls_ca_cert_file is None:
        raise _fail(host, "tls_ca_cert_file", None, f"a path as well, since {PREFIX}"
                    "tls_ca_key_file is set: the deploy issues certificates with the fleet CA's "
                    "key and certificate")
    own = {"tls_cert_file": s.tls_cert_file, "tls_key_file": s.tls_key_file}
    for key, other in (("tls_cert_file", "tls_key_file"), ("tls_key_file", "tls_cert_file")):
        if own[key] is None and own[other] is not None:
            raise _fail(host, key, None, f"a path as well, since {PREFIX}{other} is set: a "
                        "certificate and its private key, named together")
    if s.tls_cert_file is not None and s.tls_ca_cert_file is None:
        raise _fail(host, "tls_ca_cert_file", None, f"a path, since {PREFIX}tls_cert_file is "
                    "set: the CA's certificate that signed it, which the router and the "
                    "deploy's checks verify it with")
    if s.tls_cert_file is not None and s.tls_cert_file == s.tls_key_file:
        raise _fail(host, "tls_key_file", s.tls_key_file,
                    f"a file other than {PREFIX}tls_cert_file's")
    public = (s.serving and s.server_is_public) or s.router_is_public
    if s.tls_ca_cert_file is not None and s.tls_ca_key_file is None and public \
            and s.tls_cert_file is None:
        raise _fail(host, "tls_ca_key_file", None, f"a path, or {PREFIX}tls_cert_file and "
                    f"{PREFIX}tls_key_file: this host's endpoints bind wider than the "
                    "loopback and need a certificate, issued with the fleet CA's key or your own")
    if s.tls_ca_cert_file is not None and s.tls_ca_cert_file == s.tls_ca_key_file:
        raise _fail(host, "tls_ca_key_file", s.tls_ca_key_file,
                    f"a file other than {PREFIX}tls_ca_cert_file's")
    if s.tls_names and s.tls_ca_cert_file is None:
        raise _fail(host, "tls_names", list(s.tls_names), f"[] without {PREFIX}tls_ca_cert_file "
                    "(names of a certificate the deploy issues from the fleet CA)")
