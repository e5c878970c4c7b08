"""TLS on the fleet's public endpoints (issue 29, "Done when": the router and every worker
answer over TLS with the fleet CA; the rolling upgrade drops no request). Three hosts from the
suite run's image of a converged host (tests/e2e/fleets.py ``tls_fleet``, which
test_tls_faults.py's tests take on after these): the router on gpu1, which serves too, in
front of gpu1, gpu2 and gpu3, every gate on the lab switch. The fleet CA is made on the
controller with the openssl command docs/security.md gives. Clients are Python scripts on gpu3
(lab addresses only) verifying with the CA's certificate, as the docs' clients do.

Issue 41 (a stranger on the fleet network, gpu3 without a key): sslyze grades every gate
against Mozilla's intermediate profile, run from gpu3's network namespace; a key in a query
string gets 400 and reaches no journal; a /health_generate flood reaches no server and a
keyless /health flood is cut at the gate (figures printed).
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandbox.layout import HostSpec
from tests.e2e import lab
from tests.e2e.fleets import switch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROUTER_HOST = "gpu1"
CLIENT_HOST = "gpu3"
HOST_PEM = "/etc/gpuhost/tls/host.pem"
CA_ON_HOST = "/etc/gpuhost/tls/fleet-ca.crt"
#: What the docs tell an operator to run (docs/security.md, TLS), into a folder of the test's.
MAKE_CA = ("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -noenc -days 3650 "
           "-subj '/CN={cn}' -addext 'basicConstraints=critical,CA:TRUE' "
           "-addext 'keyUsage=critical,keyCertSign,cRLSign' -keyout {key} -out {cert}")
ROLL_REQUESTS = 3000
#: Clients sending at once during the roll, each pausing PAUSE_S between two requests: enough
#: that 3000 fall within it (4 clients pausing 0.03 s sent 3252 in a 40 s roll), and at most
#: 6 / 0.035 = 171 a second, within what the router's gate admits from one client address
#: (operations/stages/gate.py RATE, 200 a second; 8 clients without a pause got 429s from it)
CLIENT_THREADS = 6
PAUSE_S = 0.035
#: What the roll (the module's last test) changes, and the fleet keeps after it
ROLLED = {"gpuhost_moe_runner_backend": "flashinfer_cutedsl"}

#: One request: URL, CA file, key file or "-", then prints "<status> <reason>" (status 0: no
#: HTTP answer, the reason the TLS or connection error).
PROBE = r"""
import http.client, ssl, sys, urllib.error, urllib.request
url, ca, key_file = sys.argv[1], sys.argv[2], sys.argv[3]
headers = {} if key_file == "-" else {"Authorization": "Bearer " + open(key_file).read().strip()}
context = ssl.create_default_context(cafile=ca) if url.startswith("https") else None
try:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10,
                                context=context) as r:
        print(r.status, "ok")
except urllib.error.HTTPError as exc:
    print(exc.code, exc.read().decode(errors="replace").strip()[:120])
except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
    print(0, type(getattr(exc, "reason", exc)).__name__, str(getattr(exc, "reason", exc))[:120])
"""

#: Chat completions through the router over TLS from ``threads`` clients at once, until the
#: stop file is there and at least ``minimum`` were sent (or ``limit`` seconds passed); prints
#: its counts, and how many were sent before the stop file appeared (during the deploy).
CLIENT = r"""
import json, os, ssl, sys, threading, time, urllib.request
url, ca, key_file, minimum, limit, threads, pause = sys.argv[1], sys.argv[2], sys.argv[3], \
    int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
key = open(key_file).read().strip()
context = ssl.create_default_context(cafile=ca)
counts = {"ok": 0, "failed": 0, "during": None}; errors = []; lock = threading.Lock()
start = time.monotonic()

def send():
    while time.monotonic() - start < limit:
        with lock:
            sent = counts["ok"] + counts["failed"]
            if os.path.exists("/tmp/client.stop"):
                if counts["during"] is None:
                    counts["during"] = sent
                if sent >= minimum:
                    return
        body = json.dumps({"model": "glm-5", "messages": [{"role": "user", "content":
                           f"q{sent} {time.time()}"}], "max_tokens": 4}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", body,
                                     {"content-type": "application/json",
                                      "Authorization": "Bearer " + key})
        try:
            with urllib.request.urlopen(req, timeout=30, context=context) as r:
                json.loads(r.read())["choices"][0]
            with lock:
                counts["ok"] += 1
        except Exception as exc:
            body = exc.read().decode(errors="replace")[:200] if hasattr(exc, "read") else ""
            with lock:
                counts["failed"] += 1
                errors.append(f"{time.monotonic() - start:.1f} s: {type(exc).__name__}: "
                              f"{getattr(exc, 'code', exc)} {body}")
        time.sleep(pause)

workers = [threading.Thread(target=send) for _ in range(threads)]
for w in workers:
    w.start()
for w in workers:
    w.join()
print(json.dumps({"requests": counts["ok"] + counts["failed"], "ok": counts["ok"],
                  "failed": counts["failed"], "during_deploy": counts["during"],
                  "errors": errors[:5], "seconds": round(time.monotonic() - start, 1)}))
"""

#: ``count`` keyless GETs of ``url`` from ``threads`` clients at once, each on a kept-alive
#: connection (a new one after an error); prints how many answered each status.
FLOOD = r"""
import collections, http.client, json, ssl, sys, threading, urllib.parse
url, ca, count, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
parts = urllib.parse.urlsplit(url)
context = ssl.create_default_context(cafile=ca)
statuses = collections.Counter(); lock = threading.Lock(); left = [count]

def send():
    conn = None
    while True:
        with lock:
            if not left[0]:
                return
            left[0] -= 1
        try:
            conn = conn or http.client.HTTPSConnection(parts.hostname, parts.port, timeout=30,
                                                       context=context)
            conn.request("GET", parts.path)
            r = conn.getresponse(); r.read(); status = r.status
        except (OSError, http.client.HTTPException) as exc:
            conn, status = None, type(exc).__name__
        with lock:
            statuses[str(status)] += 1

workers = [threading.Thread(target=send) for _ in range(threads)]
for w in workers:
    w.start()
for w in workers:
    w.join()
print(json.dumps(dict(statuses)))
"""

#: The router's worker URLs, read on its loopback with the control key (root only).
WORKERS = r"""
import json, urllib.request as u
key = open("/etc/gpuhost/router-control.key").read().strip()
r = u.Request("http://127.0.0.1:30100/workers", headers={"Authorization": "Bearer " + key})
print(json.dumps(sorted(w["url"] for w in json.load(u.urlopen(r, timeout=10))["workers"])))
"""


def make_ca(folder: Path, cn: str) -> tuple[str, str]:
    cert, key = folder / f"{cn.replace(' ', '-')}.crt", folder / f"{cn.replace(' ', '-')}.key"
    subprocess.run(MAKE_CA.format(cn=cn, key=key, cert=cert), shell=True, check=True,
                   capture_output=True)
    return str(cert), str(key)


def write_inventory(path: Path, ca: tuple[str, str], extra: dict | None = None,
                    hosts_extra: dict | None = None) -> str:
    entries = []
    for h in json.loads(lab.sandbox("status", "--json").stdout):
        data = lab.fleet_data(h, router=h["name"] == ROUTER_HOST)
        data.update(gpuhost_tls_ca_cert_file=ca[0], gpuhost_tls_ca_key_file=ca[1],
                    gpuhost_router_health_check_interval_secs=2, **(extra or {}),
                    **(hosts_extra or {}).get(h["name"], {}))
        entries.append((h["name"], data))
    path.write_text("import json\nsandbox = [tuple(e) for e in json.loads("
                    f"{json.dumps(json.dumps(entries))})]\ngpuhost_router = [{ROUTER_HOST!r}]\n")
    return str(path)


@pytest.fixture(scope="module")
def fleet(tls_fleet):
    """The run's TLS fleet (tests/e2e/fleets.py): test_tls_faults.py's tests take it on after
    this module's, in the same process (tests/lanes.py)."""
    return tls_fleet


def probe(client: lab.Host, url: str, ca: str = "/root/fleet-ca.crt",
          key: str = "/root/client.key", user: str = "root") -> tuple[int, str]:
    run = "" if user == "root" else f"runuser -u {user} -- "
    if user != "root":
        client.ssh("cp /root/probe.py /root/fleet-ca.crt /tmp/ && chmod 644 /tmp/probe.py "
                   "/tmp/fleet-ca.crt")
        ca = ca.replace("/root/", "/tmp/")
    out = client.ssh(f"{run}python3 {'/tmp' if run else '/root'}/probe.py {url} {ca} {key}")
    status, _, reason = out.strip().partition(" ")
    return int(status), reason


def served_fingerprint(client: lab.Host, address: str, port: int) -> str:
    """The SHA-256 fingerprint of the certificate the gate at address:port serves."""
    return client.ssh(
        "python3 -c 'import ssl, hashlib, sys; "
        "der = ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate((sys.argv[1], "
        f"int(sys.argv[2])))); print(hashlib.sha256(der).hexdigest())' {address} {port}").strip()


def test_the_router_and_every_worker_answer_over_tls_with_the_fleet_ca(fleet):
    hosts, _, _, _ = fleet
    client, addresses = hosts[CLIENT_HOST], switch()
    router = f"https://{addresses[ROUTER_HOST]}:8100"
    assert probe(client, f"{router}/v1/models") == (200, "ok")
    for name in ("gpu1", "gpu2", "gpu3"):
        worker = f"https://{addresses[name]}:8000/v1/models"
        assert probe(client, worker, key=lab.API_KEY_FILE) == (200, "ok"), name
        # no key: refused by the gate, over TLS
        assert probe(client, worker, key="-")[0] == 401, name
        # a client trusting another CA does not get past the handshake
        status, reason = probe(client, worker, ca="/root/other-ca.crt")
        assert status == 0 and "CERTIFICATE_VERIFY_FAILED" in reason, (name, reason)
        # plain HTTP on the TLS port: 400, never a redirect, never the model
        status, reason = probe(client, f"http://{addresses[name]}:8000/v1/models", key="-")
        assert status == 400 and "use https://" in reason, (name, status, reason)
    status, reason = probe(client, f"http://{addresses[ROUTER_HOST]}:8100/v1/models", key="-")
    assert status == 400 and "use https://" in reason, (status, reason)
    # the router reaches its workers over TLS (verified with the CA: smg --ca-cert-paths)
    urls = json.loads(hosts[ROUTER_HOST].ssh("python3 /root/workers.py"))
    assert urls == sorted(["http://127.0.0.1:30000",
                           f"https://{addresses['gpu2']}:8000",
                           f"https://{addresses['gpu3']}:8000"]), urls
    # a chat completion through the router over TLS reaches a remote worker's gate
    for _ in range(4):
        assert probe(client, f"{router}/v1/models")[0] == 200
    # the key and certificate: root's alone
    for h in hosts.values():
        assert h.ssh(f"stat -c '%a %U' {HOST_PEM}").strip() == "600 root", h.name
    # a local user of a worker gets no completion, over TLS or not
    assert probe(client, f"https://{addresses['gpu2']}:8000/v1/models", key="-",
                 user="nobody")[0] == 401


def test_sslyze_grades_every_gate_mozillas_intermediate(fleet):
    """sslyze (PyPI, the test extras) with its Mozilla check (``--mozilla_config=intermediate``:
    Mozilla's guideline 5.7, sslyze/mozilla_tls_profile/5.7.json), trusting the fleet CA,
    against the router's gate (8100) and every worker's (8000): run from the controller's venv
    inside gpu3's network namespace, a stranger on the fleet network."""
    hosts, _, ca, _ = fleet
    addresses = switch()
    targets = [f"{addresses[ROUTER_HOST]}:8100"] + [f"{addresses[n]}:8000" for n in sorted(hosts)]
    run = subprocess.run(["ip", "netns", "exec", HostSpec(int(CLIENT_HOST[3:])).netns,
                          sys.executable, "-m", "sslyze", "--mozilla_config=intermediate",
                          "--resum", f"--certinfo_ca_file={ca[0]}", *targets],
                         capture_output=True, text=True, timeout=600)
    compliance = run.stdout[run.stdout.upper().find("COMPLIANCE AGAINST"):]
    print(f"\nsslyze --mozilla_config=intermediate:\n{compliance}")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    for target in targets:
        assert f"{target}: OK - Compliant." in compliance, (target, compliance)
    # what the scanner read of each: TLS 1.2 and 1.3 alone, no CBC or CCM suite
    sections = run.stdout.split("* TLS 1.2 Cipher Suites:")[1:]
    assert len(sections) == len(targets), run.stdout[-6000:]
    for tls12 in sections:
        tls12 = tls12.split("* TLS 1.3")[0]
        assert "CBC" not in tls12 and "CCM" not in tls12 and "GCM" in tls12, tls12
    for old in ("SSL 2.0", "SSL 3.0", "TLS 1.0", "TLS 1.1"):
        for section in run.stdout.split(f"* {old} Cipher Suites:")[1:]:
            assert "rejected all cipher suites" in section.split("* ")[0], (old, section)
    # no session tickets (Mozilla's nginx configuration; its compliance check leaves them out)
    assert run.stdout.count("With TLS Tickets: NOT SUPPORTED") == len(targets), run.stdout


def cursors(hosts) -> dict[str, str]:
    """Each host's journal cursor now."""
    return {n: h.ssh("journalctl -q -n 0 --show-cursor").strip().removeprefix("-- cursor: ")
            for n, h in hosts.items()}


def journal_since(host: lab.Host, cursor: str, *units: str) -> str:
    unit_args = " ".join(f"-u {u}" for u in units)
    return host.ssh(f"journalctl -q -o cat --no-pager {unit_args} --after-cursor '{cursor}'")


def test_a_key_in_a_query_string_gets_400_and_reaches_no_journal(fleet):
    """A stranger on gpu3 (and a holder of the key too) puts a key in the query string, the way
    a client library that takes ``api_key=`` might: 400 from the gate, before the server; after
    it no journal of any host holds a request line with a query string, nor any key. The keys
    are read on the host inside each command (``$(cat ...)``): they never pass through here."""
    hosts, _, _, _ = fleet
    client, addresses = hosts[CLIENT_HOST], switch()
    since = cursors(hosts)
    router, worker = f"https://{addresses[ROUTER_HOST]}:8100", f"https://{addresses['gpu2']}:8000"
    asked = [(f"{router}/v1/models?api_key=", "/root/client.key", "-"),
             (f"{router}/v1/chat/completions?key=", "/root/client.key", "-"),
             (f"{router}/health?api_key=", "/root/client.key", "-"),
             (f"{router}/v1/models?api_key=", "/root/client.key", "/root/client.key"),
             (f"{worker}/v1/models?api_key=", lab.API_KEY_FILE, "-"),
             (f"{worker}/health_generate?key=", lab.API_KEY_FILE, "-"),
             (f"{worker}/v1/models?api_key=", lab.API_KEY_FILE, lab.API_KEY_FILE),
             (f"{worker}/v1/models?foo=bar", lab.API_KEY_FILE, lab.API_KEY_FILE)]
    for url, in_query, header in asked:
        out = client.ssh(f"python3 /root/probe.py \"{url}$(cat {in_query})\" /root/fleet-ca.crt "
                         f"{header}")
        status, _, reason = out.strip().partition(" ")
        assert status == "400" and "Authorization header" in reason, (url, header, out)
    time.sleep(2)  # journald's own flush
    request_line = re.compile(r'"[A-Z]+ /[^" ]*\?[^" ]* HTTP/')
    for name, h in hosts.items():
        journal = journal_since(h, since[name])
        assert not request_line.search(journal), (name, request_line.findall(journal)[:5])
        assert "api_key=" not in journal and "?key=" not in journal, name
        keys = " ".join(f for f in (lab.FLEET_KEY_FILE, lab.API_KEY_FILE, lab.ROUTER_KEY_FILE,
                                    "/etc/gpuhost/*.key")
                        if h.ssh(f"ls {f} 2>/dev/null", check=False).strip())
        found = h.ssh(f"journalctl -q -o cat --no-pager --after-cursor '{since[name]}' | "
                      f"grep -c -F -f <(awk NF {keys}) || true").strip()
        assert found == "0", (name, f"{found} journal lines hold a key")
    # the gate's own line: the path alone, the 400
    gate = journal_since(hosts["gpu2"], since["gpu2"], "sglang-gate.service")
    assert f'{addresses[CLIENT_HOST]} "GET /v1/models" 400' in gate, gate[-2000:]


def test_a_strangers_health_flood_is_cut_at_the_gate(fleet):
    """``/health_generate`` (sglang generates a token for it) needs the key on every gate: a
    stranger's flood of it reaches no server (counted in every server's journal, sglang's
    request lines). ``/health`` (the same generation in sglang 0.5.9) stays open for smg's first
    keyless probe: a stranger's flood of it is cut at the gate to the per-address burst and rate
    (operations/stages/gate.py HEALTH_BURST, HEALTH_RATE): its 200s are the requests sglang answered
    (the gate answers none itself), its 429s the gate's. The gate's own lines for the stranger
    are printed beside them (syslog datagrams: journald may miss some in a flood)."""
    from operations.stages import gate
    hosts, _, _, _ = fleet
    client, addresses = hosts[CLIENT_HOST], switch()
    router, worker = f"https://{addresses[ROUTER_HOST]}:8100", f"https://{addresses['gpu2']}:8000"
    count = 300
    since = cursors(hosts)
    floods = {}
    began = time.monotonic()
    for url in (f"{router}/health_generate", f"{worker}/health_generate", f"{worker}/health"):
        floods[url] = json.loads(client.ssh(f"python3 /root/flood.py {url} /root/fleet-ca.crt "
                                            f"{count} 8").strip().splitlines()[-1])
    seconds = time.monotonic() - began
    time.sleep(2)
    reached = {n: len(re.findall(r'"GET /health_generate HTTP/', journal_since(
        h, since[n], "sglang.service"))) for n, h in hosts.items()}
    gate_log = journal_since(hosts["gpu2"], since["gpu2"], "sglang-gate.service")
    stranger = addresses[CLIENT_HOST]
    passed = len(re.findall(rf'^{re.escape(stranger)} "GET /health" 200 ', gate_log, re.M))
    cut = len(re.findall(rf'^{re.escape(stranger)} "GET /health" 429 ', gate_log, re.M))
    health = floods[f"{worker}/health"]
    answered = health.get("200", 0)
    print(f"\na stranger's floods of {count} requests each, 8 clients at once, {seconds:.0f} s "
          f"in all: {floods}; /health_generate requests that reached a server: {reached}; "
          f"keyless /health on gpu2: {answered} of {count} reached sglang, the rest cut at the "
          f"gate (429); the gate's journal: {passed} passed, {cut} cut")
    assert floods[f"{router}/health_generate"] == {"401": count}
    assert floods[f"{worker}/health_generate"] == {"401": count}
    assert reached == {n: 0 for n in hosts}, reached
    assert answered + health.get("429", 0) == count, health
    assert passed <= answered and cut <= health["429"], (passed, cut, health)
    assert gate.HEALTH_BURST + 1 <= answered <= gate.HEALTH_BURST + 1 + int(
        seconds * gate.HEALTH_RATE) + 1, health
    # the key holder still gets it, through the router
    assert probe(client, f"{router}/health_generate") == (200, "ok")


#: Issue 41's targets for `systemd-analyze security`'s overall exposure: the server and the
#: router, which parse every client's request, at most 4.9; every other unit gpuhost installs
#: at most 2.5.
EXPOSURE_TARGETS = {"sglang.service": 4.9, "sglang-router.service": 4.9}
OTHER_EXPOSURE = 2.5
#: Every service unit file gpuhost wrote ("Managed by gpuhost" on its first line), and each
#: one's overall exposure as the host's own systemd-analyze scores it.
EXPOSURES = r"""
for f in /etc/systemd/system/*.service; do
  [ -L "$f" ] && continue
  head -n 1 "$f" | grep -q '^# Managed by gpuhost' || continue
  u=$(basename "$f")
  echo "$u $(systemd-analyze security --no-pager "$u" | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')"
done
"""


#: Every process of the SGLang server by user: the stand-in's one process (``python -m
#: sglang.launch_server ...``) and the real server's children, which name themselves
#: ``sglang::scheduler_TP0``, ``sglang::detokenizer`` (sglang 0.5.9's setproctitle calls).
SGLANG_PROCS = r"ps -eo user:32,args | grep -E '[s]glang(\.launch_server|::)' | cut -d' ' -f1"


def test_every_unit_gpuhost_installs_is_sandboxed_and_no_daemon_of_its_own_is_root(fleet):
    hosts, _, _, _ = fleet
    for name, h in hosts.items():
        scores = dict(line.split() for line in h.ssh(EXPOSURES).splitlines() if line.strip())
        expected = {"sglang.service", "sglang-gate.service", "sglang-gate-keys.service",
                    "gpuhost-loopback-guard.service", "gpuhost-gpu-metrics.service"}
        if name == ROUTER_HOST:
            expected |= {"sglang-router.service", "sglang-router-gate.service",
                         "sglang-router-gate-keys.service", "gpuhost-metrics-guard.service"}
        assert expected <= set(scores), (name, sorted(scores))
        over = {u: s for u, s in scores.items()
                if float(s) > EXPOSURE_TARGETS.get(u, OTHER_EXPOSURE)}
        assert over == {}, (name, scores)
        # nginx's workers as the gates' own user, their master alone as root
        procs = [line.split(None, 1) for line in
                 h.ssh("ps -eo user:32,args | grep '[n]ginx: '").splitlines()]
        workers = {user for user, args in procs if args.startswith("nginx: worker process")}
        masters = {user for user, args in procs if args.startswith("nginx: master process")}
        assert workers == {"gpuhost-gate"} and masters == {"root"}, (name, procs)
        if name == ROUTER_HOST:  # smg as its own user (its title: smg::router)
            routers = set(h.ssh("ps -eo user:32,args | grep '[s]mg::router' | cut -d' ' -f1")
                          .split())
            assert routers == {"gpuhost-router"}, routers
        # the server as its own user; it reads the model, writes its kernel caches
        assert set(h.ssh(SGLANG_PROCS).split()) == {"gpuhost-server"}, name
        unit = h.ssh("systemctl show -p User -p Group --value sglang.service").split()
        assert unit == ["gpuhost-server", "gpuhost-server"], (name, unit)
        owners = h.ssh("stat -c '%U %G %a' /var/cache/gpuhost/kernels/*/ "
                       "/var/cache/gpuhost/kernels/*/*/ | sort -u").strip()
        assert owners == "gpuhost-server gpuhost-server 700", (name, owners)
        print(f"{name}: sglang.service exposure {scores['sglang.service']}")


def test_prometheus_scrapes_the_servers_over_tls(fleet):
    """Prometheus on the router host scrapes each server through its gate over https,
    verifying with the fleet CA (its own host's through the gate at the loopback)."""
    from tests.e2e.test_observability import GET, PASSWORD_FILE
    hosts, _, _, _ = fleet
    router = hosts[ROUTER_HOST]
    deadline = time.monotonic() + 120
    while True:
        out = router.ssh(f"cd / && python3 - 'http://127.0.0.1:9090/api/v1/targets' "
                         f"{PASSWORD_FILE} <<'EOF'\n{GET}EOF")
        status, _, body = out.partition("\n")
        assert status.strip() == "200", out[-2000:]
        seen = {t["labels"]["host"]: (t["health"], t["scrapeUrl"], t["lastError"])
                for t in json.loads(body)["data"]["activeTargets"]
                if t["labels"]["job"] == "sglang"}
        if sorted(seen) == ["gpu1", "gpu2", "gpu3"] and all(
                health == "up" for health, _, _ in seen.values()):
            break
        assert time.monotonic() < deadline, seen
        time.sleep(5)
    assert all(url.startswith("https://") for _, url, _ in seen.values()), seen


def test_an_expiring_certificate_is_issued_again_and_the_gate_reloads(fleet):
    """gpu2's certificate, from the fleet CA but expiring in 10 days, put by hand: the next
    converge issues it again, the gate serves the new one, and neither the server nor the gate
    restarted (a reload)."""
    from operations.stages import tls
    hosts, _, ca_files, inventory = fleet
    gpu2, client, addresses = hosts["gpu2"], hosts[CLIENT_HOST], switch()
    ca = tls.load_ca(*ca_files)
    current = gpu2.ssh(f"sed -n '/BEGIN CERTIFICATE/,/END CERTIFICATE/p' {HOST_PEM}")
    names = tls.subject_names("gpu2", lab_settings("gpu2", ca_files))
    assert tls.reason_to_issue(current, ca, names) is None
    then = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=355)
    expiring = tls.issue(ca, "gpu2", names, now=then)
    gpu2.ssh(f"umask 077; cat > {HOST_PEM}.new <<'EOF'\n{expiring}EOF\nmv {HOST_PEM}.new {HOST_PEM}")
    server, gate = gpu2.main_pid("sglang.service"), gpu2.main_pid("sglang-gate.service")
    deadline = time.monotonic() + 30  # the path unit reloads the gate on the file's change
    old = served_fingerprint(client, addresses["gpu2"], 8000)
    while old == served_fingerprint(client, addresses["gpu2"], 8000) and \
            time.monotonic() < deadline:
        time.sleep(1)
    run = lab.deploy(inventory=inventory)
    assert run.returncode == 0, run.output[-6000:]
    assert "[gpu2] TLS certificate: the host's certificate expires on" in run.output and \
        "within 30 days: issued again by the fleet CA" in run.output, run.output[-6000:]
    for other in ("gpu1", "gpu3"):
        assert f"[{other}] TLS certificate:" not in run.output, other
    new = gpu2.ssh(f"sed -n '/BEGIN CERTIFICATE/,/END CERTIFICATE/p' {HOST_PEM}")
    assert tls.reason_to_issue(new, ca, names) is None
    deadline = time.monotonic() + 30
    while served_fingerprint(client, addresses["gpu2"], 8000) != \
            tls.fingerprint(new).replace(":", "").lower():
        assert time.monotonic() < deadline, "the gate still serves the old certificate"
        time.sleep(1)
    assert (gpu2.main_pid("sglang.service"), gpu2.main_pid("sglang-gate.service")) == \
        (server, gate)
    assert probe(client, f"https://{addresses['gpu2']}:8000/v1/models",
                 key=lab.API_KEY_FILE) == (200, "ok")


def lab_settings(name: str, ca_files: tuple[str, str]):
    from operations.plans.settings import for_inventory
    (h,) = [h for h in json.loads(lab.sandbox("status", "--json").stdout) if h["name"] == name]
    data = lab.fleet_data(h, router=name == ROUTER_HOST)
    data.update(gpuhost_tls_ca_cert_file=ca_files[0], gpuhost_tls_ca_key_file=ca_files[1])
    return for_inventory([(name, data)])[name]


def test_a_second_run_issues_nothing(fleet):
    hosts, _, _, inventory = fleet
    gates = {n: h.main_pid("sglang-gate.service") for n, h in hosts.items()}
    run = lab.deploy("--json", inventory=inventory)
    assert run.returncode == 0, run.output[-6000:]
    assert "TLS certificate:" not in run.output, run.output[-6000:]
    assert {n: h.main_pid("sglang-gate.service") for n, h in hosts.items()} == gates


def test_a_hosts_own_certificate_is_served_and_a_readable_key_refused(fleet, tmp_path):
    """gpu3 brings a certificate of its own (the operator's PKI: made with openssl from the
    same CA, a key and a CSR signed with ``openssl x509 -req``), named in host data: a key
    others may read is refused while planning; root-only, the gate serves that certificate
    and the router reaches gpu3 through it."""
    hosts, _, ca, _ = fleet
    gpu3, client, addresses = hosts["gpu3"], hosts[CLIENT_HOST], switch()
    key, csr, cert = tmp_path / "gpu3.key", tmp_path / "gpu3.csr", tmp_path / "gpu3.crt"
    (tmp_path / "ext").write_text(f"subjectAltName=IP:{addresses['gpu3']},DNS:gpu3\n"
                                  "basicConstraints=critical,CA:FALSE\n"
                                  "extendedKeyUsage=serverAuth\n")
    subprocess.run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-noenc", "-subj", "/CN=gpu3", "-keyout", str(key),
                    "-out", str(csr)], check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", ca[0], "-CAkey", ca[1],
                    "-set_serial", "4242", "-days", "60", "-extfile", str(tmp_path / "ext"),
                    "-out", str(cert)], check=True, capture_output=True)
    gpu3.ssh(f"mkdir -p /etc/ssl/gpuhost && cat > /etc/ssl/gpuhost/gpu3.crt <<'EOF'\n"
             f"{cert.read_text()}EOF\n(umask 022; cat > /etc/ssl/gpuhost/gpu3.key <<'EOF'\n"
             f"{key.read_text()}EOF\n)")
    own = {"gpuhost_tls_cert_file": "/etc/ssl/gpuhost/gpu3.crt",
           "gpuhost_tls_key_file": "/etc/ssl/gpuhost/gpu3.key"}
    inventory = write_inventory(tmp_path / "own.py", ca, hosts_extra={"gpu3": own})
    refused = lab.deploy("--dry", inventory=inventory)
    assert refused.returncode != 0
    assert "[gpu3] TLS: refused: gpuhost_tls_key_file = '/etc/ssl/gpuhost/gpu3.key' is not " \
        "allowed: a root-only file (mode 0600, owner root; it is 644, owner root)" in \
        refused.output, refused.output[-6000:]
    gpu3.ssh("chmod 600 /etc/ssl/gpuhost/gpu3.key")
    run = lab.deploy(inventory=inventory)
    assert run.returncode == 0, run.output[-6000:]
    from operations.stages import tls
    wanted = tls.fingerprint(cert.read_text()).replace(":", "").lower()
    deadline = time.monotonic() + 30
    while served_fingerprint(client, addresses["gpu3"], 8000) != wanted:
        assert time.monotonic() < deadline, "gpu3's gate does not serve its own certificate"
        time.sleep(1)
    assert probe(client, f"https://{addresses['gpu3']}:8000/v1/models",
                 key=lab.API_KEY_FILE) == (200, "ok")
    urls = json.loads(hosts[ROUTER_HOST].ssh("python3 /root/workers.py"))
    assert f"https://{addresses['gpu3']}:8000" in urls, urls


def test_a_roll_behind_the_tls_router_drops_no_request(fleet, tmp_path):
    hosts, _, ca, _ = fleet
    client, addresses = hosts[CLIENT_HOST], switch()
    inventory = write_inventory(tmp_path / "rolled.py", ca, ROLLED)
    before = {n: h.main_pid("sglang.service") for n, h in hosts.items()}
    url = f"https://{addresses[ROUTER_HOST]}:8100"
    client.ssh(f"rm -f /tmp/client.stop /tmp/client.out; nohup python3 /root/client.py {url} "
               f"/root/fleet-ca.crt /root/client.key {ROLL_REQUESTS} 1800 {CLIENT_THREADS} "
               f"{PAUSE_S} > /tmp/client.out 2>&1 < /dev/null &")
    try:
        time.sleep(3)
        run = lab.deploy(inventory=inventory)
        assert run.returncode == 0, run.output[-8000:]
        assert "Roll: servers restart 1 at a time" in run.output, run.output[-6000:]
    finally:
        client.ssh("touch /tmp/client.stop")
        deadline = time.monotonic() + 1200  # the client sends its 3000 before it stops
        while not client.ssh("cat /tmp/client.out", check=False).strip():
            assert time.monotonic() < deadline
            time.sleep(2)
    result = json.loads(client.ssh("cat /tmp/client.out").strip().splitlines()[-1])
    print(f"\nthrough the TLS router while 3 servers rolled: {result['requests']} requests "
          f"({result['during_deploy']} of them during the deploy), {result['failed']} failed, "
          f"{result['seconds']} s, {CLIENT_THREADS} clients at once; errors: {result['errors']}")
    assert result["failed"] == 0 and result["during_deploy"] >= ROLL_REQUESTS, result
    after = {n: h.main_pid("sglang.service") for n, h in hosts.items()}
    assert all(after[n] != before[n] for n in before), (before, after)
