"""TLS under faults (issue 29, found by a breaker in lab 6): the fleet CA changed on the
controller between two runs, and a certificate given in host data whose key is another's. Two
hosts from the suite run's image of a converged host (lab.up_from_image): the router on gpu1,
which serves too, in front of gpu1 and gpu2, every gate on the lab switch; gpu2 is the client.
The CAs are made with the openssl command docs/security.md gives (tests/e2e/test_tls.py's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e import lab
from tests.e2e.test_tls import PROBE, WORKERS, make_ca, probe, switch, write_inventory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROUTER_HOST = "gpu1"
CLIENT_HOST = "gpu2"
HOST_PEM = "/etc/gpuhost/tls/host.pem"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    work = tmp_path_factory.mktemp("tls-faults")
    hosts = {h.name: h for h in lab.up_from_image(hosts=2)}
    keys = lab.fleet_keys(hosts.values(), routers=[ROUTER_HOST], serving=hosts)
    first, second = make_ca(work, "gpuhost fleet CA"), make_ca(work, "gpuhost fleet CA 2")
    hosts[CLIENT_HOST].ssh(
        f"umask 077; printf '%s\\n' {keys['router API key']} > /root/client.key; "
        f"cat > /root/probe.py <<'EOF'\n{PROBE}\nEOF\n"
        f"cat > /root/fleet-ca.crt <<'EOF'\n{Path(first[0]).read_text()}EOF\n"
        f"cat > /root/fleet-ca-2.crt <<'EOF'\n{Path(second[0]).read_text()}EOF")
    hosts[ROUTER_HOST].ssh(f"cat > /root/workers.py <<'EOF'\n{WORKERS}\nEOF")
    inventory = write_inventory(work / "inventory.py", first)
    run = lab.deploy(inventory=inventory)
    assert run.returncode == 0, run.output[-8000:]
    yield hosts, work, (first, second)
    lab.sandbox("down", check=False)


def test_a_new_fleet_ca_reissues_and_the_router_verifies_its_workers_with_it(fleet):
    """The operator replaces the fleet CA on the controller: the next converge issues every
    host's certificate again, and the router, which reads its CA once at its start (smg
    --ca-cert-paths), restarts with the new one. Before, it refused every worker with
    "UnknownIssuer" and the converge waited in vain for healthy workers."""
    hosts, work, (_, second) = fleet
    client, addresses = hosts[CLIENT_HOST], switch()
    router_pid = hosts[ROUTER_HOST].main_pid("sglang-router.service")
    run = lab.deploy(inventory=write_inventory(work / "inventory-2.py", second))
    assert run.returncode == 0, run.output[-8000:]
    for name in hosts:
        assert f"[{name}] TLS certificate: the host's certificate was not issued by this fleet " \
               "CA: issued again" in run.output, name
    assert "BEGIN PRIVATE KEY" not in run.output
    assert hosts[ROUTER_HOST].main_pid("sglang-router.service") != router_pid
    # the run ended with "The router lists its 2 worker(s), healthy" (router_check)
    urls = json.loads(hosts[ROUTER_HOST].ssh("python3 /root/workers.py"))
    assert urls == sorted(["http://127.0.0.1:30000", f"https://{addresses['gpu2']}:8000"])
    router = f"https://{addresses[ROUTER_HOST]}:8100/v1/models"
    assert probe(client, router, ca="/root/fleet-ca-2.crt") == (200, "ok")
    status, reason = probe(client, router, ca="/root/fleet-ca.crt")
    assert status == 0 and "CERTIFICATE_VERIFY_FAILED" in reason, reason
