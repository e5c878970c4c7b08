"""The fleet's planes, end to end (issue 29 findings 1 and 2): two serving hosts (gpu1, gpu2)
behind their gates on the lab switch and a CPU-only router host (gpu3) running the real router
(smg 1.13.0), tried as an attacker on the fleet network and as a local user (``nobody``) of
every host would. The fleet is tests/e2e/fleets.py's ``cpu_router_fleet``, which
test_observability.py's tests take on after these (one pytest process, tests/lanes.py).

- The client key reaches the inference paths only: no control-plane path answers it 2xx, on
  the router's public port or on any other port of the router host.
- ``nobody`` on any host gets no 2xx from ``/workers`` on any port listening there, and no
  completion from any worker (its gate, its server behind it, the router's own port).
- A worker the deploy did not configure (added with the control key, as an attacker holding it
  would) is removed by the next converge, which says so.
- No key on any command line, in any unit file or in the journal.

Each check fails on main before this change: the router's gate passed ``/workers`` with the
client key (202), smg's loopback port answered ``nobody`` without a key, the workers' gates
trusted the router host's address (``nobody`` there got completions) and the servers' loopback
ports answered every local user.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e import lab
from tests.e2e.fleets import CPU_ROUTER_HOST, write_inventory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROUTER_KEY_FILE = "/root/router-api.key"
FLEET_KEY_FILE = "/root/fleet.key"
CONTROL_KEY_FILE = "/etc/gpuhost/router-control.key"
ROUTER_HOST = CPU_ROUTER_HOST
#: The tests' own scripts on each host, readable by nobody (/tmp is emptied when a host reboots
#: for its driver)
SCRIPTS = "/usr/local/lib/planes"
CHAT = json.dumps({"model": "glm-5", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 4})

#: One HTTP request, its status on stdout (or ERR and why): run as root or as nobody.
PROBE = r"""
import json, sys, urllib.error, urllib.request
url, method, key_file = sys.argv[1], sys.argv[2], sys.argv[3]
body = sys.argv[4].encode() if len(sys.argv) > 4 else None
headers = {"content-type": "application/json"}
if key_file != "-":
    headers["Authorization"] = "Bearer " + open(key_file).read().strip()
try:
    with urllib.request.urlopen(urllib.request.Request(url, body, headers, method=method),
                                timeout=15) as answer:
        page = answer.read(65536)
        # Debian's prometheus-node-exporter answers its own landing page for every path
        print(answer.status, "node-exporter-page" if b"Node Exporter" in page else "")
except urllib.error.HTTPError as exc:
    print(exc.code)
except Exception as exc:
    print("ERR", type(exc).__name__)
"""

#: A worker gpuhost did not configure (an attacker's): answers what smg asks at registration.
FOREIGN = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
ANSWERS = {"/v1/models": {"object": "list", "data": [{"id": "glm-5", "object": "model"}]},
           "/server_info": {"model_path": "m", "served_model_name": "glm-5", "dp_size": 1},
           "/model_info": {"model_path": "m", "is_generation": True}}
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        body = json.dumps(ANSWERS.get(self.path.split("?")[0], {})).encode()
        self.send_response(200); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    do_POST = do_GET
ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()
"""

#: The router's worker URLs, read on its loopback with the control key (root only).
WORKERS = r"""
import json, urllib.request as u
key = open("/etc/gpuhost/router-control.key").read().strip()
r = u.Request("http://127.0.0.1:30100/workers", headers={"Authorization": "Bearer " + key})
print(json.dumps(sorted(w["url"] for w in json.load(u.urlopen(r, timeout=10))["workers"])))
"""

#: Every TCP port listening on the host, with the addresses it listens on (/proc/net/tcp[6]).
LISTENING = r"""
import json, socket
found = {}
for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
    for line in open("/proc/net/" + name).read().splitlines()[1:]:
        f = line.split()
        if f[3] != "0A":
            continue
        hexaddr, hexport = f[1].split(":")
        raw = bytes.fromhex(hexaddr)
        if family == socket.AF_INET:
            raw = raw[::-1]
        else:
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        found.setdefault(int(hexport, 16), []).append(socket.inet_ntop(family, raw))
print(json.dumps(found))
"""


#: A keyless client holding slow request heads (sends a header line a second, never ends).
SLOW = r"""
import socket, sys, time
host, port, count, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
held = []
for _ in range(count):
    try:
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        held.append(s)
    except OSError:
        pass
print(len(held), flush=True)
end = time.monotonic() + hold
while time.monotonic() < end:
    for s in held:
        try:
            s.sendall(b"X-Slow: 1\r\n")
        except OSError:
            pass
    time.sleep(1)
"""


@pytest.fixture(scope="module")
def fleet(cpu_router_fleet):
    """The run's fleet of two serving hosts and a CPU-only router (tests/e2e/fleets.py),
    shared with test_observability.py, whose tests follow these in the same process
    (tests/lanes.py), with this module's scripts on every host."""
    for h in cpu_router_fleet.hosts.values():
        # beside the system's programs (/tmp is emptied when a host reboots for its driver),
        # readable by nobody
        # mode 0755: the hosts' root umask is 077, and nobody runs these
        h.ssh(f"mkdir -p {SCRIPTS} && chmod 755 {SCRIPTS} && chmod 755 $(dirname {SCRIPTS}); "
              f"cat > /root/workers.py <<'EOF'\n{WORKERS}\nEOF")
        for name, text in (("probe", PROBE), ("foreign", FOREIGN), ("slow", SLOW)):
            h.ssh(f"cat > {SCRIPTS}/{name}.py <<'EOF'\n{text}\nEOF\nchmod 644 {SCRIPTS}/{name}.py")
    return cpu_router_fleet


def probe(h, url: str, method: str = "GET", key_file: str = "-", body: str | None = None,
          user: str | None = None) -> str:
    run = f"runuser -u {user} -- " if user else ""
    # nobody cannot read root's key files: a key it is given comes through a file of its own
    arg = f" '{body}'" if body else ""
    return h.ssh(f"{run}python3 {SCRIPTS}/probe.py {url} {method} {key_file}{arg}").strip()


def listening(h) -> dict[int, list[str]]:
    return {int(p): a for p, a in json.loads(h.ssh(f"python3 -c '{LISTENING}'")).items()}


def urls(h) -> list[str]:
    """http://ADDRESS:PORT of every TCP listener of ``h`` but sshd's (a wildcard listener at
    the loopback and at the host's switch address)."""
    out = []
    for port, addresses in sorted(listening(h).items()):
        if port == 22:
            continue
        for address in addresses:
            if address in ("0.0.0.0", "::"):
                out += [f"http://127.0.0.1:{port}", f"http://[::1]:{port}"]
            else:
                out.append(f"http://[{address}]:{port}" if ":" in address
                           else f"http://{address}:{port}")
    return sorted(set(out))


def two_xx(status: str) -> bool:
    """A 2xx answer from the port's own service; the node exporter's landing page, which it
    answers for every path ("200 node-exporter-page", the probe), is neither the router's
    workers nor a completion (its metrics carry no credential yet: docs/observability.md)."""
    return status.isdigit() and 200 <= int(status) < 300


def test_the_client_key_reaches_inference_through_the_router(fleet):
    router = fleet.hosts[ROUTER_HOST]
    url = f"http://{fleet.switch[ROUTER_HOST]}:8100"
    assert probe(router, f"{url}/v1/chat/completions", "POST", ROUTER_KEY_FILE, CHAT) == "200"
    assert probe(router, f"{url}/v1/models", "GET", ROUTER_KEY_FILE) == "200"
    assert probe(router, f"{url}/v1/chat/completions", "POST", "-", CHAT) == "401"


CONTROL_PATHS = [("GET", "/workers", None), ("POST", "/workers", '{"url": "http://10.9.9.9:8999"}'),
                 ("GET", "/workers/x", None), ("DELETE", "/workers/x", None),
                 ("PUT", "/workers/x", "{}"), ("GET", "/v1/tokenizers", None),
                 ("POST", "/flush_cache", None), ("GET", "/wasm", None)]


def test_the_client_key_gets_no_2xx_from_any_control_plane_path(fleet):
    router = fleet.hosts[ROUTER_HOST]
    answers = {}
    for base in urls(router):
        for method, path, body in CONTROL_PATHS:
            answers[f"{method} {base}{path}"] = probe(router, base + path, method,
                                                      ROUTER_KEY_FILE, body)
    assert f"GET http://{fleet.switch[ROUTER_HOST]}:8100/workers" in answers
    assert not {k: v for k, v in answers.items() if two_xx(v)}, answers
    # the deploy's own key does reach it, on the router's loopback only
    assert probe(router, "http://127.0.0.1:30100/workers", "GET", CONTROL_KEY_FILE) == "200"
    assert router.ssh(f"stat -c '%U %a' {CONTROL_KEY_FILE}").split() == ["root", "600"]


def test_nobody_on_any_host_gets_no_2xx_from_workers_on_any_listening_port(fleet):
    answers = {}
    for h in fleet.hosts.values():
        everywhere = sorted({u for other in fleet.hosts.values() for u in urls(other)
                             if "127.0.0.1" not in u and "[::1]" not in u} | set(urls(h)))
        for base in everywhere:
            answers[f"{h.name}: {base}/workers"] = probe(h, f"{base}/workers", user="nobody")
    assert any(":30100" in k for k in answers), answers  # smg's own port was tried
    assert not {k: v for k, v in answers.items() if two_xx(v)}, answers


def test_nobody_on_any_host_gets_no_completion_from_any_worker(fleet):
    answers = {}
    for h in fleet.hosts.values():
        targets = set(urls(h)) | {f"http://{fleet.switch[n]}:8000" for n in ("gpu1", "gpu2")}
        for base in sorted(targets):
            for path in ("/v1/chat/completions", "/generate"):
                body = CHAT if path.startswith("/v1") else '{"text": "hi"}'
                answers[f"{h.name}: {base}{path}"] = probe(h, base + path, "POST", body=body,
                                                           user="nobody")
    assert "gpu1: http://127.0.0.1:30000/v1/chat/completions" in answers, answers
    assert not {k: v for k, v in answers.items() if two_xx(v)}, answers
    # root's processes still reach the server behind the gate (the health gate, the router)
    assert probe(fleet.hosts["gpu1"], "http://127.0.0.1:30000/v1/chat/completions", "POST",
                 body=CHAT) == "200"


def router_workers(router) -> list[str]:
    return json.loads(router.ssh("python3 /root/workers.py"))


def test_a_converge_removes_a_worker_it_did_not_configure_and_says_so(fleet):
    """Issue 29 finding 1: an attacker's worker stayed in after the next converge."""
    router = fleet.hosts[ROUTER_HOST]
    foreign = f"http://{fleet.switch[ROUTER_HOST]}:8999"
    router.ssh(f"systemd-run --unit foreign-worker --uid nobody python3 {SCRIPTS}/foreign.py "
               f"{fleet.switch[ROUTER_HOST]} 8999")
    try:
        add = ("import json, urllib.request as u; k = open('/etc/gpuhost/router-control.key')"
               ".read().strip(); r = u.Request('http://127.0.0.1:30100/workers', json.dumps("
               f"{{'url': '{foreign}'}}).encode(), {{'Authorization': 'Bearer ' + k, "
               "'content-type': 'application/json'}, method='POST'); "
               "print(u.urlopen(r, timeout=10).status)")
        assert router.ssh(f'python3 -c "{add}"').strip() == "202"
        deadline = time.monotonic() + 60
        while foreign not in router_workers(router):
            assert time.monotonic() < deadline, router_workers(router)
            time.sleep(1)
        run = lab.deploy(inventory=fleet.inventory)
        # the router host's own lines first: its failure would be far above the summary
        router_lines = "\n".join(line for line in run.output.splitlines()
                                 if f"[{ROUTER_HOST}]" in line)
        assert run.returncode == 0, router_lines[-6000:]
        assert f"removed {foreign}, which gpuhost did not configure" in run.output, \
            router_lines[-4000:]
        deadline = time.monotonic() + 60  # drained, then gone
        while foreign in router_workers(router):
            assert time.monotonic() < deadline, router_workers(router)
            time.sleep(1)
        assert router_workers(router) == sorted(f"http://{fleet.switch[n]}:8000"
                                                for n in ("gpu1", "gpu2"))
    finally:
        router.ssh("systemctl stop foreign-worker", check=False)


def test_a_refused_worker_keeps_its_router_entry_and_the_router_is_not_rewritten(fleet,
                                                                              tmp_path):
    """Issue 30 finding 4: with gpuhost_server_port = 22 both workers were refused, yet the
    router's unit got their :22 URLs, its list emptied and every client got 404."""
    router = fleet.hosts[ROUTER_HOST]
    before = router_workers(router)
    unit = router.ssh("md5sum /etc/systemd/system/sglang-router.service "
                      "/etc/gpuhost/router-workers.json")
    pid = router.main_pid("sglang-router.service")
    inventory = write_inventory(tmp_path / "port22.py", {"gpuhost_server_port": 22})
    run = lab.deploy(inventory=inventory)
    assert run.returncode != 0, run.output[-4000:]
    assert router_workers(router) == before
    assert router.ssh("md5sum /etc/systemd/system/sglang-router.service "
                      "/etc/gpuhost/router-workers.json") == unit
    assert router.main_pid("sglang-router.service") == pid
    url = f"http://{fleet.switch[ROUTER_HOST]}:8100"
    assert probe(router, f"{url}/v1/chat/completions", "POST", ROUTER_KEY_FILE, CHAT) == "200"


def test_the_fleet_shrinks_and_grows_under_traffic_without_a_restart_or_a_failed_request(
        fleet, tmp_path):
    """Issue 30 finding 6: adding a host restarted the router (11 of 344 requests failed).
    Membership now changes through the control plane: a worker leaves drained, one joins once
    healthy, and the router's process stays the same."""
    from tests.e2e.test_router import CLIENT

    router = fleet.hosts[ROUTER_HOST]
    pid = router.main_pid("sglang-router.service")
    url = f"http://{fleet.switch[ROUTER_HOST]}:8100"
    key = fleet.keys["router API key"]
    router.ssh(f"rm -f /tmp/client.stop /tmp/client.out; cat > /tmp/client.py <<'EOF'\n{CLIENT}\n"
               f"EOF\nnohup python3 /tmp/client.py {url} {key} 100000 900 0.02 "
               "> /tmp/client.out 2>&1 &")
    try:
        shrunk = lab.deploy(inventory=write_inventory(tmp_path / "small.py", leave_out=("gpu2",)))
        assert shrunk.returncode == 0, shrunk.output[-4000:]
        gpu2 = f"http://{fleet.switch['gpu2']}:8000"
        assert f"removed {gpu2}, which gpuhost did not configure" in shrunk.output
        deadline = time.monotonic() + 60
        while gpu2 in router_workers(router):
            assert time.monotonic() < deadline
            time.sleep(1)
        grown = lab.deploy(inventory=fleet.inventory)
        assert grown.returncode == 0, grown.output[-4000:]
        assert router_workers(router) == sorted(f"http://{fleet.switch[n]}:8000"
                                                for n in ("gpu1", "gpu2"))
    finally:
        router.ssh("touch /tmp/client.stop")
        deadline = time.monotonic() + 60
        while not router.ssh("cat /tmp/client.out", check=False).strip():
            assert time.monotonic() < deadline
            time.sleep(1)
    result = json.loads(router.ssh("cat /tmp/client.out").strip().splitlines()[-1])
    assert result["failed"] == 0 and result["ok"] >= 100, result
    assert router.main_pid("sglang-router.service") == pid


def test_a_keyless_slow_client_does_not_deny_a_keyed_one(fleet):
    """Issue 29 finding 3: 300 slow request heads from one keyless client made a gate answer
    503 to a client with the key, six times in a row."""
    attacker, router = fleet.hosts["gpu2"], fleet.hosts[ROUTER_HOST]
    began = time.monotonic()
    attacker.ssh(f"systemd-run --unit slow-client --uid nobody python3 {SCRIPTS}/slow.py "
                 f"{fleet.switch['gpu1']} 8000 300 40")
    try:
        time.sleep(8)
        gate = f"http://{fleet.switch['gpu1']}:8000/v1/chat/completions"
        via_router = f"http://{fleet.switch[ROUTER_HOST]}:8100/v1/chat/completions"
        answers = [probe(router, gate, "POST", FLEET_KEY_FILE, CHAT) for _ in range(6)]
        answers += [probe(router, via_router, "POST", ROUTER_KEY_FILE, CHAT) for _ in range(6)]
        assert answers == ["200"] * 12, answers
        # nginx holds the slow heads without a thread each and closes them once the head took
        # longer than client_header_timeout (20 s), while the client still holds them (40 s)
        time.sleep(max(0.0, 26 - (time.monotonic() - began)))
        held = fleet.hosts["gpu1"].ssh(
            "ss -Htn state established '( sport = :8000 )' "
            f"dst {fleet.switch['gpu2']} | wc -l").strip()
        assert held == "0", held
    finally:
        attacker.ssh("systemctl stop slow-client", check=False)


def test_no_key_on_a_command_line_in_a_unit_or_in_the_journal(fleet):
    for h in fleet.hosts.values():
        seen = h.ssh("ps -eo args; cat /etc/systemd/system/sglang*.service; "
                     "journalctl --no-pager -o cat 2>/dev/null | tail -n 20000")
        control = h.ssh(f"cat {CONTROL_KEY_FILE} 2>/dev/null || true").strip()
        if control:
            lab.GUARD.register(control, "control key")
        for what, value in [*fleet.keys.items(), ("control key", control)]:
            assert not value or value not in seen, f"{what} seen on {h.name}"
