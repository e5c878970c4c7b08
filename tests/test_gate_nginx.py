"""The rendered gate configuration (templates/gate-nginx.conf.j2) run by Debian 12's nginx
(bin/setup puts its program in .venv/bin) on this machine's loopback, in front of a backend that
records every request line it gets: what a stranger's query string, key and health flood do,
decided by nginx itself. The keys' include is gate_keys.py's; the certificate the fleet CA's
(operations/stages/tls.py issue)."""

from __future__ import annotations

import dataclasses
import http.client
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jinja2
import pytest

from operations.plans.settings import from_host_data
from operations.stages import gate, tls
from operations.stages.server_unit import worker_gate

ROOT = Path(__file__).resolve().parent.parent
NGINX = ROOT / ".venv" / "bin" / "nginx"
KEY = "sk-test-gate-key-0123456789"
pytestmark = pytest.mark.skipif(not NGINX.exists(), reason="bin/setup puts nginx in .venv/bin")


class Backend(BaseHTTPRequestHandler):
    """The server behind the gate: 200 to everything, each request line kept."""

    protocol_version = "HTTP/1.1"
    seen: list[str] = []

    def do_GET(self):
        Backend.seen.append(f"{self.command} {self.path}")
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gate_url(tmp_path_factory):
    work = tmp_path_factory.mktemp("gate")
    backend = ThreadingHTTPServer(("127.0.0.1", 0), Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    ca_cert, ca_key = work / "ca.crt", work / "ca.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-noenc", "-days", "400", "-subj", "/CN=test CA",
                    "-addext", "basicConstraints=critical,CA:TRUE", "-addext",
                    "keyUsage=critical,keyCertSign,cRLSign", "-keyout", str(ca_key), "-out",
                    str(ca_cert)], check=True, capture_output=True)
    pem = work / "host.pem"
    pem.write_text(tls.issue(tls.load_ca(str(ca_cert), str(ca_key)), "gpu1", ("127.0.0.1",)))
    pem.chmod(0o600)
    key_file = work / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    port = free_port()
    # the GPU readings' file where nginx's workers (nobody, here) can look: /run/<dir> 0755
    run_dir = Path(tempfile.mkdtemp(prefix="gpuhost-gate-test-"))
    run_dir.chmod(0o755)
    s = from_host_data("gpu1", {"gpuhost_server_host": "127.0.0.1",
                                "gpuhost_api_key_file": "/root/k"})
    g = dataclasses.replace(worker_gate(s), listen_port=port, tls_cert=str(pem),
                            tls_key=str(pem), failed_file=str(run_dir / "gpus-failed"),
                            backend_url=f"http://127.0.0.1:{backend.server_address[1]}")
    # the temporary files under the work folder (the unit's CacheDirectory= on a host)
    context = {**gate.conf_context(g), "keys_file": str(work / "gate.keys"),
               "pid_file": str(work / "nginx.pid"), "temp_dir": str(work)}
    conf = jinja2.Environment(loader=jinja2.FileSystemLoader(ROOT / "templates")).get_template(
        "gate-nginx.conf.j2").render(**context)
    # here: no user to switch to, the gate's own log in a file (not this machine's journal)
    conf = re.sub(r"^user .*;$", "", conf, flags=re.M)
    conf, n = re.subn(r"access_log syslog:\S+ gpuhost;",
                      f"access_log {work}/access.log gpuhost;", conf)
    assert n == 1
    (work / "gate.conf").write_text(conf)
    subprocess.run([sys.executable, str(ROOT / "operations/files/gate_keys.py"), "--out",
                    str(work / "gate.keys"), "--key-file", str(key_file)], check=True)
    run = subprocess.Popen([str(NGINX), "-p", str(work), "-e", "stderr", "-c",
                            str(work / "gate.conf"), "-g", "daemon off;"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert run.poll() is None, run.stdout.read()
            assert time.monotonic() < deadline, "nginx does not listen"
            time.sleep(0.1)
    yield port, str(ca_cert), work, run_dir
    run.terminate()
    run.wait(10)
    backend.shutdown()
    shutil.rmtree(run_dir)


def get(gate_url, path: str, key: str | None = None) -> int:
    port, ca = gate_url[:2]
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10,
                                       context=ssl.create_default_context(cafile=ca))
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    status = conn.getresponse().status
    conn.close()
    return status


def test_a_key_in_a_query_string_never_reaches_the_server(gate_url):
    Backend.seen.clear()
    for path, key in (("/v1/models?api_key=" + KEY, None), ("/v1/models?key=" + KEY, None),
                      ("/v1/models?api_key=" + KEY, KEY), ("/health?key=" + KEY, None),
                      ("/health_generate?api_key=" + KEY, None), ("/v1/models?", KEY),
                      ("/v1/models?x=1", KEY), ("/v1/loads?include=core", KEY),
                      ("/v1/loads?include=core,disagg,queues,memory&key=" + KEY, KEY)):
        assert get(gate_url, path, key) == 400, path
    assert Backend.seen == []
    # the router's own load query, byte for byte, with its key: the path alone passes
    assert get(gate_url, gate.ROUTER_QUERIES[0]) == 401
    assert get(gate_url, gate.ROUTER_QUERIES[0], KEY) == 200
    assert Backend.seen == ["GET /v1/loads"]
    # and the gate's own log keeps no query
    log = (gate_url[2] / "access.log").read_text()
    assert '"GET /v1/models" 400' in log and KEY not in log and "?" not in log


def test_health_generate_needs_the_key_and_a_keyless_health_flood_is_cut(gate_url):
    Backend.seen.clear()
    assert [get(gate_url, "/health_generate") for _ in range(3)] == [401] * 3
    assert Backend.seen == []
    assert get(gate_url, "/health_generate", KEY) == 200
    Backend.seen.clear()
    began = time.monotonic()
    answers = [get(gate_url, "/health") for _ in range(40)]
    seconds, reached = time.monotonic() - began, len(Backend.seen)
    print(f"\nkeyless /health flood: {reached} of 40 reached the server in {seconds:.1f} s, "
          f"{answers.count(429)} answered 429")
    # the burst and what the rate refilled in the flood's time, no more
    allowed = gate.HEALTH_BURST + 1 + int(seconds * gate.HEALTH_RATE)
    assert gate.HEALTH_BURST + 1 <= reached <= allowed, answers
    assert answers.count(429) == 40 - reached
    # with the key (the router's checks): not counted
    assert [get(gate_url, "/health", KEY) for _ in range(20)] == [200] * 20


def test_while_the_gpus_failed_health_answers_503_and_the_rest_is_served(gate_url):
    """The GPU readings unit's file (operations/plans/gpu_verdict.py FAILED_FILE): while it exists,
    /health (the router's health check, with the key or without) is 503 and never reaches the
    server; the inference paths are served; once it is gone, /health passes again."""
    failed = gate_url[3] / "gpus-failed"
    time.sleep(1.1)  # the keyless /health limit of the tests before
    assert get(gate_url, "/health", KEY) == 200
    failed.write_text("failed: Xid 79 (the GPU fell off the bus) x1 on GPU 7: reboot the host\n")
    try:
        Backend.seen.clear()
        assert get(gate_url, "/health", KEY) == 503
        assert get(gate_url, "/health") == 503
        assert get(gate_url, "/v1/models", KEY) == 200
        assert get(gate_url, "/health_generate", KEY) == 200
        assert Backend.seen == ["GET /v1/models", "GET /health_generate"]
    finally:
        failed.unlink()
    assert get(gate_url, "/health", KEY) == 200


def test_the_gate_speaks_tls_1_2_and_1_3_with_mozillas_suites_and_curves(gate_url):
    port, ca = gate_url[:2]

    def handshake(**options) -> str | None:
        context = ssl.create_default_context(cafile=ca)
        for name, value in options.items():
            if name == "ciphers":
                context.set_ciphers(value)
            else:
                setattr(context, name, value)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                    context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                return f"{s.version()} {s.cipher()[0]}"
        except ssl.SSLError:
            return None

    assert handshake() == "TLSv1.3 TLS_AES_256_GCM_SHA384"
    assert handshake(maximum_version=ssl.TLSVersion.TLSv1_2) == \
        "TLSv1.2 ECDHE-ECDSA-AES256-GCM-SHA384"
    for cbc in ("ECDHE-ECDSA-AES128-SHA", "ECDHE-ECDSA-AES256-SHA384",
                "ECDHE-ECDSA-AES128-CCM8", "ECDHE-ECDSA-CAMELLIA256-SHA384"):
        assert handshake(maximum_version=ssl.TLSVersion.TLSv1_2, ciphers=cbc) is None, cbc
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    with warnings.catch_warnings():  # a TLS 1.1 client, as an old one would try
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version = context.maximum_version = ssl.TLSVersion.TLSv1_1
    context.set_ciphers("ALL:@SECLEVEL=0")
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with pytest.raises(ssl.SSLError):
            context.wrap_socket(raw)
    # the curves: X448 and secp521r1 refused (openssl's client names the group alone)
    for group, answered in (("X448", False), ("secp521r1", False), ("X25519", True),
                            ("prime256v1", True), ("secp384r1", True)):
        run = subprocess.run(["openssl", "s_client", "-connect", f"127.0.0.1:{port}",
                              "-groups", group, "-CAfile", ca, "-brief"], input="",
                             capture_output=True, text=True, timeout=20)
        assert (run.returncode == 0) == answered, (group, run.stdout + run.stderr)


def test_sslyze_grades_the_rendered_gate_mozillas_intermediate(gate_url):
    """sslyze's own check (``--mozilla_config=intermediate``: Mozilla's guideline 5.7, its
    sslyze/mozilla_tls_profile/5.7.json) against the gate as rendered; the sandbox's gates get
    the same in tests/e2e/test_tls.py."""
    port, ca = gate_url[:2]
    run = subprocess.run([sys.executable, "-m", "sslyze", "--mozilla_config=intermediate",
                          "--resum", f"--certinfo_ca_file={ca}", f"127.0.0.1:{port}"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and f"127.0.0.1:{port}: OK - Compliant." in run.stdout, \
        run.stdout[-3000:] + run.stderr[-2000:]
    # no session tickets (Mozilla's nginx configuration; its compliance check leaves them out)
    assert "With TLS Tickets: NOT SUPPORTED" in run.stdout, run.stdout[-3000:]
    # what it read: the ECDSA certificate's three TLS 1.2 suites, TLS 1.3's three, no older TLS
    tls12 = run.stdout.split("* TLS 1.2 Cipher Suites:")[1].split("* TLS 1.3")[0]
    assert sorted(re.findall(r"^\s+(TLS_\w+)\s", tls12, re.M)) == [
        "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256", "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
        "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256"], tls12
    tls13 = run.stdout.split("* TLS 1.3 Cipher Suites:")[1].split("\n *")[0]
    assert sorted(re.findall(r"^\s+(TLS_\w+)\s", tls13, re.M)) == [
        "TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"], tls13
    for old in ("SSL 2.0", "SSL 3.0", "TLS 1.0", "TLS 1.1"):
        section = run.stdout.split(f"* {old} Cipher Suites:")[1].split("* ")[0]
        assert "the server rejected all cipher suites" in section, (old, section)
