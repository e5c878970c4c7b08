"""Fleets that several end-to-end modules share: session-scoped fixtures (conftest.py takes
them in), so the modules of one pytest process boot and first deploy one fleet between them.
tests/lanes.py runs such modules as one unit, in one process, where a module names the one it
joins (``LANES_UNIT_WITH``); run alone, a module boots the fleet for itself. A module that
changes its fleet leaves it as the modules after it expect, or runs last.

- ``tls_fleet``: test_tls.py's three hosts, every gate on the lab switch over TLS (then
  test_tls_faults.py's tests).
- ``cpu_router_fleet``: two serving hosts and a CPU-only router host (test_planes.py, then
  test_observability.py).

Each says how long its boot and its first deploy took (printed: ``pytest -rA`` shows it).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e import lab

#: The CPU-only router host of ``cpu_router_fleet``
CPU_ROUTER_HOST = "gpu3"
#: Where Alertmanager posts (test_observability.py's webhook receiver on the router host)
HOOK_URL = "http://127.0.0.1:9999/hook"


@dataclass
class Fleet:
    hosts: dict
    switch: dict
    inventory: str
    keys: dict = field(repr=False)


def switch() -> dict[str, str]:
    """Each host's address on the lab switch."""
    return {h["name"]: h["switch_address"]
            for h in json.loads(lab.sandbox("status", "--json").stdout)}


@pytest.fixture(scope="session")
def tls_fleet(tmp_path_factory):
    """test_tls.py's fleet: three hosts from the run's image, the router on gpu1 (which serves
    too), the clients' scripts, the fleet CA's and another CA's certificates and the router's
    client key on gpu3; (hosts by name, the work folder, the fleet CA's files, the
    inventory)."""
    from tests.e2e.test_tls import (CLIENT, CLIENT_HOST, FLOOD, PROBE, ROUTER_HOST, WORKERS,
                                    make_ca, write_inventory)
    work = tmp_path_factory.mktemp("tls")
    started = time.monotonic()
    hosts = {h.name: h for h in lab.up_from_image(hosts=3)}
    booted = time.monotonic()
    keys = lab.fleet_keys(hosts.values(), routers=[ROUTER_HOST], serving=hosts)
    ca = make_ca(work, "gpuhost fleet CA")
    other = make_ca(work, "another CA")
    client = hosts[CLIENT_HOST]
    client.ssh(f"umask 077; printf '%s\\n' {keys['router API key']} > /root/client.key; "
               f"cat > /root/probe.py <<'EOF'\n{PROBE}\nEOF\n"
               f"cat > /root/client.py <<'EOF'\n{CLIENT}\nEOF\n"
               f"cat > /root/flood.py <<'EOF'\n{FLOOD}\nEOF\n"
               f"cat > /root/other-ca.crt <<'EOF'\n{Path(other[0]).read_text()}EOF\n"
               f"cat > /root/fleet-ca.crt <<'EOF'\n{Path(ca[0]).read_text()}EOF")
    hosts[ROUTER_HOST].ssh(f"cat > /root/workers.py <<'EOF'\n{WORKERS}\nEOF")
    inventory = write_inventory(work / "inventory.py", ca)
    deployed = time.monotonic()
    first = lab.deploy(inventory=inventory)
    assert first.returncode == 0, first.output[-8000:]
    _say_times("tls_fleet", started, booted, deployed)
    yield hosts, work, ca, inventory
    lab.sandbox("down", check=False)


def write_inventory(path: Path, extra: dict | None = None,
                    leave_out: tuple[str, ...] = ()) -> str:
    """``cpu_router_fleet``'s inventory: every host on the lab switch with the fleet key and
    GPU metrics every 5 s; the serving hosts' servers behind their gates with the client key
    (and ``extra``); the router bound on the switch with the router's client key, health
    checks every 2 s and Alertmanager posting to HOOK_URL. ``leave_out``: hosts it lacks."""
    entries = []
    for h in json.loads(lab.sandbox("status", "--json").stdout):
        if h["name"] in leave_out:
            continue
        data = {**lab.inventory_data(h), "gpuhost_fleet_address": h["switch_address"],
                "gpuhost_fleet_key_file": lab.FLEET_KEY_FILE, "gpuhost_gpu_metrics_interval": 5}
        if h["name"] == CPU_ROUTER_HOST:
            data.update(gpuhost_router_host=h["switch_address"],
                        gpuhost_router_api_key_file=lab.ROUTER_KEY_FILE,
                        gpuhost_router_health_check_interval_secs=2,
                        gpuhost_alert_webhook_url=HOOK_URL)
        else:
            data.update(gpuhost_server_host=h["switch_address"],
                        gpuhost_api_key_file=lab.API_KEY_FILE, **(extra or {}))
        entries.append((h["name"], data))
    literal = json.dumps(json.dumps(entries))
    path.write_text(f"import json\nsandbox = [tuple(e) for e in json.loads({literal})]\n"
                    f"gpuhost_router = [{CPU_ROUTER_HOST!r}]\n")
    return str(path)


@pytest.fixture(scope="session")
def cpu_router_fleet(tmp_path_factory):
    """Two serving hosts (gpu1, gpu2) from the run's image behind their gates and a CPU-only
    router host (gpu3, from the bare tree) running the real router and Debian's Prometheus and
    Alertmanager, the fleet's keys as lab.fleet_keys writes them, converged with
    :func:`write_inventory`'s inventory."""
    started = time.monotonic()
    hosts = lab.up_from_image(hosts=3, host_scenarios={CPU_ROUTER_HOST: "cpu-only"})
    booted = time.monotonic()
    keys = lab.fleet_keys(hosts, routers=[CPU_ROUTER_HOST])
    inventory = write_inventory(tmp_path_factory.mktemp("cpu-router") / "inventory.py")
    deployed = time.monotonic()
    first = lab.deploy(inventory=inventory)
    assert first.returncode == 0, first.output[-8000:]
    _say_times("cpu_router_fleet", started, booted, deployed)
    yield Fleet({h.name: h for h in hosts}, switch(), inventory, keys)
    lab.sandbox("down", check=False)


def _say_times(name: str, started: float, booted: float, deployed: float) -> None:
    """The boot (from the image, with its own first deploy where lab.up_from_image gives one)
    and the fleet's first deploy."""
    print(f"{name}: boot {booted - started:.0f} s, the fleet's first deploy "
          f"{time.monotonic() - deployed:.0f} s")
