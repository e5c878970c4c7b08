"""The fleet: which hosts serve, which run the router (the ``gpuhost_router`` group), and the
URL the router reaches each serving host's server at (its own host's server on the loopback).
A node group (``gpuhost_nodes``) is one worker, its rank 0. A host with ``gpuhost_serving =
False`` serves no model (a CPU-only router VM, as issue 18 allows): it is no worker, and it must
be a router host. Pure planning over every host's validated settings; nothing here touches a
host.

A serving host is reached at ``https://<gpuhost_fleet_address>:<gpuhost_server_port>`` (its
gate's TLS, operations/stages/tls.py; ``http://`` where the fleet has no CA), the address on the
network the router shares with it. The router on the same host may reach a
loopback server at its own loopback. A server bound wider than the loopback has the API key
gate in front (settings: a wider bind needs a key). The router admits itself by a credential,
never by its address: the fleet key (``gpuhost_fleet_key_file``, a root-only file of the same
key on the router hosts and on every worker they reach through a gate), which smg 1.13.0 sends
to each worker it was given with ``"api_key"`` (operations/stages/router.py) and which each worker's
gate admits beside its clients' key. Every router host needs its client key
(``gpuhost_router_api_key_file``): smg's generation paths are never open, not even on the
loopback, where every local user of the host could use them. Behind every key, the servers'
and routers' own loopback ports admit root's processes only (:func:`guarded_ports`,
operations/stages/loopback_guard.py): a local user is a stranger.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from operations.runtime.run_exit import end_run
from operations.plans.settings import PREFIX, ROUTER_METRICS_PORT, Settings
from operations.stages.service_users import GATE_USER, ROUTER_USER, SERVER_USER

ROUTER_GROUP: Final = "gpuhost_router"
#: The router's control-plane key on its host (made there by operations/stages/router.py, root-only;
#: smg's ``--control-plane-api-keys``): read by the deploy's scripts on the router host only.
CONTROL_KEY_FILE: Final = "/etc/gpuhost/router-control.key"


class FleetError(ValueError):
    """Host data that gives no working fleet: one line per problem, naming host, key and value."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Worker:
    """A serving host as the router sees it: the host's name and its server's URL."""

    name: str
    url: str


@dataclass(frozen=True)
class Fleet:
    """The router hosts (names, inventory order) and, for each, its workers in inventory order."""

    routers: tuple[str, ...]
    workers: Mapping[str, tuple[Worker, ...]]

    def workers_of(self, router: str) -> tuple[Worker, ...]:
        return self.workers.get(router, ())


def _wildcard(address: str) -> bool:
    return ipaddress.ip_address(address).is_unspecified


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def _url(address: str, port: int, scheme: str = "http") -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


def worker_url(name: str, s: Settings, router: str) -> tuple[str | None, str | None]:
    """(URL, None) where the router on host ``router`` reaches ``name``'s server, or (None, the
    problem's line)."""
    if name == router:
        # its own server on the loopback: behind the gate (server_backend_port) where it is
        # public, so that the gate need not trust the host's own address (the health gate
        # checks from there that a request without the key is refused)
        loop = "::1" if ":" in s.server_host and not _wildcard(s.server_host) else "127.0.0.1"
        port = s.server_backend_port if s.server_is_public else s.server_port
        return _url(loop, port), None
    if s.fleet_address is None:
        return None, (f"host {name}: {PREFIX}fleet_address = None is not allowed: the address "
                      f"where the router on {router} reaches this host's server (the "
                      f"{ROUTER_GROUP} group routes to every serving host)")
    fleet = ipaddress.ip_address(s.fleet_address)
    v6 = fleet.version == 6 and fleet.ipv4_mapped is None  # type: ignore[union-attr]
    wildcard = "::" if v6 else "0.0.0.0"
    # 0.0.0.0 listens on IPv4 only; :: on both (Linux's default, net.ipv6.bindv6only = 0: ipv6(7))
    bound = s.server_host == s.fleet_address or (
        _wildcard(s.server_host) and (":" in s.server_host or not v6))
    if not bound:
        return None, (f"host {name}: {PREFIX}server_host = {s.server_host!r} is not allowed: "
                      f"the router on {router} reaches the server at {PREFIX}fleet_address "
                      f"{s.fleet_address!r}: bind that address or {wildcard} (with "
                      f"{PREFIX}api_key_file)")
    # through its gate, which serves TLS where the fleet has a CA (operations/stages/tls.py)
    return _url(s.fleet_address, s.server_port,
                "https" if s.tls_ca_cert_file else "http"), None


def plan(hosts: Iterable[tuple[str, Iterable[str]]], settings: Mapping[str, Settings]) -> Fleet:
    """The fleet of an inventory: ``hosts`` as (name, its groups) in inventory order, every
    host's settings by name. Every host serves but those with ``gpuhost_serving = False``; the
    hosts of :data:`ROUTER_GROUP` also run the router, in front of every serving host. Raises
    :class:`FleetError` with every problem (a serving host the router cannot reach, a router
    host without a fleet address where its workers' gates must admit it, one fleet address
    given to two hosts, a host that serves no model outside :data:`ROUTER_GROUP`, a router
    without any serving host)."""
    listed = [(name, set(groups)) for name, groups in hosts]
    routers = tuple(name for name, groups in listed if ROUTER_GROUP in groups)
    problems = [f"host {name}: {PREFIX}serving = False is not allowed outside the "
                f"{ROUTER_GROUP} group: True, or put {name} in {ROUTER_GROUP} (a host that "
                "serves no model runs the fleet's router)"
                for name, groups in listed
                if not settings[name].serving and ROUTER_GROUP not in groups]
    serving = [name for name, _ in listed if settings[name].serving]
    problems += _shared_addresses([name for name, _ in listed], settings)
    workers: dict[str, tuple[Worker, ...]] = {}
    for router in routers:
        workers[router], said = _router_workers(router, serving, settings)
        problems += said
    if problems:
        raise FleetError(list(dict.fromkeys(problems)))
    return Fleet(routers, workers)


def _shared_addresses(names: list[str], settings: Mapping[str, Settings]) -> list[str]:
    """A problem for each host whose fleet address an earlier host of ``names`` has too."""
    problems = []
    owner: dict[str, str] = {}
    for name in names:
        address = settings[name].fleet_address
        if address is None:
            continue
        # one address, two hosts: the router and the model copy would reach the first
        ip = ipaddress.ip_address(address)
        key = (getattr(ip, "ipv4_mapped", None) or ip).compressed  # ::ffff:10.0.0.1 is 10.0.0.1
        if key in owner:
            problems.append(f"host {name}: {PREFIX}fleet_address = {address!r} is not allowed: "
                            f"host {owner[key]} has it too; each host's own address")
        owner.setdefault(key, name)
    return problems


def _router_workers(router: str, serving: list[str], settings: Mapping[str, Settings]
                    ) -> tuple[tuple[Worker, ...], list[str]]:
    """The workers of the router on ``router`` (rank 0 of a node group only) and the problems
    of that router and its workers: its ports and roll, a worker it cannot reach, no worker,
    the keys and the CA they must share."""
    own = settings[router]
    problems = []
    keys = ("server_port", "server_backend_port")[:2 if own.server_is_public else 1]
    for key in keys if own.serving else ():
        if getattr(own, key) == ROUTER_METRICS_PORT:
            problems.append(f"host {router}: {PREFIX}{key} = {ROUTER_METRICS_PORT} is not "
                            f"allowed: a port other than {ROUTER_METRICS_PORT}, where the "
                            f"router on this host has its metrics (127.0.0.1)")
    if own.roll_size > own.roll_max_unavailable:
        problems.append(f"host {router}: {PREFIX}roll_size = {own.roll_size} is not "
                        f"allowed: at most {PREFIX}roll_max_unavailable "
                        f"({own.roll_max_unavailable}), the workers a roll may have out "
                        "of the router at once")
    found = []
    for name in serving:
        if settings[name].nodes and name != settings[name].nodes[0]:
            continue  # a rank >= 1 of a node group serves no model (operations/stages/nodes.py)
        url, problem = worker_url(name, settings[name], router)
        if problem:
            problems.append(problem)
        else:
            found.append(Worker(name, url or ""))
    if not serving:
        problems.append(f"host {router}: the router has no worker: every host of the "
                        f"inventory has {PREFIX}serving = False; serving hosts are those "
                        f"with {PREFIX}serving = True (the default)")
    return tuple(found), problems + _router_keys(router, serving, settings)


def _router_keys(router: str, serving: list[str], settings: Mapping[str, Settings]
                 ) -> list[str]:
    """The problems of the keys and CA a router on ``router`` and its gated workers share:
    its client key file, the fleet key on both sides, one fleet CA."""
    own = settings[router]
    problems = []
    if own.router_api_key_file is None:
        problems.append(f"host {router}: {PREFIX}router_api_key_file = None is not allowed "
                        "on a router host: a root-only file holding the client key (the "
                        "router's generation paths are never open, not even on the "
                        "loopback, where every local user could use them)")
    remote_gated = [n for n in serving if n != router and settings[n].server_is_public
                    and not (settings[n].nodes and n != settings[n].nodes[0])]
    if remote_gated and own.fleet_key_file is None:
        problems.append(f"host {router}: {PREFIX}fleet_key_file = None is not allowed: the "
                        f"API key gates of {', '.join(remote_gated)} admit the router by "
                        "the fleet key it sends (a root-only file holding the same key on "
                        "the router hosts and their workers)")
    for name in remote_gated:
        theirs = settings[name].tls_ca_cert_file
        if theirs != own.tls_ca_cert_file:
            problems.append(f"host {name}: {PREFIX}tls_ca_cert_file = {theirs!r} is not "
                            f"allowed: {own.tls_ca_cert_file!r}, as on router host "
                            f"{router}, whose router verifies this host's certificate "
                            "with it (one fleet CA for a router and its workers)")
        if settings[name].fleet_key_file is None:
            problems.append(f"host {name}: {PREFIX}fleet_key_file = None is not allowed: "
                            f"the router on {router} reaches this host's gate with the "
                            "fleet key (a root-only file holding the same key as on the "
                            "router host)")
    return problems


def guarded_ports(fleet: Fleet, name: str, s: Settings) -> tuple[int, ...]:
    """The loopback ports on host ``name`` that only root's processes may connect to
    (operations/stages/loopback_guard.py): what answers behind a gate without its key (the server on
    ``gpuhost_server_backend_port``, the router on ``gpuhost_router_backend_port``: every
    router has its gate, operations/stages/router.py), and a server bound to the loopback, which
    keeps no key either (a router on the same host reaches it so; :func:`admitted_users` may name
    local users who may too: any other local user is a stranger). Sorted, without repeats;
    empty where nothing needs it."""
    ports = set()
    if s.serving and s.server_is_public:
        ports.add(s.server_backend_port)
    elif s.serving:
        ports.add(s.server_port)
    if name in fleet.routers:
        ports.add(s.router_backend_port)
    return tuple(sorted(ports))


def admitted_users(s: Settings) -> dict[int, tuple[str, ...]]:
    """The local users, besides root, whose processes the loopback guard lets connect to a
    port of :func:`guarded_ports`: ``gpuhost_server_local_users`` to a loopback server (the
    settings refuse them for a wider bind)."""
    return {s.server_port: s.server_local_users} if s.serving and s.server_local_users else {}


def service_users(fleet: Fleet, name: str, s: Settings) -> dict[int, tuple[str, ...]]:
    """gpuhost's service users (operations/stages/service_users.py) whom the loopback guard lets
    connect to a port of :func:`guarded_ports`: the gates' nginx workers to the ports behind
    the gates (the server's backend port where it is public, the router's); a router's smg to
    its own host's server, which it reaches on the loopback (:func:`worker_url`); the server
    to its own port: sglang warms itself up through its own HTTP API before it says it is
    ready, and kills itself where that fails (sglang 0.5.9's srt/entrypoints/http_server.py,
    ``_wait_and_warmup``: GET ``/get_model_info`` then POST ``/generate`` to
    ``server_args.url()``; ``kill_process_tree`` on failure), and its unit's ExecStartPost
    polls its /health as it (templates/sglang.service.j2)."""
    users: dict[int, tuple[str, ...]] = {}
    if s.serving:
        port = s.server_backend_port if s.server_is_public else s.server_port
        users[port] = ((GATE_USER,) if s.server_is_public else ()) + (
            (ROUTER_USER,) if name in fleet.routers else ()) + (SERVER_USER,)
    if name in fleet.routers:
        users[s.router_backend_port] = (GATE_USER,)
    return {port: listed for port, listed in users.items() if listed}


def for_run(inventory, settings: Mapping[str, Settings]) -> tuple[Fleet, dict[str, Settings]]:
    """:func:`plan` of pyinfra's inventory and the settings; on a problem, exit with every
    problem listed before any host is touched (as settings.for_run does)."""
    hosts = [(h.name, h.groups) for h in inventory]
    try:
        fleet = plan(hosts, settings)
    except FleetError as exc:
        end_run("gpuhost: fleet refused, no host was touched:\n  - "
                + "\n  - ".join(exc.problems))
    return fleet, dict(settings)
