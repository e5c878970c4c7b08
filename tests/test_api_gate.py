"""The API key gate (operations/files/api_gate.py) as a process on 127.0.0.1 in front of a
fake server on the loopback, attacked through real sockets: bodies without the key, huge and
malformed Content-Lengths, slow and idle clients, too many connections, a key file that
vanishes or goes bad, a key in the query string. Every refusal is an HTTP answer, the journal
(the gate's stderr) gets no traceback and no secret."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from tests.secret_guard import GUARD

FILES = Path(__file__).resolve().parent.parent / "operations" / "files"
KEY = GUARD.register("sk-gate-test-" + "9f" * 12, "API key (test)")
QUERY_KEY = GUARD.register("sk-in-the-query-" + "7e" * 10, "API key (test)")


class Backend(BaseHTTPRequestHandler):
    """The server behind the gate: records what reaches it, answers JSON (or a stream)."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[dict]] = []

    def log_message(self, *a):
        pass

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        Backend.seen.append({"path": self.path, "bytes": len(body),
                             "auth": self.headers.get("Authorization")})
        if self.path.startswith("/stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                data = f"data: {i}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return
        answer = {"path": self.path, "bytes": len(body)}
        if self.path.startswith("/get_server_info"):
            answer.update(api_key=KEY, admin_api_key=None)
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer


@pytest.fixture(scope="module")
def backend():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Backend)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gate:
    def __init__(self, proc: subprocess.Popen, port: int, key_file: Path, log_file: Path):
        self.proc, self.port, self.key_file, self.log_file = proc, port, key_file, log_file

    def log(self) -> str:
        text = self.log_file.read_text()
        GUARD.observe("api_gate.py's journal", text)
        return text

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def connect(self, timeout: float = 5.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def request(self, raw: bytes, timeout: float = 5.0) -> tuple[int, bytes]:
        """Send ``raw`` on a new connection; (status, the whole answer) once the gate closes
        or the answer is complete."""
        with self.connect(timeout) as sock:
            sock.sendall(raw)
            return read_answer(sock)


def read_answer(sock: socket.socket) -> tuple[int, bytes]:
    """One answer: its status and bytes (head and body, by Content-Length or until close)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    if not data:
        return 0, b""
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status == 100:  # an interim answer: the final one follows
        return status, data
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), None)
    while length is None or len(body) < length:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        body += chunk
    return status, head + b"\r\n\r\n" + body


def get(path: str, key: str | None = KEY, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return f"GET {path} HTTP/1.1\r\nHost: gpu\r\n{auth}{extra}\r\n".encode()


@pytest.fixture
def start_gate(tmp_path, backend):
    started: list[Gate] = []

    def start(key: bytes = KEY.encode() + b"\n", **flags) -> Gate:
        key_file = tmp_path / "api.key"
        key_file.write_bytes(key)
        key_file.chmod(0o600)
        log_file = tmp_path / f"gate{len(started)}.log"
        port = free_port()
        argv = [sys.executable, str(FILES / "api_gate.py"), "--listen", "127.0.0.1",
                "--port", str(port), "--backend", backend, "--key-file", str(key_file)]
        for name, value in {"head_timeout": 1, "io_timeout": 2, **flags}.items():
            for one in value if isinstance(value, (list, tuple)) else [value]:
                argv += [f"--{name.replace('_', '-')}", str(one)]
        with open(log_file, "w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=log)
        gate = Gate(proc, port, key_file, log_file)
        started.append(gate)
        deadline = time.monotonic() + 60  # its start, however loaded the machine
        while "gate on" not in log_file.read_text():
            assert proc.poll() is None, gate.log()
            assert time.monotonic() < deadline, f"the gate did not start: {gate.log()}"
            time.sleep(0.02)
        return gate

    yield start
    for gate in started:
        gate.proc.terminate()
        gate.proc.wait(5)
        log = gate.log()
        assert "Traceback" not in log, log
        for value in (KEY, QUERY_KEY):
            assert value not in log


@pytest.fixture
def gate(start_gate):
    return start_gate()


def test_serves_with_the_key_and_hides_it(gate):
    assert gate.request(get("/v1/models", key=None))[0] == 401
    assert gate.request(get("/v1/models", key="wrong-key-0123456789"))[0] == 401
    assert gate.request(get("/health", key=None))[0] == 200
    status, answer = gate.request(get("/get_server_info"))
    assert status == 200 and KEY.encode() not in answer and b"api_key" not in answer
    assert all(seen["auth"] is None for seen in Backend.seen)
    status, answer = gate.request(get("/stream", extra="Connection: keep-alive\r\n"))
    assert status == 200 and answer.count(b"data: ") == 3


def test_unauthenticated_body_is_never_read(gate):
    """A 300 MB body announced without the key: 401 at once, before a byte of it is sent."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gpu\r\nContent-Type: application/json"
            b"\r\nContent-Length: 300000000\r\n\r\n")
    before = len(Backend.seen)
    began = time.monotonic()
    with gate.connect(timeout=3) as sock:
        sock.sendall(head)
        status, answer = read_answer(sock)
        assert status == 401 and b"Connection: close" in answer
        # what the client sends after the refusal is dropped, never held
        try:
            for _ in range(64):
                sock.sendall(b"x" * 1024 * 1024)
        except OSError:
            pass
    assert time.monotonic() - began < 5
    assert len(Backend.seen) == before
    assert gate.rss_kib() < 64 * 1024
    assert gate.request(get("/v1/models"))[0] == 200  # and the gate is still there


def test_expect_100_continue_only_with_the_key(gate):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: gpu\r\nExpect: 100-continue\r\n" \
           b"Content-Length: 5\r\n"
    status, answer = gate.request(head + b"\r\n")
    assert status == 401 and b"100 Continue" not in answer
    with gate.connect() as sock:
        sock.sendall(head + f"Authorization: Bearer {KEY}\r\n\r\n".encode())
        status, _ = read_answer(sock)
        assert status == 100
        sock.sendall(b"hello")
        status, answer = read_answer(sock)
    assert status == 200 and b'"bytes": 5' in answer


@pytest.mark.parametrize("key", [None, KEY], ids=["without-the-key", "with-the-key"])
def test_huge_content_length(gate, key):
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    status, answer = gate.request(
        f"POST /v1/completions HTTP/1.1\r\nHost: gpu\r\n{auth}"
        "Content-Length: 10000000000000\r\n\r\n".encode())
    assert status == (413 if key else 401), answer
    assert gate.rss_kib() < 64 * 1024
    assert gate.proc.poll() is None


@pytest.mark.parametrize("value", ["abc", "-1", "+5", "1,1", "0x10", "1 2", "99999999999999999999"])
def test_bad_content_length_gets_400(gate, value):
    status, answer = gate.request(
        f"POST /v1/completions HTTP/1.1\r\nHost: gpu\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Length: {value}\r\n\r\n".encode())
    assert status == 400 and b"Content-Length" in answer
    assert "Traceback" not in gate.log()


def test_two_content_lengths_and_chunked_bodies(gate):
    auth = f"Authorization: Bearer {KEY}\r\n"
    status, _ = gate.request(f"POST /v1/completions HTTP/1.1\r\nHost: gpu\r\n{auth}"
                             "Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!".encode())
    assert status == 400
    status, answer = gate.request(f"POST /v1/completions HTTP/1.1\r\nHost: gpu\r\n{auth}"
                                  "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
                                  .encode())
    assert status == 411 and b"Content-Length" in answer


def test_a_body_is_streamed_to_the_server(gate):
    body = b"x" * (5 * 1024 * 1024)
    status, answer = gate.request(
        f"POST /v1/completions HTTP/1.1\r\nHost: gpu\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode() + body, timeout=10)
    assert status == 200 and f'"bytes": {len(body)}'.encode() in answer


def test_body_limit(start_gate):
    gate = start_gate(max_body_bytes=1000)
    auth = f"Authorization: Bearer {KEY}\r\n"
    status, answer = gate.request(f"POST /v1/completions HTTP/1.1\r\nHost: gpu\r\n{auth}"
                                  "Content-Length: 1001\r\n\r\n".encode())
    assert status == 413 and b"larger than 1000 bytes" in answer
    status, _ = gate.request(f"POST /v1/completions HTTP/1.1\r\nHost: gpu\r\n{auth}"
                             "Content-Length: 1000\r\n\r\n".encode() + b"y" * 1000)
    assert status == 200


def test_slowloris_gets_408_within_the_head_timeout(gate):
    """A head sent a byte every 0.2 s never completes within the 1 s head timeout."""
    began = time.monotonic()
    with gate.connect(timeout=5) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
        answer = b""
        try:
            for byte in b"X-Slow: " + b"a" * 100:
                sock.sendall(bytes([byte]))
                time.sleep(0.2)
        except OSError:
            pass
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except OSError:
            pass
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert time.monotonic() - began < 4


def test_idle_connections_are_closed(gate):
    began = time.monotonic()
    with gate.connect(timeout=5) as sock:
        assert sock.recv(1) == b""  # closed by the gate, nothing sent
    assert time.monotonic() - began < 3
    with gate.connect(timeout=5) as sock:  # idle after a first request, kept alive
        sock.sendall(get("/health", key=None))
        assert read_answer(sock)[0] == 200
        began = time.monotonic()
        assert sock.recv(1) == b""
    assert time.monotonic() - began < 3


def test_stalled_body_is_dropped(gate):
    with gate.connect(timeout=6) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: gpu\r\nAuthorization: Bearer "
                     f"{KEY}\r\nContent-Length: 1000\r\n\r\n0123456789".encode())
        began = time.monotonic()
        try:
            while sock.recv(4096):
                pass
        except OSError:
            pass
    assert time.monotonic() - began < 5  # io timeout 2 s
    time.sleep(0.2)
    assert "the client sent nothing for 2 s (10 of 1000 body bytes in)" in gate.log()


def test_heads_too_large(gate):
    status, _ = gate.request(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n")
    assert status == 414
    big = "".join(f"X-H{i}: {'v' * 4000}\r\n" for i in range(10))
    status, _ = gate.request(get("/v1/models", extra=big))
    assert status == 431
    status, _ = gate.request(get("/v1/models", extra=f"X-Long: {'v' * 9000}\r\n"))
    assert status == 431
    many = "".join(f"X-H{i}: v\r\n" for i in range(120))
    status, _ = gate.request(get("/v1/models", extra=many))
    assert status == 431


def test_connection_cap(start_gate):
    gate = start_gate(max_connections=4, max_per_address=4, head_timeout=10)
    held = [gate.connect() for _ in range(4)]
    try:
        time.sleep(0.3)
        status, answer = gate.request(get("/health", key=None))
        assert status == 503 and b"too many connections" in answer
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert gate.request(get("/health", key=None))[0] == 200
    assert "4 connections open" in gate.log()


@pytest.mark.parametrize(("content", "why"), [
    (None, "cannot be read: No such file or directory"),
    (b"", "it is empty"),
    (b"\xff\xfe\xfa" + KEY.encode(), "it is not UTF-8 text"),
    (KEY.encode() + b"\n" + QUERY_KEY.encode() + b"\n", "it has 2 lines"),
], ids=["vanished", "empty", "not-utf8", "two-lines"])
def test_bad_or_vanished_key_file_gets_503(gate, content, why):
    assert gate.request(get("/v1/models"))[0] == 200
    if content is None:
        gate.key_file.unlink()
    else:
        gate.key_file.write_bytes(content)
    status, answer = gate.request(get("/v1/models"))
    assert status == 503 and b"cannot read its key file" in answer
    assert gate.request(get("/v1/models", key=None))[0] == 503
    assert gate.request(get("/health", key=None))[0] == 200  # open paths stay open
    time.sleep(0.1)
    log = gate.log()
    assert f"the key file {gate.key_file} " in log and why in log
    gate.key_file.write_bytes(KEY.encode() + b"\r\n")
    assert gate.request(get("/v1/models"))[0] == 200
    time.sleep(0.1)
    assert "is readable again" in gate.log()


def test_starts_with_an_empty_key_file_and_refuses_with_503(start_gate):
    gate = start_gate(key=b"")
    assert gate.request(get("/v1/models", key=None))[0] == 503
    assert gate.proc.poll() is None
    assert "it is empty" in gate.log()


def test_query_string_never_reaches_the_log(gate):
    status, _ = gate.request(get(f"/v1/models?api_key={QUERY_KEY}&x=1", key=None))
    assert status == 401
    status, _ = gate.request(get(f"/v1/models?api_key={QUERY_KEY}"))
    assert status == 200
    status, _ = gate.request(f"GET /v1/models?api_key={QUERY_KEY} HTTP/9.9\r\n\r\n".encode())
    assert status in (400, 505)
    time.sleep(0.1)
    log = gate.log()
    assert '"GET /v1/models" 401' in log and '"GET /v1/models" 200' in log
    assert QUERY_KEY not in log and "api_key=" not in log


def test_client_going_away_is_one_line(gate):
    with gate.connect() as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: gpu\r\nAuthorization: Bearer "
                     f"{KEY}\r\nContent-Length: 1000\r\n\r\n0123456789".encode())
        time.sleep(0.2)
    time.sleep(0.5)
    assert "the client closed after 10 of 1000 body bytes" in gate.log()
    assert gate.request(get("/v1/models"))[0] == 200


def test_garbage_gets_http_answers(gate):
    for raw in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(14, 64)) + b"\r\n\r\n",
                b"GET\r\n\r\n", b"BREW /pot HTTP/1.1\r\nHost: gpu\r\n\r\n",
                b"GET /v1/models HTTP/2.0\r\n\r\n"):
        status, _ = gate.request(raw)
        assert status in (400, 501, 505), raw[:20]
    assert gate.request(get("/v1/models"))[0] == 200


def test_a_second_key_file_admits_its_key_too(start_gate, tmp_path):
    """A worker's gate: its clients' key and the fleet key the router sends
    (operations/fleet.py)."""
    fleet_key = GUARD.register("sk-fleet-" + "5a" * 12, "fleet key (test)")
    second = tmp_path / "fleet.key"
    second.write_text(fleet_key + "\n")
    second.chmod(0o600)
    gate = start_gate(key_file=str(second))
    assert gate.request(get("/v1/models"))[0] == 200
    assert gate.request(get("/v1/models", key=fleet_key))[0] == 200
    assert gate.request(get("/v1/models", key="sk-neither-" + "0" * 16))[0] == 401


def test_the_backend_key_replaces_the_clients_and_only_allowed_paths_pass(start_gate, tmp_path):
    """The router's gate: the client key admits the inference paths only; smg gets the gate's
    backend key, never the client's."""
    backend_key = GUARD.register("sk-backend-" + "3c" * 12, "backend key (test)")
    kept = tmp_path / "backend.key"
    kept.write_text(backend_key + "\n")
    kept.chmod(0o600)
    gate = start_gate(backend_key_file=str(kept), allow_path="/v1/models")
    Backend.seen.clear()
    assert gate.request(get("/v1/models"))[0] == 200
    assert Backend.seen[-1]["auth"] == f"Bearer {backend_key}"
    for path in ("/workers", "/workers/x", "/v1/models/../../workers", "/health"):
        assert gate.request(get(path))[0] == 404, path
    assert gate.request(get("/v1/models", key=backend_key))[0] == 401
    assert all(seen["path"] == "/v1/models" for seen in Backend.seen)
    kept.write_text("")
    assert gate.request(get("/v1/models"))[0] == 503


def test_one_address_holding_slow_heads_leaves_room_for_a_keyed_client(start_gate):
    """Issue 29 finding 3: one keyless client holding 300 slow request heads made the gate
    answer 503 to a client with the key. One address now gets half the connections at most."""
    gate = start_gate(max_connections=8, head_timeout=10)
    held = []
    try:
        for _ in range(12):  # from another address of the loopback: 127.0.0.2
            sock = socket.create_connection(("127.0.0.1", gate.port), timeout=5,
                                            source_address=("127.0.0.2", 0))
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gpu\r\n")  # never ends
            held.append(sock)
        time.sleep(0.3)
        for _ in range(3):
            assert gate.request(get("/v1/models"))[0] == 200
    finally:
        for sock in held:
            sock.close()
    assert "127.0.0.2 refused (503): 4 connections open from this address" in gate.log()
