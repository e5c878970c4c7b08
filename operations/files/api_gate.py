"""API key gate in front of the SGLang server: listens on the public address, passes requests
that carry ``Authorization: Bearer <key>`` to the server on the loopback, refuses the rest with
401 (as sglang's own --api-key check answers), /health and /health_generate open (as sglang
keeps them).

Why not sglang's --api-key: sglang logs its arguments at start (the journal) and returns them
from /server_info, key included. Here the key stays in its root-only file, read at start and
again whenever the file changes (secret_file.py's rules: one line of header-safe text); it is
never logged. As defence in depth, "api_key" and "admin_api_key" are removed from the JSON of
/server_info and /get_server_info.

Limits (the defaults; each has a flag), so that a client without the key costs a bounded
amount of memory, time and threads, and never more than a refusal:

- a request is refused (401) from its head alone: its body is never read without the key,
  and the connection is closed after the answer (with a short lingering close: at most
  LINGER_SECONDS and LINGER_BYTES are read and dropped, so the client sees the answer);
- the request line and each header line: at most MAX_LINE bytes (414 / 431), the whole head
  at most MAX_HEAD bytes and MAX_HEADERS fields (431);
- the head must arrive within HEAD_TIMEOUT seconds of the first wait for it, on a new or a
  kept-alive connection alike: a slow head gets 408, an idle connection is closed;
- a body: Content-Length only, one decimal number (400 otherwise, RFC 9110 section 8.6); a
  body without one (Transfer-Encoding: chunked) gets 411 (RFC 9112 section 6.3); more than
  MAX_BODY bytes gets 413; it is streamed to the server, never held whole;
- IO_TIMEOUT seconds at most between two reads of a body or two writes of an answer;
- MAX_CONNECTIONS connections at once (one thread each), MAX_PER_ADDRESS of them from one
  client address; one more is answered 503 at once;
- the key file unreadable, vanished or not one line of header-safe text: 503 for every
  request that needs the key, the reason logged once (never the content);
- the server's answers are streamed through; only /server_info's JSON is held (at most
  MAX_INFO bytes) to remove the keys.

Keys: ``--key-file`` is repeatable: a request passes with the key of any of them (a worker's
gate: its clients' key and the fleet key the router sends, operations/fleet.py). The client's
``Authorization`` is never passed on; with ``--backend-key-file`` the gate sends that file's
key to the server instead (the router's gate: smg's own ``--api-key``, operations/router.py).
``--allow-path PATH`` (repeatable): only these paths pass, whatever the key; any other answers
404 before the key is looked at (the router's control plane stays off its public port).

Trusted peers (``--trust-peer ADDRESS``, repeatable; none by default): requests from these
client addresses pass without the key. gpuhost adds none itself (the router sends its key);
an address is no credential: on a network where another machine, or another user of the
peer, could send from it, do not use it.

The journal gets one line per request: the client's address, the method, the path without
its query string (a key put there never reaches the log) and the status. No traceback: an
error is logged as its type (and an OSError's strerror).

Runs on the GPU host with the system python3 (standard library only, Python 3.10 and newer),
as sglang-gate.service, beside secret_file.py.
"""

from __future__ import annotations

import argparse
import hmac
import http.client
import ipaddress
import json
import os
import re
import socket
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import _SocketWriter  # what StreamRequestHandler writes through

from secret_file import SecretFileError, describe, read_secret

OPEN_PATHS = ("/health", "/health_generate")
INFO_PATHS = ("/server_info", "/get_server_info")
#: RFC 9110 section 7.6.1 (Connection) and the hop-by-hop fields it lists.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailers", "transfer-encoding", "upgrade", "proxy-connection"}

#: Bytes of the request line and of one header line: nginx's large_client_header_buffers
#: (4 8k) and Apache's LimitRequestLine / LimitRequestFieldSize (8190).
MAX_LINE = 8192
#: Bytes of the whole request head: nginx's four 8 KiB buffers.
MAX_HEAD = 32768
#: Header fields: Apache's LimitRequestFields, and http.client.parse_headers' own cap.
MAX_HEADERS = 100
#: Seconds for a whole request head: the lower bound of Apache mod_reqtimeout's default
#: (header=20-40,MinRate=500).
HEAD_TIMEOUT = 20.0
#: Seconds between two reads of a body or two writes of an answer: nginx's
#: client_body_timeout and send_timeout (60s).
IO_TIMEOUT = 60.0
#: Bytes of a request body: room for a long-context chat request (a 200k-token prompt is a
#: few MiB of JSON) many times over.
MAX_BODY = 32 * 1024 * 1024
#: Connections served at once.
MAX_CONNECTIONS = 256
#: Connections served at once for one client address: half of them, so that one client (300
#: slow request heads, issue 29 finding 3) leaves the other half to everyone else, and the
#: router, one address with a connection per request in flight, still has room for a server's
#: gpuhost_max_running_requests (64 by default) and more.
MAX_PER_ADDRESS = MAX_CONNECTIONS // 2
#: Seconds the server may take between two reads or writes (a long prefill before the first
#: byte of an answer).
BACKEND_TIMEOUT = 600.0
#: Bytes of /server_info's JSON held to remove the keys.
MAX_INFO = 16 * 1024 * 1024
#: The lingering close after a refusal with the body unread (nginx lingering_close).
LINGER_SECONDS = 2.0
LINGER_BYTES = 4 * 1024 * 1024
#: Bytes read from the client or the server at once.
CHUNK = 65536

_LOG_LOCK = threading.Lock()


def log(line: str) -> None:
    with _LOG_LOCK:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def loggable_path(path: str | None) -> str:
    """``path`` as the journal gets it: without its query string or fragment, at most 200
    characters, anything but visible ASCII escaped."""
    if not path:
        return "-"
    path = re.split(r"[?#]", path, maxsplit=1)[0][:200]
    return "".join(c if 0x21 <= ord(c) <= 0x7E else f"\\x{ord(c):02x}" for c in path)


@dataclass(frozen=True)
class Limits:
    max_line: int = MAX_LINE
    max_head: int = MAX_HEAD
    head_timeout: float = HEAD_TIMEOUT
    io_timeout: float = IO_TIMEOUT
    max_body: int = MAX_BODY
    max_connections: int = MAX_CONNECTIONS
    max_per_address: int = MAX_PER_ADDRESS
    backend_timeout: float = BACKEND_TIMEOUT


class HeadTimeout(Exception):
    """The request head did not arrive within the head timeout."""


class HeadTooLarge(Exception):
    """A request line, a header line or the whole head is larger than allowed."""


class ClientError(Exception):
    """The client went away or stalled while sending a body (the message says which)."""


class Reader:
    """The client's side of the connection, read with bounds: while the head is read (after
    :meth:`head`), a deadline for the whole of it, a byte budget and a cap on each line;
    otherwise ``io_timeout`` seconds for each read. The file-like methods are those
    BaseHTTPRequestHandler and http.client.parse_headers call (readline with a limit)."""

    def __init__(self, sock: socket.socket, limits: Limits):
        self.sock, self.limits = sock, limits
        self.buf = bytearray()
        self.deadline: float | None = None
        self.budget = 0
        self.received = 0  # bytes of this head so far
        self.closed = False

    def head(self) -> None:
        self.deadline = time.monotonic() + self.limits.head_timeout
        self.budget, self.received = self.limits.max_head, len(self.buf)

    def body(self) -> None:
        self.deadline = None

    def _recv(self) -> bool:
        timeout = self.limits.io_timeout
        if self.deadline is not None:
            timeout = self.deadline - time.monotonic()
            if timeout <= 0:
                raise HeadTimeout
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(CHUNK)
        except TimeoutError:
            if self.deadline is not None:
                raise HeadTimeout from None
            raise
        finally:
            self.sock.settimeout(self.limits.io_timeout)
        self.buf += data
        self.received += len(data)
        return bool(data)

    def readline(self, limit: int = -1) -> bytes:
        in_head = self.deadline is not None
        if in_head:
            cap = self.limits.max_line + 1
            limit = cap if limit < 0 else min(limit, cap)
        while True:
            end = self.buf.find(b"\n")
            if end >= 0:
                n = end + 1
                break
            if in_head and len(self.buf) > min(self.budget, self.limits.max_line):
                raise HeadTooLarge
            if 0 <= limit <= len(self.buf) or not self._recv():
                n = len(self.buf)
                break
        if limit >= 0:
            n = min(n, limit)
        line = bytes(self.buf[:n])
        del self.buf[:n]
        if in_head:
            self.budget -= len(line)
            if self.budget < 0 or len(line) > self.limits.max_line:
                raise HeadTooLarge
        return line

    def read1(self, n: int) -> bytes:
        """Up to ``n`` bytes: what is buffered, else one read (b"" at the end)."""
        if not self.buf:
            self._recv()
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while n < 0 or len(out) < n:
            data = self.read1(CHUNK if n < 0 else n - len(out))
            if not data:
                break
            out += data
        return bytes(out)

    def close(self) -> None:
        self.closed = True


class Body:
    """A request body of ``length`` bytes as http.client reads it (``read(blocksize)``),
    straight from the client; a client that stalls or goes away raises ClientError."""

    def __init__(self, reader: Reader, length: int):
        self.reader, self.length, self.left = reader, length, length

    def read(self, n: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        want = self.left if n is None or n < 0 else min(n, self.left)
        try:
            data = self.reader.read1(min(want, CHUNK))
        except TimeoutError:
            raise ClientError(f"the client sent nothing for {self.reader.limits.io_timeout:g} s "
                              f"({self.length - self.left} of {self.length} body bytes "
                              "in)") from None
        except OSError as exc:
            raise ClientError(f"the client's connection failed ({describe(exc, True)}) after "
                              f"{self.length - self.left} of {self.length} body "
                              "bytes") from None
        if not data:
            raise ClientError(f"the client closed after {self.length - self.left} of "
                              f"{self.length} body bytes")
        self.left -= len(data)
        return data


class Key:
    """The key file's content, read again when the file changes (its inode, size, mtime or
    ctime). :meth:`get` raises SecretFileError while the file is unreadable, vanished or not
    one line of header-safe text; each new reason is logged once, and the recovery too."""

    def __init__(self, path: str):
        self.path, self._lock = path, threading.Lock()
        self._stamp: tuple | None = None
        self._value: str | None = None
        self._error: SecretFileError | None = None
        self._logged: str | None = None

    def _load(self) -> None:
        try:
            st = os.lstat(self.path)
            stamp: tuple | None = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                   st.st_ctime_ns)
        except OSError:
            stamp = None
        if stamp is not None and stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._value, self._error = read_secret(self.path, "key file"), None
        except SecretFileError as exc:
            self._value, self._error = None, exc
        state = str(self._error) if self._error else "ok"
        if state != self._logged:
            if self._error:
                log(f"refusing every request that needs the key (503): {self._error}")
            elif self._logged is not None:
                log(f"the key file {self.path} is readable again")
            self._logged = state

    def get(self) -> str:
        with self._lock:
            self._load()
            if self._error is not None:
                raise self._error
            assert self._value is not None
            return self._value


class Gate(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    keys: list = []
    backend_key: Key | None = None
    allowed_paths: frozenset = frozenset()
    backend: urllib.parse.SplitResult
    limits: Limits
    #: Client addresses admitted without the key (--trust-peer), each as ipaddress gives it.
    trusted_peers: frozenset = frozenset()

    # --- connection ---------------------------------------------------------------------

    def setup(self) -> None:
        self.connection = self.request
        self.connection.settimeout(self.limits.io_timeout)
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self.rfile = Reader(self.connection, self.limits)
        self.wfile = _SocketWriter(self.connection)
        self._linger = False

    def finish(self) -> None:
        if self._linger:
            self._lingering_close()

    def _lingering_close(self) -> None:
        """Stop sending, then read and drop what the client still sends for a moment, so that
        closing with unread data (a TCP reset) does not destroy the answer before the client
        read it."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            deadline, dropped = time.monotonic() + LINGER_SECONDS, 0
            while dropped < LINGER_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.connection.settimeout(left)
                data = self.connection.recv(CHUNK)
                if not data:
                    break
                dropped += len(data)
        except OSError:
            pass

    def handle_one_request(self) -> None:
        self.command, self.path, self.request_version = None, None, "HTTP/0.9"
        self.requestline, self.raw_requestline = "", b""
        self._expect_continue = False
        self.rfile.head()
        try:
            self.raw_requestline = self.rfile.readline(self.limits.max_line + 1)
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():
                return
        except HeadTimeout:
            self.close_connection = True
            if self.rfile.received:  # a head that came too slowly; an idle connection just ends
                self._error(HTTPStatus.REQUEST_TIMEOUT, "the request head did not arrive "
                            f"within {self.limits.head_timeout:g} s", close=True)
            return
        except HeadTooLarge:
            status = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE if self.raw_requestline \
                else HTTPStatus.REQUEST_URI_TOO_LONG
            self._error(status, f"the request head is larger than allowed "
                                f"({self.limits.max_line} bytes a line, {self.limits.max_head} in "
                                f"all, {MAX_HEADERS} fields)", close=True)
            return
        except (OSError, ValueError) as exc:
            self.close_connection = True
            log(f"{self.client_address[0]} connection closed while reading the request: "
                f"{describe(exc, True)}")
            return
        self.rfile.body()
        if not hasattr(self, f"do_{self.command}"):
            self._error(HTTPStatus.NOT_IMPLEMENTED, "the method is not supported", close=True)
            return
        try:
            self._handle()
            self.wfile.flush()
        except ClientError as exc:
            self.close_connection = True
            self._log(0, str(exc))
        except OSError as exc:  # the client went away, or stopped reading an answer
            self.close_connection = True
            self._log(0, f"connection to the client lost: {describe(exc, True)}")

    def handle_expect_100(self) -> bool:
        # "100 Continue" only once the request is let through (see _handle): a client that
        # waits for it sends no body the gate would refuse.
        self._expect_continue = True
        return True

    # --- answers and the log ------------------------------------------------------------

    def log_request(self, code="-", size="-") -> None:
        pass  # one line per request, from _log

    def log_error(self, format: str, *args) -> None:
        pass  # http.server's own texts quote the request line (and its query string)

    def _log(self, status: int, note: str = "") -> None:
        line = f"{self.client_address[0]} \"{self.command or '-'} {loggable_path(self.path)}\" " \
               f"{status or '-'}"
        log(line + (f" {note}" if note else ""))

    def send_error(self, code, message=None, explain=None) -> None:
        """http.server's own refusals (bad request line, too many headers, unknown method,
        HTTP/2): the status and its phrase only, never the client's text echoed."""
        self._error(HTTPStatus(code), HTTPStatus(code).phrase, close=True)

    def _error(self, status: HTTPStatus, message: str, close: bool = False,
               extra: tuple[tuple[str, str], ...] = ()) -> None:
        body = json.dumps({"error": message}).encode()
        if self.request_version == "HTTP/0.9":  # not parsed (yet): answer as HTTP/1.1 anyway
            self.request_version = "HTTP/1.1"
        self.send_response_only(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra:
            self.send_header(name, value)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
            self._linger = True
        self.end_headers()
        self.wfile.write(body)
        self._log(status, "" if status == HTTPStatus.UNAUTHORIZED else message)

    # --- requests -----------------------------------------------------------------------

    def _authorized(self, key: str) -> bool:
        auth = self.headers.get("Authorization") or ""
        scheme, _, given = auth.partition(" ")
        # RFC 9110 section 11.1: the scheme is case-insensitive.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("latin-1", "replace"), key.encode("ascii"))

    def _trusted_peer(self) -> bool:
        """Whether the client's address is one of --trust-peer's (an IPv4 address seen through
        an IPv6 socket as ::ffff:a.b.c.d counts as itself)."""
        if not self.trusted_peers:
            return False
        try:
            address = ipaddress.ip_address(self.client_address[0])
        except ValueError:
            return False
        mapped = getattr(address, "ipv4_mapped", None)
        return address in self.trusted_peers or (mapped is not None
                                                 and mapped in self.trusted_peers)

    def _content_length(self) -> int | None:
        """The body's length (0 without one), or None after refusing the request."""
        if self.headers.get_all("Transfer-Encoding"):
            self._error(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length, "
                        "not Transfer-Encoding", close=True)
            return None
        values = self.headers.get_all("Content-Length") or []
        if not values:
            return 0
        if len(values) > 1 or not re.fullmatch(r"[0-9]{1,18}", values[0].strip(" \t")):
            self._error(HTTPStatus.BAD_REQUEST, "bad Content-Length: one decimal number of "
                        "bytes (RFC 9110 section 8.6)", close=True)
            return None
        return int(values[0])

    def _handle(self) -> None:
        length = self._content_length()
        if length is None:
            return
        path = re.split(r"[?#]", self.path, maxsplit=1)[0]
        if self.allowed_paths and path not in self.allowed_paths:
            self._error(HTTPStatus.NOT_FOUND, "Not Found", close=length > 0)
            return
        if path not in OPEN_PATHS and not self._trusted_peer():
            try:
                keys = [k.get() for k in self.keys]
            except SecretFileError:
                # Logged by Key once; the client learns nothing about the file.
                self._error(HTTPStatus.SERVICE_UNAVAILABLE, "the API key gate cannot read its "
                            "key file", close=length > 0)
                return
            if not any([self._authorized(k) for k in keys]):
                self._error(HTTPStatus.UNAUTHORIZED, "Unauthorized", close=length > 0)
                return
        if self.backend_key is not None:
            try:
                self.backend_key.get()
            except SecretFileError:
                self._error(HTTPStatus.SERVICE_UNAVAILABLE, "the API key gate cannot read its "
                            "backend key file", close=length > 0)
                return
        if length > self.limits.max_body:
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        f"the body is larger than {self.limits.max_body} bytes", close=True)
            return
        if self._expect_continue:
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._forward(path, length)

    def _backend_headers(self, length: int) -> dict[str, str]:
        named = {t.strip().lower() for v in self.headers.get_all("Connection") or []
                 for t in v.split(",")}
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in HOP_BY_HOP | named
                   and k.lower() not in ("host", "authorization", "content-length", "expect")}
        if length or self.command in ("POST", "PUT", "PATCH"):
            headers["Content-Length"] = str(length)
        if self.backend_key is not None:
            headers["Authorization"] = f"Bearer {self.backend_key.get()}"
        return headers

    def _forward(self, path: str, length: int) -> None:
        conn = http.client.HTTPConnection(self.backend.hostname, self.backend.port,
                                          timeout=self.limits.backend_timeout, blocksize=CHUNK)
        try:
            try:
                conn.request(self.command, self.path, body=Body(self.rfile, length)
                             if length else None, headers=self._backend_headers(length))
                response = conn.getresponse()
            except ClientError:
                raise
            except (OSError, http.client.HTTPException) as exc:
                self._error(HTTPStatus.BAD_GATEWAY, "server unreachable: "
                            f"{getattr(exc, 'strerror', None) or type(exc).__name__}",
                            close=length > 0)
                return
            except ValueError as exc:  # http.client refused the path or a header
                self._error(HTTPStatus.BAD_REQUEST, "the request's path or a header cannot be "
                            f"passed on ({type(exc).__name__})", close=True)
                return
            if path in INFO_PATHS and response.status == 200:
                self._reply_info(response)
            else:
                self._relay(response)
        finally:
            conn.close()

    def _send_head(self, response: http.client.HTTPResponse, length: int | None) -> None:
        self.send_response_only(response.status, response.reason)
        named = {t.strip().lower() for v in response.headers.get_all("Connection") or []
                 for t in v.split(",")}
        for k, v in response.getheaders():
            if k.lower() not in HOP_BY_HOP | named and k.lower() != "content-length":
                self.send_header(k, v)
        if length is not None:
            self.send_header("Content-Length", str(length))
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()

    def _reply_info(self, response: http.client.HTTPResponse) -> None:
        data = response.read(MAX_INFO + 1)
        if len(data) > MAX_INFO:
            self._error(HTTPStatus.BAD_GATEWAY, f"the server's answer is larger than {MAX_INFO} "
                        "bytes", close=True)
            return
        try:
            info = json.loads(data)
            for field in ("api_key", "admin_api_key"):
                info.pop(field, None)
            data = json.dumps(info).encode()
        except (ValueError, AttributeError):
            pass
        self._send_head(response, len(data))
        self.wfile.write(data)
        self._log(response.status)

    def _relay(self, response: http.client.HTTPResponse) -> None:
        """The server's answer as it comes: with its Content-Length, kept alive; without one
        (server-sent events, chunked), passed on as it arrives and the connection closed."""
        declared = response.getheader("content-length")
        length = int(declared) if declared and declared.isdigit() and not response.chunked \
            else None
        self._send_head(response, length)
        sent = 0
        while True:
            try:
                chunk = response.read1(CHUNK)
            except (OSError, http.client.HTTPException) as exc:
                self.close_connection = True
                self._log(response.status, f"the server's answer broke off after {sent} bytes: "
                                           f"{describe(exc, True)}")
                return
            if not chunk:
                break
            self.wfile.write(chunk)  # a client that went away raises: handle_one_request logs it
            sent += len(chunk)
        if length is not None and sent != length:
            self.close_connection = True
        self._log(response.status)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle


class Server(ThreadingHTTPServer):
    """One thread per connection, at most ``limits.max_connections`` of them; a connection
    beyond is answered 503 at once. Errors are logged as one line, never a traceback."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address, handler, limits: Limits):
        self.slots = threading.BoundedSemaphore(limits.max_connections)
        self.per_address: dict[str, int] = {}
        self._per_address_lock = threading.Lock()
        self.limits = limits
        self._busy_refused, self._busy_logged = 0, 0.0
        super().__init__(address, handler)

    def _take(self, address: str) -> bool:
        with self._per_address_lock:
            if self.per_address.get(address, 0) >= self.limits.max_per_address:
                return False
            self.per_address[address] = self.per_address.get(address, 0) + 1
            return True

    def _give_back(self, address: str) -> None:
        with self._per_address_lock:
            left = self.per_address.get(address, 1) - 1
            if left:
                self.per_address[address] = left
            else:
                self.per_address.pop(address, None)

    def process_request(self, request, client_address) -> None:
        if not self._take(client_address[0]):
            self._refuse_busy(request, client_address, per_address=True)
            return
        if not self.slots.acquire(blocking=False):
            self._give_back(client_address[0])
            self._refuse_busy(request, client_address)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            self._give_back(client_address[0])
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()
            self._give_back(client_address[0])

    def _refuse_busy(self, request, client_address, per_address: bool = False) -> None:
        body = json.dumps({"error": "too many connections: try again"}).encode()
        try:
            request.settimeout(1.0)
            request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json"
                            b"\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: "
                            + str(len(body)).encode() + b"\r\n\r\n" + body)
        except OSError:
            pass
        self.shutdown_request(request)
        self._busy_refused += 1
        now = time.monotonic()
        if now - self._busy_logged >= 10:
            held = (f"{self.limits.max_per_address} connections open from this address"
                    if per_address else f"{self.limits.max_connections} connections open")
            log(f"{client_address[0]} refused (503): {held} ({self._busy_refused} refused "
                "since the last such line)")
            self._busy_logged, self._busy_refused = now, 0

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        log(f"{client_address[0]} connection error: "
            f"{describe(exc, True) if exc else 'unknown'}")


class Server6(Server):
    address_family = socket.AF_INET6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="the address to bind")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", required=True, help="the server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--key-file", required=True, action="append",
                        help="root-only file holding a key the gate admits (repeatable)")
    parser.add_argument("--backend-key-file",
                        help="root-only file holding the key sent to the server")
    parser.add_argument("--allow-path", action="append", default=[],
                        help="a path that passes (repeatable; none: every path)")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS)
    parser.add_argument("--max-per-address", type=int, default=None,
                        help="connections from one client address (default: half the total)")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY)
    parser.add_argument("--head-timeout", type=float, default=HEAD_TIMEOUT, help="seconds")
    parser.add_argument("--io-timeout", type=float, default=IO_TIMEOUT, help="seconds")
    parser.add_argument("--backend-timeout", type=float, default=BACKEND_TIMEOUT, help="seconds")
    parser.add_argument("--trust-peer", action="append", default=[], type=ipaddress.ip_address,
                        help="a client address admitted without the key (the fleet's router)")
    args = parser.parse_args()
    limits = Limits(head_timeout=args.head_timeout, io_timeout=args.io_timeout,
                    max_body=args.max_body_bytes, max_connections=args.max_connections,
                    backend_timeout=args.backend_timeout,
                    max_per_address=args.max_per_address or max(1, args.max_connections // 2))
    Gate.keys = [Key(path) for path in args.key_file]
    Gate.backend_key = Key(args.backend_key_file) if args.backend_key_file else None
    Gate.allowed_paths = frozenset(args.allow_path)
    Gate.backend = urllib.parse.urlsplit(args.backend)
    Gate.limits = limits
    Gate.trusted_peers = frozenset(args.trust_peer)
    server_class = Server6 if ":" in args.listen else Server
    server = server_class((args.listen, args.port), Gate, limits)
    log(f"gate on {args.listen}:{args.port} -> {args.backend} (at most "
        f"{limits.max_connections} connections, bodies of {limits.max_body} bytes, heads "
        f"within {limits.head_timeout:g} s)")
    for key in [*Gate.keys, *([Gate.backend_key] if Gate.backend_key else [])]:
        try:
            key.get()
        except SecretFileError:
            pass  # logged; every request that needs the key gets 503 until the file is fixed
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
