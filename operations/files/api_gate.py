"""API key gate in front of the SGLang server: listens on the public address, passes requests
that carry ``Authorization: Bearer <key>`` to the server on the loopback, refuses the rest with
401 (as sglang's own --api-key check answers), /health and /health_generate open (as sglang
keeps them).

Why not sglang's --api-key: sglang logs its arguments at start (the journal) and returns them
from /server_info, key included. Here the key stays in its root-only file, read at start and
again whenever the file changes; it is never logged. As defence in depth, "api_key" and
"admin_api_key" are removed from the JSON of /server_info and /get_server_info.

Runs on the GPU host with the system python3 (standard library only), as sglang-gate.service.
"""

from __future__ import annotations

import argparse
import hmac
import http.client
import json
import os
import socket
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

OPEN_PATHS = ("/health", "/health_generate")
INFO_PATHS = ("/server_info", "/get_server_info")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailers", "transfer-encoding", "upgrade"}


class Key:
    """The key file's content, read again when its mtime or size changes."""

    def __init__(self, path: str):
        self.path, self._lock, self._stamp, self._value = path, threading.Lock(), None, ""
        self.get()

    def get(self) -> str:
        st = os.stat(self.path)
        stamp = (st.st_mtime_ns, st.st_size)
        with self._lock:
            if stamp != self._stamp:
                with open(self.path) as fh:
                    self._value = fh.read().strip()
                self._stamp = stamp
            return self._value


class Gate(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    key: Key
    backend: urllib.parse.SplitResult

    def log_message(self, fmt: str, *args: object) -> None:
        sys.stderr.write(f"{self.client_address[0]} {fmt % args}\n")

    def _allowed(self) -> bool:
        path = self.path.split("?", 1)[0]
        if path in OPEN_PATHS:
            return True
        key = self.key.get()
        auth = self.headers.get("Authorization") or ""
        scheme, _, given = auth.partition(" ")
        return bool(key) and scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), key.encode())

    def _refuse(self) -> None:
        body = json.dumps({"error": "Unauthorized"}).encode()
        self.send_response(401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _forward(self) -> None:
        if not self._allowed():
            length = int(self.headers.get("content-length") or 0)
            if length:
                self.rfile.read(length)
            return self._refuse()
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in HOP_BY_HOP and k.lower() not in ("host", "authorization")}
        conn = http.client.HTTPConnection(self.backend.hostname, self.backend.port, timeout=600)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
        except OSError as exc:
            conn.close()
            message = json.dumps({"error": f"server unreachable: {exc.strerror or exc}"}).encode()
            self.send_response(502)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(message)))
            self.end_headers()
            self.wfile.write(message)
            return
        path = self.path.split("?", 1)[0]
        if path in INFO_PATHS and response.status == 200:
            data = response.read()
            try:
                info = json.loads(data)
                for field in ("api_key", "admin_api_key"):
                    info.pop(field, None)
                data = json.dumps(info).encode()
            except ValueError:
                pass
            self._reply(response, data)
        elif response.getheader("content-length") is not None:
            self._reply(response, response.read())
        else:  # streamed (server-sent events): pass chunks on as they come, then close
            self.send_response(response.status)
            for k, v in response.getheaders():
                if k.lower() not in HOP_BY_HOP:
                    self.send_header(k, v)
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            while chunk := response.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()
        conn.close()

    def _reply(self, response: http.client.HTTPResponse, data: bytes) -> None:
        self.send_response(response.status)
        for k, v in response.getheaders():
            if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                self.send_header(k, v)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = _forward


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128


class Server6(Server):
    address_family = socket.AF_INET6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="the address to bind")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", required=True, help="the server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--key-file", required=True, help="root-only file holding the key")
    args = parser.parse_args()
    Gate.key = Key(args.key_file)
    Gate.backend = urllib.parse.urlsplit(args.backend)
    server_class = Server6 if ":" in args.listen else Server
    server = server_class((args.listen, args.port), Gate)
    print(f"gate on {args.listen}:{args.port} -> {args.backend}", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
