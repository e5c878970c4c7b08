"""TLS under faults (issue 29, found by a breaker in lab 6): the fleet CA changed on the
controller between two runs; a certificate given in host data whose key is another's, and one
whose key is a symlink. On test_tls.py's fleet (tests/e2e/fleets.py ``tls_fleet``: one pytest
process with test_tls.py, after its tests, tests/lanes.py ``LANES_UNIT_WITH``): the router on
gpu1, which serves too, in front of gpu1, gpu2 and gpu3, every gate on the lab switch; gpu3 is
the client. The CAs are made with the openssl command docs/security.md gives
(tests/e2e/test_tls.py's). These tests change the fleet's CA: they come last; their deploys
keep the settings test_tls.py's last test left (ROLLED, its roll's), so that what changes is
theirs alone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.e2e import lab
from tests.e2e.test_tls import (CLIENT, CLIENT_THREADS, PAUSE_S, ROLLED, make_ca, probe,
                                served_fingerprint, switch, write_inventory)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
#: tests/lanes.py: this module's tests run in test_tls.py's unit, after its tests
LANES_UNIT_WITH = "test_tls.py"

ROUTER_HOST = "gpu1"
CLIENT_HOST = "gpu3"
HOST_PEM = "/etc/gpuhost/tls/host.pem"


@pytest.fixture(scope="module")
def fleet(tls_fleet):
    """test_tls.py's fleet, with a second fleet CA's certificate on the client beside the
    first's (test_tls.py's fleet CA, which the fleet is converged with)."""
    hosts, work, first, _ = tls_fleet
    second = make_ca(work, "gpuhost fleet CA 2")
    hosts[CLIENT_HOST].ssh(f"cat > /root/fleet-ca-2.crt <<'EOF'\n"
                           f"{Path(second[0]).read_text()}EOF")
    return hosts, work, (first, second)


def test_a_new_fleet_ca_reissues_and_the_router_verifies_its_workers_with_it(fleet):
    """The operator replaces the fleet CA on the controller: the next converge issues every
    host's certificate again, and the router, which reads its CA once at its start (smg
    --ca-cert-paths), restarts with the new one. Before, it refused every worker with
    "UnknownIssuer" and the converge waited in vain for healthy workers."""
    hosts, work, (_, second) = fleet
    client, addresses = hosts[CLIENT_HOST], switch()
    router_pid = hosts[ROUTER_HOST].main_pid("sglang-router.service")
    run = lab.deploy(inventory=write_inventory(work / "inventory-2.py", second, ROLLED))
    assert run.returncode == 0, run.output[-8000:]
    for name in hosts:
        assert f"[{name}] TLS certificate: the host's certificate was not issued by this fleet " \
               "CA: issued again" in run.output, name
    assert "BEGIN PRIVATE KEY" not in run.output
    assert hosts[ROUTER_HOST].main_pid("sglang-router.service") != router_pid
    # the run ended with "The router lists its 3 worker(s), healthy" (router_check)
    urls = json.loads(hosts[ROUTER_HOST].ssh("python3 /root/workers.py"))
    assert urls == sorted(["http://127.0.0.1:30000", f"https://{addresses['gpu2']}:8000",
                           f"https://{addresses['gpu3']}:8000"])
    router = f"https://{addresses[ROUTER_HOST]}:8100/v1/models"
    assert probe(client, router, ca="/root/fleet-ca-2.crt") == (200, "ok")
    status, reason = probe(client, router, ca="/root/fleet-ca.crt")
    assert status == 0 and "CERTIFICATE_VERIFY_FAILED" in reason, reason


def test_a_given_key_of_another_certificate_is_refused_and_a_symlinked_one_served(fleet):
    """gpu2 brings a certificate of its own (signed by the fleet CA now in use) with another
    certificate's key: refused while planning, naming the key and nginx's reason, nothing
    changed on gpu2 (its gate serves on). Before, nginx's reload failed and the run said only
    "Job for sglang-gate.service failed", the configuration left naming the pair. Then the
    right key, behind a symlink as certbot's live/privkey.pem is (refused before as "there is
    none"): served."""
    from operations.stages import tls
    hosts, work, (_, second) = fleet
    gpu2, addresses = hosts["gpu2"], switch()
    ca = tls.load_ca(*second)
    names = ("127.0.0.1", addresses["gpu2"])
    right, other = tls.issue(ca, "gpu2", names), tls.issue(ca, "gpu2", names)
    end = "-----END PRIVATE KEY-----\n"
    gpu2.ssh("mkdir -p /etc/ssl/gpuhost/archive /etc/ssl/gpuhost/live; umask 077; "
             f"cat > /etc/ssl/gpuhost/gpu2.crt <<'EOF'\n{right.partition(end)[2]}EOF\n"
             f"cat > /etc/ssl/gpuhost/other.key <<'EOF'\n{other.partition(end)[0] + end}EOF\n"
             f"cat > /etc/ssl/gpuhost/archive/privkey1.pem <<'EOF'\n"
             f"{right.partition(end)[0] + end}EOF\n"
             "ln -sfn ../archive/privkey1.pem /etc/ssl/gpuhost/live/privkey.pem")
    own = {"gpuhost_tls_cert_file": "/etc/ssl/gpuhost/gpu2.crt",
           "gpuhost_tls_key_file": "/etc/ssl/gpuhost/other.key"}
    served = served_fingerprint(hosts[CLIENT_HOST], addresses["gpu2"], 8000)
    refused = lab.deploy(inventory=write_inventory(work / "other-key.py", second, ROLLED,
                                                   hosts_extra={"gpu2": own}))
    assert refused.returncode != 0
    assert "[gpu2] TLS: refused: gpuhost_tls_key_file = '/etc/ssl/gpuhost/other.key' is not " \
        "allowed: the private key of gpuhost_tls_cert_file's certificate, which nginx loads " \
        "(key values mismatch)" in refused.output, refused.output[-6000:]
    assert "Job for sglang-gate.service failed" not in refused.output
    assert "other.key" not in gpu2.ssh("cat /etc/gpuhost/nginx/sglang-gate.conf")
    assert served_fingerprint(hosts[CLIENT_HOST], addresses["gpu2"], 8000) == served
    own["gpuhost_tls_key_file"] = "/etc/ssl/gpuhost/live/privkey.pem"
    run = lab.deploy(inventory=write_inventory(work / "symlinked-key.py", second, ROLLED,
                                               hosts_extra={"gpu2": own}))
    assert run.returncode == 0, run.output[-6000:]
    wanted = tls.fingerprint(right.partition(end)[2]).replace(":", "").lower()
    deadline = time.monotonic() + 30
    while served_fingerprint(hosts[CLIENT_HOST], addresses["gpu2"], 8000) != wanted:
        assert time.monotonic() < deadline, "gpu2's gate does not serve its own certificate"
        time.sleep(1)


#: test_tls.py's CLIENT, counting the failures that were the TLS verification's as well
ROTATION_CLIENT = CLIENT.replace(
    '"errors": errors[:5],',
    '"errors": errors[:5], "tls_failed": sum("CERTIFICATE" in e or "SSL" in e for e in errors),')


def test_a_ca_rotation_in_three_steps_keeps_the_bundles_clients_and_warns_a_single_step(fleet):
    """Issue 40 finding 5: the fleet CA (test_tls.py's second, CA 2) is replaced by CA 3. A
    change in one step is said by ``--dry`` for every host, naming the trust files that lack
    CA 3, and changes nothing. Then docs/security.md's three steps, while a client on gpu3 that
    trusts the bundle (CA 2 and CA 3 in one file, as the operator hands it out) sends chat
    completions through the router over TLS: 1. the bundle in gpuhost_tls_ca_cert_file, CA 2's
    key still signing: no certificate issued, every trust file holds both CAs, a client of CA 2
    alone still verifies; 2. CA 3's key: every host's certificate issued again by CA 3, no
    warning, smg not restarted (its trust did not change); 3. CA 2 dropped: nothing issued, a
    client of CA 2 alone is refused. A last run changes nothing. The bundle's client (a client
    per step) never fails to verify, and fails nothing in step 2; steps 1 and 3 restart smg
    and its gate (PartOf=), whose second of refused connections is printed, not asserted (a
    single router has no peer to serve meanwhile). Comes last in the module: the
    fleet ends on CA 3 with test_tls.py's ROLLED settings, and gpu2 on a certificate the deploy
    issued."""
    from tests.e2e.test_server import changed
    hosts, work, cas = fleet
    client, addresses, router = hosts[CLIENT_HOST], switch(), hosts[ROUTER_HOST]
    # the CA the fleet is on: CA 2 after this module's first test, test_tls.py's alone
    on_hosts = router.ssh("cat /etc/gpuhost/tls/fleet-ca.crt")
    (second,) = [ca for ca in cas if Path(ca[0]).read_text().strip() == on_hosts.strip()]
    client.ssh(f"cat > /root/fleet-ca-2.crt <<'EOF'\n{Path(second[0]).read_text()}EOF")
    third = make_ca(work, "gpuhost fleet CA 3")
    both = work / "bundle-2-3.crt"
    both.write_text(Path(second[0]).read_text() + Path(third[0]).read_text())
    client.ssh(f"cat > /root/bundle.crt <<'EOF'\n{both.read_text()}EOF\n"
               f"cat > /root/fleet-ca-3.crt <<'EOF'\n{Path(third[0]).read_text()}EOF")
    on_second = lab.deploy(inventory=write_inventory(work / "rotation-0.py", second, ROLLED))
    assert on_second.returncode == 0, on_second.output[-8000:]
    served = {n: served_fingerprint(client, addresses[n], 8000) for n in hosts}
    one_step = lab.deploy("--dry", inventory=write_inventory(work / "one-step.py", third, ROLLED))
    assert one_step.returncode == 0, one_step.output[-8000:]
    for name in hosts:
        trust = ROUTER_HOST if name == ROUTER_HOST else f"{ROUTER_HOST}, {name}"
        assert f"[{name}] TLS: warning: the fleet CA changes in one step: {name}'s certificate " \
               f"is issued again by CN=gpuhost fleet CA 3, which the trust file " \
               f"(/etc/gpuhost/tls/fleet-ca.crt) of {trust} does not hold yet" in \
               one_step.output, (name, one_step.output[-8000:])
    assert "Rotate the fleet CA" in one_step.output
    assert {n: served_fingerprint(client, addresses[n], 8000) for n in hosts} == served
    url = f"https://{addresses[ROUTER_HOST]}:8100"
    steps = [("1 (the bundle, CA 2 signing)", (str(both), second[1])),
             ("2 (CA 3 signing)", (str(both), third[1])),
             ("3 (CA 2 dropped)", third)]
    client.ssh(f"cat > /root/rotation-client.py <<'EOF'\n{ROTATION_CLIENT}\nEOF")
    results = {}
    for number, (label, ca) in enumerate(steps, 1):
        smg = router.main_pid("sglang-router.service")
        client.ssh(f"rm -f /tmp/client.stop /tmp/client.out; nohup python3 "
                   f"/root/rotation-client.py {url} /root/bundle.crt /root/client.key 0 3000 "
                   f"{CLIENT_THREADS} {PAUSE_S} > /tmp/client.out 2>&1 < /dev/null &")
        try:
            time.sleep(3)
            run = lab.deploy(inventory=write_inventory(work / f"rotation-{number}.py", ca, ROLLED))
        finally:
            client.ssh("touch /tmp/client.stop")
            deadline = time.monotonic() + 120
            while not client.ssh("cat /tmp/client.out", check=False).strip():
                assert time.monotonic() < deadline
                time.sleep(2)
        results[label] = json.loads(client.ssh("cat /tmp/client.out").strip().splitlines()[-1])
        assert run.returncode == 0, (label, run.output[-8000:])
        assert "changes in one step" not in run.output, (label, run.output[-8000:])
        assert "BEGIN PRIVATE KEY" not in run.output
        trusted = {n: h.ssh("grep -c 'BEGIN CERTIFICATE' /etc/gpuhost/tls/fleet-ca.crt")
                   .strip() for n, h in hosts.items()}
        assert trusted == {n: "1" if number == 3 else "2" for n in hosts}, (label, trusted)
        issued = [n for n in hosts if f"[{n}] TLS certificate: the host's certificate was "
                  "not issued by this fleet CA: issued again" in run.output]
        restarted = router.main_pid("sglang-router.service") != smg
        # smg restarts where its trust changes (steps 1 and 3) and only there
        assert restarted == (number != 2), (label, restarted)
        if number == 2:
            assert issued == sorted(hosts), (label, issued)
            urls = json.loads(router.ssh("python3 /root/workers.py"))
            assert urls == sorted(["http://127.0.0.1:30000",
                                   f"https://{addresses['gpu2']}:8000",
                                   f"https://{addresses['gpu3']}:8000"]), urls
        else:
            assert issued == [] and "TLS certificate:" not in run.output, (label, issued)
        old_alone = probe(client, f"{url}/v1/models", ca="/root/fleet-ca-2.crt")
        if number == 1:
            assert old_alone == (200, "ok"), old_alone
        else:
            assert old_alone[0] == 0 and "CERTIFICATE_VERIFY_FAILED" in old_alone[1], \
                (label, old_alone)
            assert probe(client, f"{url}/v1/models", ca="/root/fleet-ca-3.crt") == \
                (200, "ok"), label
    print("\nthrough the TLS router while the fleet CA rotated in three steps, a client "
          f"trusting the bundle, {CLIENT_THREADS} clients at once:")
    for label, r in results.items():
        print(f"  step {label}: {r['requests']} requests, {r['failed']} failed "
              f"({r['tls_failed']} of them TLS verification), {r['seconds']} s; "
              f"errors: {r['errors']}")
    # no request ever failed to verify; none failed while every certificate was issued again
    assert all(r["tls_failed"] == 0 for r in results.values()), results
    assert results[steps[1][0]]["failed"] == 0, results
    smg = router.main_pid("sglang-router.service")
    again = lab.deploy("--json", inventory=write_inventory(work / "rotation-3.py", third, ROLLED))
    assert again.returncode == 0, again.output[-6000:]
    assert changed(again) == [] and "TLS" not in "".join(changed(again)), changed(again)
    assert router.main_pid("sglang-router.service") == smg
