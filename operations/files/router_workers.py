"""Check the router's own worker list: every expected worker listed and healthy.

    python3 router_workers.py --router http://127.0.0.1:8100 --timeout 300 [--register] URL ...

Reads ``GET /workers`` of the router (smg 1.13.0's worker management API: ``{"workers": [{"url",
"is_healthy", "status", ...}], "total", "stats"}``, as the real router answered it), every
``--interval`` seconds until each URL given is listed with ``is_healthy`` true, or the timeout.
Prints one progress line per round that differs from the last; exit 0 when all are in, 1 with
what is missing or unhealthy at the timeout. With ``--register``, each round asks the router to
register every expected worker it does not list (``POST /workers`` with ``{"url": URL}``: 202,
or 409 ``WORKER_ALREADY_EXISTS`` when it is listed by then): smg 1.13.0 registers the
``--worker-urls`` of its command line once, at its start, retrying a worker that does not answer
every ``--worker-startup-check-interval`` (30 s) up to ``--worker-startup-timeout-secs`` (1800
s; its ``launch --help``; seen here: a worker down at the router's start is retried every 30 s
and listed once it answers). Without service discovery nothing else registers a worker: one that
did not answer in that time (a host rebooting for a driver while the router host rebooted), or
one taken out through ``DELETE /workers`` (a roll), is listed only once registered again (the
public report: smg-project/smg#752, a router without its workers after their hosts rebooted for
a driver update). A listed worker that fails its health checks stays listed, ``"failed"``, and
is healthy again once it answers (seen, smg 1.13.0 without service discovery:
``--remove-unhealthy-workers`` is off). With ``--timeout 0``: one look, its answer as JSON
(``{"listed": {url: healthy}, "missing": [...], "unhealthy": [...], "error": ""}``), exit 0.

Runs on the router host with the system python3 (standard library only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request


def look(router: str, expected: list[str]) -> dict:
    """The router's worker list against ``expected``; ``error`` says why there is no list."""
    try:
        with urllib.request.urlopen(router.rstrip("/") + "/workers", timeout=10) as answer:
            body = json.loads(answer.read())
        listed = {w["url"]: bool(w.get("is_healthy")) for w in body["workers"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return {"listed": {}, "missing": list(expected), "unhealthy": [],
                "error": f"{type(exc).__name__}: {reason}"}
    return {"listed": listed, "missing": [u for u in expected if u not in listed],
            "unhealthy": [u for u in expected if u in listed and not listed[u]], "error": ""}


def register(router: str, url: str) -> str:
    """Ask the router to register ``url``; what it answered, in words."""
    request = urllib.request.Request(router.rstrip("/") + "/workers",
                                     json.dumps({"url": url}).encode(),
                                     {"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return f"registering {url} again ({answer.status})"
    except urllib.error.HTTPError as exc:
        if exc.code == 409:
            return f"{url} is registered"
        return f"registering {url} again was refused ({exc.code})"
    except (OSError, ValueError) as exc:
        return f"registering {url} again: no answer ({type(exc).__name__})"


def describe(seen: dict) -> str:
    if seen["error"]:
        return f"no worker list from the router ({seen['error']})"
    parts = []
    if seen["missing"]:
        parts.append("not listed: " + ", ".join(seen["missing"]))
    if seen["unhealthy"]:
        parts.append("unhealthy: " + ", ".join(seen["unhealthy"]))
    return "; ".join(parts) or f"all {len(seen['listed'])} worker(s) listed and healthy"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router", required=True, help="the router's own URL, on the loopback")
    parser.add_argument("--timeout", type=float, default=300, help="seconds; 0 looks once")
    parser.add_argument("--interval", type=float, default=2, help="seconds")
    parser.add_argument("--register", action="store_true",
                        help="register each expected worker the router does not list")
    parser.add_argument("urls", nargs="+")
    args = parser.parse_args()
    if args.timeout == 0:
        print(json.dumps(look(args.router, args.urls)))
        return 0
    deadline = time.monotonic() + args.timeout
    said = ""
    while True:
        seen = look(args.router, args.urls)
        line = describe(seen)
        if line != said:
            print(f"router: {line}", flush=True)
            said = line
        if not seen["error"] and not seen["missing"] and not seen["unhealthy"]:
            return 0
        if args.register and not seen["error"]:
            for url in seen["missing"]:
                print(f"router: {register(args.router, url)}", flush=True)
        if time.monotonic() >= deadline:
            print(f"router: after {args.timeout:.0f} s, {line}", file=sys.stderr, flush=True)
            return 1
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
