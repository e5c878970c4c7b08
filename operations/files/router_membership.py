"""Take one worker out of the router, or put it back, through the router's worker API.

    python3 router_membership.py leave --router http://127.0.0.1:8100 --url URL --timeout 120
        --control-key-file F
    python3 router_membership.py join --router http://127.0.0.1:8100 --url URL --timeout 300
        --control-key-file F [--worker-key-file W]

Every call carries the router's control-plane key (router_launch.py: smg's
``--control-plane-api-keys``); ``join`` adds the worker with ``"api_key"``, the key the router
sends it (the fleet key; router_workers.py).

smg 1.13.0's worker management API, as the real router answered it on this machine:
``GET /workers`` lists ``{"workers": [{"id", "url", "is_healthy", "status", ...}]}``;
``DELETE /workers/{id}`` answers 202 ``{"status": "accepted", ..., "message": "Worker removal
queued for background processing"}`` and the worker stays listed with ``"status":
"draining"`` (no new requests) until its in-flight requests are done, then it is gone;
``POST /workers`` with ``{"url": URL}`` answers 202 (409 ``WORKER_ALREADY_EXISTS`` when the URL
is listed) and the worker is listed once the router checked it.

``leave``: remove the worker and wait until the router lists it no more (its in-flight
requests drained), up to ``--timeout`` seconds; past that the drain is cut short (exit 0, said
on stderr): the bound the user set. ``join``: add the worker (already listed: kept) and wait
until it is listed healthy, up to ``--timeout`` (exit 1 past it). A router that refuses the
connection is not running: nothing routes to the worker, exit 0, said; so too where the
control-plane key file does not exist yet and nothing answers at the router's URL (a fleet's
first run, on a router host that serves too: its server rolls before the router stage makes the
key and starts the router). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

try:
    from secret_file import SecretFileError, read_secret
except ImportError:  # imported as operations.files.<this module> (the unit tests)
    from operations.files.secret_file import SecretFileError, read_secret

KEYS = {"control": "", "worker": None}


def call(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"content-type": "application/json",
                                                 "Authorization": f"Bearer {KEYS['control']}"},
                                     method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {}


def listed(router: str, url: str) -> dict | None:
    _, body = call("GET", router + "/workers")
    return next((w for w in body.get("workers", []) if w.get("url") == url), None)


def leave(router: str, url: str, timeout: float, interval: float) -> int:
    worker = listed(router, url)
    if worker is None:
        print(f"router: {url} is not listed: nothing to take out")
        return 0
    status, body = call("DELETE", f"{router}/workers/{worker['id']}")
    if status not in (200, 202):
        print(f"router: removing {url} answered {status} {body}", file=sys.stderr)
        return 1
    print(f"router: {url} taken out, draining its in-flight requests", flush=True)
    deadline = time.monotonic() + timeout
    while (worker := listed(router, url)) is not None:
        if time.monotonic() >= deadline:
            print(f"router: {url} still {worker.get('status')} after {timeout:.0f} s: going on "
                  "(the drain timeout)", file=sys.stderr)
            return 0
        time.sleep(interval)
    print(f"router: {url} drained and out")
    return 0


def join(router: str, url: str, timeout: float, interval: float) -> int:
    status, body = call("POST", router + "/workers",
                        {"url": url, **({"api_key": KEYS["worker"]} if KEYS["worker"] else {})})
    if status not in (200, 201, 202, 409):
        print(f"router: adding {url} answered {status} {body}", file=sys.stderr)
        return 1
    deadline = time.monotonic() + timeout
    while not ((worker := listed(router, url)) and worker.get("is_healthy")):
        if time.monotonic() >= deadline:
            print(f"router: {url} not listed healthy after {timeout:.0f} s "
                  f"({worker.get('status') if worker else 'not listed'})", file=sys.stderr)
            return 1
        time.sleep(interval)
    print(f"router: {url} back in, healthy")
    return 0


def _answers(router: str) -> bool:
    """Whether anything accepts a connection at the router's URL."""
    try:
        call("GET", router + "/workers")
    except urllib.error.URLError as exc:
        return not isinstance(exc.reason, ConnectionRefusedError)
    except OSError:
        return True
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("leave", "join"))
    parser.add_argument("--router", required=True, help="the router's own URL, on the loopback")
    parser.add_argument("--url", required=True, help="the worker's URL, as the router lists it")
    parser.add_argument("--timeout", type=float, required=True, help="seconds")
    parser.add_argument("--interval", type=float, default=1, help="seconds")
    parser.add_argument("--control-key-file", required=True)
    parser.add_argument("--worker-key-file")
    args = parser.parse_args()
    router = args.router.rstrip("/")
    try:
        KEYS["control"] = read_secret(args.control_key_file, "control-plane key file")
        if args.worker_key_file:
            KEYS["worker"] = read_secret(args.worker_key_file, "fleet key file")
    except SecretFileError as exc:
        if not os.path.lexists(args.control_key_file) and not _answers(router):
            # the router stage, later in the run, makes the key and starts the router (a
            # fleet's first run on a router host that serves too): nothing routes there yet
            print(f"router: not set up on this host yet (no {args.control_key_file}, nothing "
                  f"at {router}): nothing routes to {args.url}")
            return 0
        print(f"router: {exc}", file=sys.stderr)
        return 1
    try:
        return (leave if args.action == "leave" else join)(router, args.url, args.timeout,
                                                           args.interval)
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            print(f"router: not running at {router}: nothing routes to {args.url}")
            return 0
        print(f"router: no answer from {router} ({exc.reason})", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"router: no answer from {router} ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
