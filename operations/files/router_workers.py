"""Check the router's own worker list: every expected worker listed and healthy.

    python3 router_workers.py --router http://127.0.0.1:8100 --timeout 300 URL [URL ...]

Reads ``GET /workers`` of the router (smg 1.13.0's worker management API: ``{"workers": [{"url",
"is_healthy", "status", ...}], "total", "stats"}``, as the real router answered it), every
``--interval`` seconds until each URL given is listed with ``is_healthy`` true, or the timeout.
Prints one progress line per round that differs from the last; exit 0 when all are in, 1 with
what is missing or unhealthy at the timeout. With ``--timeout 0``: one look, its answer as JSON
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
        if time.monotonic() >= deadline:
            print(f"router: after {args.timeout:.0f} s, {line}", file=sys.stderr, flush=True)
            return 1
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
