"""Check the router's own worker list: every expected worker listed and healthy, and no other.

    python3 router_workers.py --router http://127.0.0.1:8100 --control-key-file F
        [--worker-key-file W] --timeout 300 [--register] [--remove-others [--keep URL ...]] URL ...
    python3 router_workers.py --router ... --control-key-file F --worker-key-file W
        --start --members FILE

The router's control plane takes the control-plane key only (smg 1.13.0
``--control-plane-api-keys``, router_launch.py): every call here sends it, read from its
root-only file. A worker is added with ``{"url": URL, "api_key": KEY}``, KEY from
``--worker-key-file`` (the fleet key, ``gpuhost_fleet_key_file``): smg then sends it as
``Authorization: Bearer`` on its own calls to that worker but its first health probes (seen:
the first ``/health`` without it, then ``/v1/models``, ``/server_info``, ``/model_info``, the
health checks and ``/v1/loads`` with it; a forwarded request keeps the Authorization it came
with, which the router's gate sets to the same key, operations/stages/router.py); the workers' gates
admit the router by that key (operations/stages/fleet.py).

``--remove-others``: each listed worker whose URL is neither expected nor on a host of
``--keep`` (a host that failed or was refused in this run keeps its entry, whatever its port)
is removed (``DELETE /workers/{id}``), and said: a worker gpuhost did not configure does not
stay. ``--start`` (the router unit's ExecStartPost): wait until the router answers, add the
workers of ``--members`` (a JSON list of URLs, the deploy's last verified list), exit 0
whatever they answer.
``--save FILE``: once every expected worker is listed healthy, the router's list as it is then
(kept entries included) is written to FILE, whole (a new file renamed over the old): the last
list the run verified, which ``--start`` adds after the router's next start.

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
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

try:
    import roll_state
    from secret_file import SecretFileError, read_secret
except ImportError:  # imported as operations.files.<this module> (the unit tests)
    from operations.files import roll_state
    from operations.files.secret_file import SecretFileError, read_secret


class Keys:
    """The control-plane key and the key the router sends its workers, read once."""

    control: str = ""
    worker: str | None = None


def _request(router: str, path: str, body: dict | None = None,
             method: str = "GET") -> urllib.request.Request:
    data = json.dumps(body).encode() if body is not None else None
    return urllib.request.Request(router.rstrip("/") + path, data,
                                  {"content-type": "application/json",
                                   "Authorization": f"Bearer {Keys.control}"}, method=method)


def workers(router: str) -> list[dict]:
    """The router's ``/workers`` list; raises OSError, ValueError, KeyError or TypeError."""
    with urllib.request.urlopen(_request(router, "/workers"), timeout=10) as answer:
        body = json.loads(answer.read())
    return [w for w in body["workers"] if isinstance(w.get("url"), str)]


def look(router: str, expected: list[str], keep: list[str] = ()) -> dict:
    """The router's worker list against ``expected``; ``error`` says why there is no list;
    ``others``: listed workers neither expected nor in ``keep``."""
    try:
        listed = {w["url"]: bool(w.get("is_healthy")) for w in workers(router)}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return {"listed": {}, "missing": list(expected), "unhealthy": [], "others": [],
                "error": f"{type(exc).__name__}: {reason}"}
    return {"listed": listed, "missing": [u for u in expected if u not in listed],
            "unhealthy": [u for u in expected if u in listed and not listed[u]],
            "others": [u for u in listed if u not in expected and not kept(u, keep)], "error": ""}


def kept(url: str, keep: list[str]) -> bool:
    """Whether ``url`` is the entry of a host ``keep`` names (one of its URLs: the same host,
    whatever the port, so that a host refused for a new port keeps its last good entry)."""
    host = urllib.parse.urlsplit(url).hostname
    return any(urllib.parse.urlsplit(k).hostname == host for k in keep)


def remove(router: str, url: str) -> str:
    """Remove every entry of ``url``; what the router answered, in words."""
    said = []
    try:
        for w in [w for w in workers(router) if w["url"] == url]:
            request = _request(router, f"/workers/{w['id']}", method="DELETE")
            with urllib.request.urlopen(request, timeout=10) as answer:
                said.append(f"removed {url}, which gpuhost did not configure ({answer.status})")
    except urllib.error.HTTPError as exc:
        said.append(f"removing {url} was refused ({exc.code})")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        said.append(f"removing {url}: no answer ({type(exc).__name__})")
    return "; ".join(said) or f"{url} is gone"


def register(router: str, url: str) -> str:
    """Ask the router to register ``url``; what it answered, in words."""
    body = {"url": url, **({"api_key": Keys.worker} if Keys.worker else {})}
    request = _request(router, "/workers", body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return f"registering {url} again ({answer.status})"
    except urllib.error.HTTPError as exc:
        if exc.code == 409:
            return f"{url} is registered"
        return f"registering {url} again was refused ({exc.code})"
    except (OSError, ValueError) as exc:
        return f"registering {url} again: no answer ({type(exc).__name__})"


def save(path: str, urls: list[str]) -> None:
    """``urls`` as a JSON list at ``path``, whole: a new file, synced, renamed over the old."""
    tmp = f"{path}.new"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(urls, f)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def start(router: str, members: str | None, timeout: float) -> int:
    """The router unit's ExecStartPost: its workers added as soon as it answers."""
    try:
        with open(members or "", encoding="utf-8") as f:
            urls = [u for u in json.load(f) if isinstance(u, str)]
    except (OSError, ValueError, TypeError) as exc:
        print(f"router: no worker list to add ({type(exc).__name__})", flush=True)
        return 0
    deadline = time.monotonic() + timeout
    while True:
        seen = look(router, urls)
        if not seen["error"]:
            break
        if time.monotonic() >= deadline:
            print(f"router: no answer after {timeout:.0f} s ({seen['error']})", flush=True)
            return 0
        time.sleep(0.5)
    for url in seen["missing"]:
        print(f"router: {register(router, url)}", flush=True)
    return 0


def describe(seen: dict, expected: list[str] = (), keep: list[str] = (),
             names: dict[str, str] | None = None, entries: dict[str, dict] | None = None) -> str:
    """What the router's own list says, counted from it: the expected workers listed healthy,
    those missing or unhealthy, a kept entry (a host failed in this run) as the router has it,
    and the ones gpuhost did not configure."""
    if seen["error"]:
        return f"no worker list from the router ({seen['error']})"
    names, entries = names or {}, entries or {}

    def said(urls) -> str:
        return ", ".join(f"{names[u]} ({u})" if u in names else u for u in urls)

    listed = seen["listed"]
    healthy = [u for u in expected if listed.get(u)]
    parts = [f"{len(healthy)} of {len(expected)} configured worker(s) listed and healthy"
             + (f" ({said(healthy)})" if healthy else "")]
    if seen["missing"]:
        parts.append("not listed: " + said(seen["missing"]))
    if seen["unhealthy"]:
        parts.append("unhealthy: " + said(seen["unhealthy"]))
    for k in keep:
        state = entries.get(k, {}).get("state")
        how = ("listed and healthy" if listed.get(k) else "listed, unhealthy" if k in listed
               else "out of the router" + (f", {state} by a roll" if state else ""))
        parts.append(f"{said([k])}, whose host failed in this run: {how}")
    if seen.get("others"):
        parts.append("not configured by gpuhost: " + said(seen["others"]))
    if seen.get("removing"):
        parts.append("removed, still draining: " + said(seen["removing"]))
    return "; ".join(parts)


def returned(router: str, back: list[str], entries: dict[str, dict],
             names: dict[str, str]) -> list[str]:
    """``back``: the kept workers (hosts failed in this run) that a roll drained and did not
    restart (their roll state ``drained``: their servers never touched), registered again: the
    router's own health checks decide whether each serves again (waited for as the expected
    ones, without failing the check). What was done, in words."""
    return [f"{names.get(url, url)} ({url}) was drained by the roll and its server not "
            f"touched: {register(router, url)}" for url in back]


def prune(path: str, listed: dict[str, bool]) -> None:
    """Every roll state entry whose worker the router lists healthy leaves the roll state."""
    entries = roll_state.read(path)
    back = {u: e for u, e in entries.items() if not listed.get(u)}
    if back != entries:
        roll_state.write(back, path)


def main() -> int:
    args = _arguments()
    names = {url: name for name, _, url in (n.partition("=") for n in args.name)}
    try:
        Keys.control = read_secret(args.control_key_file, "control-plane key file")
        if args.worker_key_file:
            Keys.worker = read_secret(args.worker_key_file, "fleet key file")
    except SecretFileError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 1
    if args.start:
        return start(args.router, args.members, args.timeout)
    if args.timeout == 0:
        print(json.dumps(look(args.router, args.urls, args.keep)))
        return 0
    entries = _roll_entries(args)
    back = [u for u in args.keep if entries.get(u, {}).get("state") == "drained"]
    for line in returned(args.router, back, entries, names):
        print(f"router: {line}", flush=True)
    deadline = time.monotonic() + args.timeout
    said = ""
    removed: set[str] = set()
    while True:
        seen = _seen(args, removed)
        line = describe(seen, args.urls, args.keep, names, entries)
        if line != said:
            print(f"router: {line}", flush=True)
            said = line
        done = not seen["error"] and not seen["missing"] and not seen["unhealthy"] \
            and not seen["others"]
        waiting = [u for u in back if not seen["listed"].get(u)]
        if done and waiting and time.monotonic() < deadline:
            for url in [u for u in waiting if u not in seen["listed"]]:
                register(args.router, url)
            time.sleep(args.interval)
            continue
        if done:
            _verified(args, seen)
            return 0
        if args.register and not seen["error"]:
            for url in seen["missing"]:
                print(f"router: {register(args.router, url)}", flush=True)
        if time.monotonic() >= deadline:
            print(f"router: after {args.timeout:.0f} s, {line}", file=sys.stderr, flush=True)
            return 1
        time.sleep(args.interval)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router", required=True, help="the router's own URL, on the loopback")
    parser.add_argument("--timeout", type=float, default=300, help="seconds; 0 looks once")
    parser.add_argument("--interval", type=float, default=2, help="seconds")
    parser.add_argument("--register", action="store_true",
                        help="register each expected worker the router does not list")
    parser.add_argument("--control-key-file", required=True,
                        help="root-only file: the router's control-plane key")
    parser.add_argument("--worker-key-file", help="root-only file: the key sent to workers")
    parser.add_argument("--remove-others", action="store_true",
                        help="remove every listed worker not expected nor kept")
    parser.add_argument("--keep", action="append", default=[],
                        help="a listed URL left as it is (a host failed in this run)")
    parser.add_argument("--start", action="store_true",
                        help="wait for the router, add --members' workers, exit 0")
    parser.add_argument("--members", help="JSON list of the workers' URLs (with --start)")
    parser.add_argument("--save", help="write the verified list there (JSON list of URLs)")
    parser.add_argument("--roll-state", help="the roll state's file (roll_state.py): kept "
                        "workers a roll drained are registered again; healthy ones leave it")
    parser.add_argument("--name", action="append", default=[], metavar="NAME=URL",
                        help="a worker's host name, for messages")
    parser.add_argument("urls", nargs="*")
    return parser.parse_args()


def _roll_entries(args: argparse.Namespace) -> dict:
    """The roll state's entries by worker URL ({} without --roll-state, or where it cannot be
    read: said)."""
    try:
        return roll_state.read(args.roll_state) if args.roll_state else {}
    except roll_state.StateError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return {}


def _seen(args: argparse.Namespace, removed: set[str]) -> dict:
    """What the router lists now (:func:`look`); with --remove-others, each listed worker
    neither expected nor kept removed first (once; ``removed`` records them), those still
    listed as "removing"."""
    seen = look(args.router, args.urls, args.keep)
    if args.remove_others and not seen["error"] and set(seen["others"]) - removed:
        for url in [u for u in seen["others"] if u not in removed]:
            print(f"router: {remove(args.router, url)}", flush=True)
            removed.add(url)
        seen = look(args.router, args.urls, args.keep)  # what is true after the removal
    if args.remove_others:
        seen["removing"] = [u for u in seen["others"] if u in removed]
        seen["others"] = [u for u in seen["others"] if u not in removed]
    return seen


def _verified(args: argparse.Namespace, seen: dict) -> None:
    """The verified list saved (--save), and the workers that serve again out of the roll
    state (--roll-state)."""
    if args.save:
        save(args.save, sorted(u for u in seen["listed"]
                               if u in args.urls or kept(u, args.keep)))
    if args.roll_state:
        try:
            prune(args.roll_state, seen["listed"])
        except roll_state.StateError as exc:
            print(f"router: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
