"""The lab's HTTP server: one process serving the www root on each host link's address only.

Run detached by `up` as `python -m sandbox.httpd --root DIR --port 8080 ADDRESS...`.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Handler(SimpleHTTPRequestHandler):
    """Static files with keep-alive (apt and pip fetch many files per connection)."""

    protocol_version = "HTTP/1.1"

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
