"""Keep the loopback ports behind the gates to root's processes: nftables from the distribution.

What listens on the loopback behind a gate answers without the gate's key: sglang (it keeps no
key of its own: it logs its arguments, the journal, and returns them from /server_info), and
smg's own port. Every process of the host reaches the loopback, a local user's (``nobody``)
included; so the host's firewall refuses those ports to every socket not owned by root (uid 0),
the owner of the gates, the router and the deploy's checks. Its rule, in nft(8)'s words:

    oifname "lo" tcp dport { 30000, 30100 } meta skuid != 0 reject with tcp reset

``meta skuid`` is the owner of the sending socket (nft(8), META EXPRESSIONS; output hook:
locally generated packets only), ``lo`` carries every packet to one of the host's own
addresses. One table of gpuhost's own (``inet gpuhost_loopback_guard``, IPv4 and IPv6),
loaded by a oneshot unit (gpuhost-loopback-guard.service) before the servers and the router
start, replaced as a whole at each load (``nft -f`` applies a file atomically), left alone by
everything else: Debian's and Ubuntu's nftables.service (disabled by default) flushes the
whole ruleset when it starts, so the unit is PartOf it and loads again after it.

A server bound to the loopback keeps no key either: its port is in the table too, admitting
root's sockets and those of ``gpuhost_server_local_users`` (by uid, read with ``getent passwd``
while planning: a user unknown there refuses the host before any change):

    oifname "lo" tcp dport 8000 meta skuid != { 0, 1001 } reject with tcp reset

The router's metrics port (smg's ``127.0.0.1:29000``, no credential of smg's own) has a table of
its own (``inet gpuhost_metrics_guard``, :func:`metrics_guard`), loaded by the observability
stage: on the Prometheus host it admits root's and the ``prometheus`` user's sockets, and nft
resolves a user name when it loads a file ("Error: User does not exist" before the package has
made the user), so it cannot be part of the table above, which loads before the router starts.

Needs CAP_NET_ADMIN in the host's network namespace (a VM's root has it).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from io import StringIO
from typing import Final

from pyinfra.api import FactBase
from pyinfra.facts.deb import DebPackages
from pyinfra.operations import apt, files, systemd
from typing_extensions import override

from operations.plans.plan import fact, refuse
from operations.plans.settings import PREFIX
from operations.plans.unit_sandbox import NFT
from operations.stages.service_users import service_user

TABLE: Final = "gpuhost_loopback_guard"
RULES_PATH: Final = "/etc/gpuhost/loopback-guard.nft"
UNIT: Final = "gpuhost-loopback-guard.service"
UNIT_PATH: Final = f"/etc/systemd/system/{UNIT}"
#: Units that start only once the guard is loaded.
GUARDED_UNITS: Final = ("sglang.service", "sglang-router.service")
METRICS_TABLE: Final = "gpuhost_metrics_guard"
METRICS_RULES_PATH: Final = "/etc/gpuhost/metrics-guard.nft"
METRICS_UNIT: Final = "gpuhost-metrics-guard.service"


def rules(ports: tuple[int, ...], uids: Mapping[int, tuple[int, ...]] | None = None,
          names: Mapping[int, tuple[str, ...]] | None = None) -> str:
    """The nft file for ``ports``: the table created if missing, deleted, and defined anew
    (so that a load replaces it whole). ``uids`` names, per port, the users besides root
    whose sockets may connect (an anonymous set: ``meta skuid != { 0, 1001 }``, nft(8)'s
    SETS); ``names``, per port, gpuhost's own service users (operations/stages/service_users.py),
    by name, which nft resolves when it loads the file (the deploy makes them before)."""
    uids, names = uids or {}, names or {}
    root_only = ", ".join(str(p) for p in ports if not uids.get(p) and not names.get(p))
    lines = [f'\t\toifname "lo" tcp dport {{ {root_only} }} meta skuid != 0 reject with tcp reset\n']
    lines = lines if root_only else []
    for port in ports:
        if uids.get(port) or names.get(port):
            admitted = ", ".join([str(u) for u in (0, *sorted(set(uids.get(port, ()))))]
                                 + [f'"{n}"' for n in sorted(set(names.get(port, ())))])
            lines.append(f'\t\toifname "lo" tcp dport {port} meta skuid != {{ {admitted} }} '
                         "reject with tcp reset\n")
    return (f"# Managed by gpuhost from host data (operations/stages/loopback_guard.py).\n"
            f"table inet {TABLE}\n"
            f"delete table inet {TABLE}\n"
            f"table inet {TABLE} {{\n"
            f"\tchain output {{\n"
            f"\t\ttype filter hook output priority filter; policy accept;\n"
            + "".join(lines)
            + "\t}\n"
            "}\n")


def unit() -> str:
    """The oneshot unit that loads (and on stop removes) the table."""
    before = " ".join(GUARDED_UNITS)
    return ("# Managed by gpuhost from host data (operations/stages/loopback_guard.py).\n"
            "[Unit]\n"
            "Description=gpuhost: loopback ports behind the gates for root's processes only\n"
            "DefaultDependencies=no\n"
            "After=nftables.service\n"
            f"Before=network-pre.target {before}\n"
            "Wants=network-pre.target\n"
            "PartOf=nftables.service\n\n"
            "[Service]\n"
            "Type=oneshot\n"
            "RemainAfterExit=yes\n"
            f"ExecStart=/usr/sbin/nft -f {RULES_PATH}\n"
            f"ExecReload=/usr/sbin/nft -f {RULES_PATH}\n"
            f"ExecStop=/usr/sbin/nft delete table inet {TABLE}\n"
            + NFT.text() + "\n"
            "[Install]\n"
            "WantedBy=multi-user.target\n"
            f"RequiredBy={before}\n")


def loopback_guard(ports: tuple[int, ...],
                   users: Mapping[int, tuple[str, ...]] | None = None,
                   services: Mapping[int, tuple[str, ...]] | None = None) -> None:
    """nftables from the distribution, the table for ``ports`` loaded now and at each boot,
    reloaded (never restarted: the servers require it) when the ports change. ``users``: per
    port, the local users besides root who may connect; each must exist on the host (its uid
    goes in the table, so that a user renamed or removed later admits nobody new), else the
    host is refused while planning. ``services``: per port, gpuhost's service users who may
    connect, made here first (by name in the table). Nothing planned for no port."""
    if not ports:
        return
    for user in sorted({u for listed in (services or {}).values() for u in listed}):
        service_user(name=f"User {user}", user=user)
    uids = _uids(users or {})
    if uids is None:
        return
    installed = fact(DebPackages) or {}
    apt.packages(name="nftables for the loopback guard", packages=["nftables"],
                 no_recommends=True, update="nftables" not in installed)
    files.directory(name="gpuhost settings folder", path="/etc/gpuhost", mode="755")
    table = files.put(name=f"Loopback guard {RULES_PATH}",
                      src=StringIO(rules(ports, uids, services)),
                      dest=RULES_PATH, mode="644", create_remote_dir=False)
    service = files.put(name=f"Unit {UNIT}", src=StringIO(unit()), dest=UNIT_PATH, mode="644",
                        create_remote_dir=False)
    # reloaded, never restarted: a restart would stop and start the servers that require it
    systemd.service(name=f"Load {UNIT}", service=UNIT, running=True, enabled=True,
                    reloaded=table.will_change or service.will_change,
                    daemon_reload=service.will_change)


def _uids(users: Mapping[int, tuple[str, ...]]) -> dict[int, tuple[int, ...]] | None:
    """The uids of ``users`` (pyinfra's Users fact: /etc/passwd), or None after refusing the
    host for a user it does not have."""
    if not any(users.values()):
        return {}
    names = tuple(sorted({u for listed in users.values() for u in listed}))
    known = fact(UserIds, names=names) or {}
    missing = [u for u in names if u not in known]
    if missing:
        refuse("Loopback guard",
               f"{PREFIX}server_local_users names {', '.join(missing)}, not a user of this host "
               f"(getent passwd): create the user first, or leave it out")
        return None
    return {port: tuple(known[u] for u in listed) for port, listed in users.items()}


class UserIds(FactBase[dict[str, int]]):
    """The uid of each of ``names`` that the host knows (``getent passwd``: its passwd
    database through NSS, directory users included), by name.

    Not pyinfra's Users fact: that one reads every account's password hash from /etc/shadow
    into the controller, and runs lastlog for each account.

    .. code:: python

        {"alice": 1001}
    """

    @override
    def command(self, names: tuple[str, ...]) -> str:
        # getent exits 2 when a key is not found: the names found are still printed
        return f"getent passwd {' '.join(shlex.quote(n) for n in names)} || true"

    @override
    def process(self, output: list[str]) -> dict[str, int]:
        found = {}
        for line in output:
            fields = line.split(":")
            if len(fields) >= 3 and fields[2].isdigit():
                found[fields[0]] = int(fields[2])
        return found


def metrics_rules(ports: tuple[int, ...], users: tuple[str, ...]) -> str:
    """The nft file of the router's metrics port (and Alertmanager's, where it runs):
    ``ports`` refused on the loopback to every socket but root's and ``users``' (names,
    resolved by nft when it loads the file)."""
    listed = ", ".join(str(p) for p in ports)
    dport = f"{{ {listed} }}" if len(ports) > 1 else listed
    allowed = ", ".join(("0", *users))
    owners = f"{{ {allowed} }}" if users else "0"
    return (f"# Managed by gpuhost from host data (operations/stages/loopback_guard.py).\n"
            f"table inet {METRICS_TABLE}\n"
            f"delete table inet {METRICS_TABLE}\n"
            f"table inet {METRICS_TABLE} {{\n"
            f"\tchain output {{\n"
            f"\t\ttype filter hook output priority filter; policy accept;\n"
            f"\t\toifname \"lo\" tcp dport {dport} meta skuid != {owners} "
            "reject with tcp reset\n"
            f"\t}}\n"
            f"}}\n")


def metrics_unit() -> str:
    """The oneshot unit that loads (and on stop removes) the metrics table; not required by the
    router (its table loads after the router's first start, see the module's docstring)."""
    return ("# Managed by gpuhost from host data (operations/stages/loopback_guard.py).\n"
            "[Unit]\n"
            "Description=gpuhost: the router's metrics and Alertmanager for root and Prometheus\n"
            "DefaultDependencies=no\n"
            "After=nftables.service\n"
            "Before=network-pre.target sglang-router.service\n"
            "Wants=network-pre.target\n"
            "PartOf=nftables.service\n\n"
            "[Service]\n"
            "Type=oneshot\n"
            "RemainAfterExit=yes\n"
            f"ExecStart=/usr/sbin/nft -f {METRICS_RULES_PATH}\n"
            f"ExecReload=/usr/sbin/nft -f {METRICS_RULES_PATH}\n"
            f"ExecStop=/usr/sbin/nft delete table inet {METRICS_TABLE}\n"
            + NFT.text() + "\n"
            "[Install]\n"
            "WantedBy=multi-user.target\n")


def metrics_guard(ports: tuple[int, ...], users: tuple[str, ...]) -> None:
    """``ports`` on the loopback for root's and ``users``' sockets only, now and at each boot;
    reloaded when that changes. Plan it after the package that makes ``users``."""
    installed = fact(DebPackages) or {}
    apt.packages(name="nftables for the metrics guard", packages=["nftables"],
                 no_recommends=True, update="nftables" not in installed)
    files.directory(name="gpuhost settings folder", path="/etc/gpuhost", mode="755")
    table = files.put(name=f"Metrics guard {METRICS_RULES_PATH}",
                      src=StringIO(metrics_rules(ports, users)), dest=METRICS_RULES_PATH,
                      mode="644", create_remote_dir=False)
    service = files.put(name=f"Unit {METRICS_UNIT}", src=StringIO(metrics_unit()),
                        dest=f"/etc/systemd/system/{METRICS_UNIT}", mode="644",
                        create_remote_dir=False)
    systemd.service(name=f"Load {METRICS_UNIT}", service=METRICS_UNIT, running=True,
                    enabled=True, reloaded=table.will_change or service.will_change,
                    daemon_reload=service.will_change)
