"""The fleet's settings: serving or not, its address and key, gate peers, TLS, router, roll."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from operations import REPO_ROOT
from operations.plans.settings_rules import (
    _BOOL,
    _PATH,
    _PATH_ALLOWED,
    _PATH_DETAIL,
    _int_between,
    _is_host,
    _Rule,
    _text,
    setting,
)

#: The router's load balancing policies: smg 1.13.0's ``smg launch --policy`` choices (its
#: ``--help``, read off the wheel locks/router.txt pins); cache_aware is the issue's default.
ROUTER_POLICIES: Final = ("cache_aware", "round_robin", "random", "power_of_two", "least_load",
                          "consistent_hashing", "prefix_hash", "passthrough", "manual")
#: The router's Prometheus metrics port, on 127.0.0.1 (smg 1.13.0's default, ``--prometheus-port``;
#: operations/stages/router.py binds it there): no port of the router's may be it.
ROUTER_METRICS_PORT: Final = 29000


def _is_tls_name(value: Any) -> bool:
    """A name a certificate may hold: an IP address (no zone) or a DNS name (RFC 1035 labels
    of letters, digits and inner hyphens, at most 253 characters; a '*.' wildcard is not one)."""
    return _is_host(value) or (isinstance(value, str) and bool(re.fullmatch(
        r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*", value)))


def _is_peer_address(value: Any) -> bool:
    """An address another host can reach this one at: an IP address (no zone) that is not
    loopback, unspecified (0.0.0.0, ::), multicast or IPv6 link-local (which needs a zone),
    an IPv4-mapped IPv6 address judged as its IPv4 one (Python's ipaddress, ``ipv4_mapped``)."""
    if not _is_host(value):
        return False
    address = ipaddress.ip_address(value)
    address = getattr(address, "ipv4_mapped", None) or address
    return not (address.is_loopback or address.is_unspecified or address.is_multicast
                or (address.version == 6 and address.is_link_local))


@dataclass(frozen=True)
class FleetSettings:
    """The fleet's part of Settings (operations/plans/settings_schema.py)."""
    # The fleet (operations/stages/router.py): the SGLang model gateway on the gpuhost_router group
    #: False: the host serves no model (a CPU-only router VM of the gpuhost_router group)
    serving: bool = setting(
        True, _BOOL,
        "`False`: the host serves no model, a CPU-only router VM of the `gpuhost_router` group "
        "(refused elsewhere and in a node group): only the deploy lock, a preflight of its own "
        "and the router run there, and the GPU, driver, ML venv, model and server keys have no "
        "effect (docs/fleet.md)")
    fleet_address: str | None = setting(
        None,
        _Rule(lambda v: v is None or _is_peer_address(v),
              "this host's IP address on the network the fleet shares, such as "
              "10.0.0.5 (where the router and peers on other hosts reach it: not "
              "loopback, 0.0.0.0, ::, multicast or IPv6 link-local), or None"),
        "the host's address on the network it shares with the router: the router reaches its "
        "server at `http://<this>:<gpuhost_server_port>` (docs/fleet.md); one per host, never "
        "loopback, `0.0.0.0`, `::`, multicast or IPv6 link-local (a router elsewhere would "
        "reach itself, and workers' gates would trust their own host)")
    #: The key the router sends its workers and their gates admit it by (operations/stages/fleet.py)
    fleet_key_file: str | None = setting(
        None,
        _text(_PATH, f"an absolute path on the host, root-only {_PATH_DETAIL}",
              optional=True),
        "secret file holding the fleet key, the same key on the router hosts and every worker "
        "they reach through a gate (required there): the router sends it to its workers, their "
        "gates admit it (security.md)")
    api_gate_trusted_peers: tuple[str, ...] = setting(
        (),
        _Rule(
            lambda v: isinstance(v, (list, tuple)) and all(_is_peer_address(a) for a in v),
            "a list of other hosts' IP addresses (the router hosts' gpuhost_fleet_address; not "
            "loopback, 0.0.0.0, ::, multicast or IPv6 link-local: a loopback peer lets every "
            "process of this host past the key)"),
        "client addresses the server's API key gate admits without the key; a fleet's deploy adds "
        "the router hosts' `gpuhost_fleet_address` (the router sends its workers no key); other "
        "hosts' only: never loopback (every process of the host would pass), `0.0.0.0`, `::`, "
        "multicast or IPv6 link-local")
    #: The fleet CA on the controller: the public endpoints serve TLS with certificates it
    #: signs (operations/stages/tls.py)
    tls_ca_cert_file: str | None = setting(
        None,
        _text(_PATH, "an absolute path on the controller of the fleet CA's "
              f"PEM certificate {_PATH_DETAIL}", optional=True),
        "the fleet CA's certificate (PEM; in a CA rotation the old and new CAs' in one file, "
        "`gpuhost_tls_ca_key_file`'s signing), a file on the controller: every public endpoint "
        "then serves TLS with a certificate the deploy issues from the CA, renews 30 days before "
        "it expires, and refuses plain HTTP; the router verifies its workers with it (all its "
        "CAs: docs/security.md, Rotate the fleet CA); the same on a router and its workers")
    tls_ca_key_file: str | None = setting(
        None,
        _text(_PATH, "an absolute path on the controller of the fleet CA's PEM "
              f"private key, mode 0600 {_PATH_DETAIL}", optional=True),
        "the fleet CA's private key (PEM, unencrypted, mode 0600), a file on the controller; it "
        "never leaves the controller")
    tls_names: tuple[str, ...] = setting(
        (),
        _Rule(
            lambda v: isinstance(v, (list, tuple)) and all(_is_tls_name(n) for n in v),
            "a list of DNS names (such as gpu1.lab.example) or IP addresses (no zone) clients "
            "reach this host's endpoints by"),
        "more names for this host's certificate, DNS names or IP addresses its clients reach it "
        "by; it always holds the loopback, `localhost`, the fleet address, the bound addresses "
        "and the inventory name")
    #: The host's own certificate and key (on the host), in place of one the fleet CA's key issues
    tls_cert_file: str | None = setting(
        None,
        _text(_PATH, "an absolute path on the host of this host's PEM certificate "
              f"(its chain after it) {_PATH_DETAIL}", optional=True),
        "this host's own certificate (PEM, its chain after it), a file on the host, in place of "
        "one the deploy issues: your PKI's, signed by the CA `gpuhost_tls_ca_cert_file` names "
        "(then `gpuhost_tls_ca_key_file` may be left unset); set together with "
        "`gpuhost_tls_key_file`; you renew it, and the gate reloads when the file changes")
    tls_key_file: str | None = setting(
        None,
        _text(_PATH, "an absolute path on the host of that certificate's PEM "
              f"private key, root-only {_PATH_DETAIL}", optional=True),
        "its private key (PEM), a root-only file on the host (mode 0600, owner root)")
    router_host: str = setting(
        "127.0.0.1", _Rule(_is_host, "an IP address such as 127.0.0.1"),
        "router hosts: the router's bind; wider than the loopback needs "
        "`gpuhost_router_api_key_file` (then `sglang-router-gate.service` listens there)")
    router_port: int = setting(
        8100, _int_between(1, 65535),
        "the router's port (the gate's, for a wider bind)")
    router_backend_port: int = setting(
        30100, _int_between(1, 65535),
        "the router's own port on 127.0.0.1 behind its gate")
    router_api_key_file: str | None = setting(
        None,
        _text(_PATH, f"an absolute path on the host, root-only "
              f"{_PATH_DETAIL}", optional=True),
        "secret file on the router host holding the router's API key; read by its gate only, "
        "never on the router's command line")
    router_policy: str = setting(
        "cache_aware",
        _Rule(lambda v: v in ROUTER_POLICIES,
              "one of " + ", ".join(ROUTER_POLICIES)),
        "the router's load balancing policy: `cache_aware`, `round_robin`, `random`, "
        "`power_of_two`, `least_load`, `consistent_hashing`, `prefix_hash`, `passthrough`, "
        "`manual` (smg 1.13.0's)")
    router_health_check_interval_secs: int = setting(
        10, _int_between(1, 3600),
        "seconds between the router's health checks of each worker (`GET /health`)")
    router_health_check_timeout_secs: int = setting(
        5, _int_between(1, 600),
        "seconds a health check may take")
    router_health_failure_threshold: int = setting(
        3, _int_between(1, 100),
        "failed checks in a row before the router takes a worker out")
    router_health_success_threshold: int = setting(
        2, _int_between(1, 100),
        "passed checks in a row before it takes the worker back")
    router_lock: str = setting(
        "locks/router.txt",
        _text(r"[A-Za-z0-9_./\-]+\.txt", "a lock file (.txt) under locks/ or an "
              "absolute path"),
        "the router venv's lock (smg 1.13.0 and its dependencies, hashed)")
    router_venv_path: str = setting(
        "/opt/gpuhost/router-venv", _text(_PATH, _PATH_ALLOWED),
        "the router's own venv")
    router_wait_timeout: int = setting(
        300, _int_between(10, 86400),
        "seconds the deploy waits for the router to list every worker healthy")
    roll_size: int = setting(
        1, _int_between(1, 1024),
        "servers of the fleet restarted at once in a rolling upgrade (read from the first router "
        "host's data)")
    roll_drain_timeout: int = setting(
        120, _int_between(1, 86400),
        "seconds a host out of the router is waited for until its in-flight requests are done; "
        "past that it restarts anyway")
    roll_max_unavailable: int = setting(
        1, _int_between(1, 1024),
        "workers of the fleet a roll may have out of the router at once, those an interrupted "
        "run left out included (read from the first router host's data; at least "
        "gpuhost_roll_size)")

    @property
    def router_is_public(self) -> bool:
        """Whether the router binds more than the loopback address (then an API key gate
        listens there and the router itself on 127.0.0.1:gpuhost_router_backend_port)."""
        return not ipaddress.ip_address(self.router_host).is_loopback

    @property
    def router_lock_path(self) -> Path:
        path = Path(self.router_lock)
        return path if path.is_absolute() else REPO_ROOT / path
