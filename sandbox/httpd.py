"""The lab's HTTP server: one process serving the www root on each host link's address only.

Run detached by `up` as `python -m sandbox.httpd --root DIR --port 8080 ADDRESS...`.

It counts the bytes of the files it sends (response bodies: NVIDIA's repository stand-in and the
package index's pages and distributions), per client address and path, as the hub stand-in does
(sandbox/hub.py), for tests and the rebuild bench:

    GET  /_sandbox/bytes-served    {"<client address>": {"total": n, "files": {"<path>": n}}}
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import signal
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Counter:
    """Bytes sent per client address and path."""

    def __init__(self):
        self.lock = threading.Lock()
        self.served: dict[str, dict] = {}

    def count(self, client: str, path: str, n: int) -> None:
        with self.lock:
            entry = self.served.setdefault(client, {"total": 0, "files": {}})
            entry["total"] += n
            entry["files"][path] = entry["files"].get(path, 0) + n

    def json(self) -> bytes:
        with self.lock:
            return json.dumps(self.served).encode()


class Handler(SimpleHTTPRequestHandler):
    """Static files with keep-alive (apt and pip fetch many files per connection)."""

    protocol_version = "HTTP/1.1"
    counter = Counter()

    def do_GET(self) -> None:
        if self.path == "/_sandbox/bytes-served":
            body = self.counter.json()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if not self._ranged():
            super().do_GET()

    def _ranged(self) -> bool:
        """One byte range of a file (RFC 9110 section 14: ``Range: bytes=a-b``, ``a-``, ``-n``),
        answered 206 with its Content-Range, as the CDNs in front of PyPI and NVIDIA's
        repository answer (pip's lazy_wheel.py reads a wheel's zip directory so). Not a range
        this handles (several ranges, If-Range, not a file): False, and the whole file is sent,
        which RFC 9110 allows a server to do."""
        spec = self.headers.get("Range", "")
        path = Path(self.translate_path(self.path))
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", spec.strip())
        if not match or self.headers.get("If-Range") or not path.is_file() \
                or match.groups() == ("", ""):
            return False
        size = path.stat().st_size
        first, last = match.groups()
        start = int(first) if first else max(0, size - int(last))
        end = min(size - 1, int(last)) if first and last else size - 1
        if start >= size or start > end:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        with path.open("rb") as f:
            f.seek(start)
            data = f.read(end - start + 1)
        self.send_response(206)
        self.send_header("Content-Type", self.guess_type(str(path)))
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(data)
        self.counter.count(self.client_address[0], self.path.split("?")[0], len(data))
        return True

    def copyfile(self, source, outputfile) -> None:
        class Counted:
            def __init__(self, handler):
                self.handler, self.n = handler, 0

            def write(self, data):
                self.n += len(data)
                return outputfile.write(data)

        counted = Counted(self)
        try:
            shutil.copyfileobj(source, counted)
        finally:
            self.counter.count(self.client_address[0], self.path.split("?")[0], counted.n)

    def log_message(self, format: str, *args: object) -> None:
        link = self.connection.getsockname()[0]
        sys.stderr.write(f"{link} {self.address_string()} {format % args}\n")


class Server(ThreadingHTTPServer):
    """Several hosts install at once: a longer accept queue than http.server's 5."""

    request_queue_size = 128
    daemon_threads = True


def serve(root: Path, port: int, addresses: list[str]) -> None:
    """Serve until SIGTERM; raises OSError if an address cannot be bound."""
    handler = functools.partial(Handler, directory=str(root))
    servers = [Server((address, port), handler) for address in addresses]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"serving {root} on {', '.join(f'{a}:{port}' for a in addresses)}", flush=True)
    stop.wait()
    for server in servers:
        server.shutdown()
        server.server_close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox.httpd")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("addresses", nargs="+")
    args = parser.parse_args(argv)
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    serve(args.root, args.port, args.addresses)
    return 0


if __name__ == "__main__":
    sys.exit(main())
