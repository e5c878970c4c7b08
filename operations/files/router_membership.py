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

``leave``: first the roll state (roll_state.py, on this host, kept across runs) is read, and
every other worker of the fleet (``--fleet NAME=URL``) that it names as taken out by a roll
(``draining``, ``drained``, ``restarting``) and the router does not list serving is registered
again where it is not listed (``POST /workers``) and waited for, up to ``--resume-timeout``
seconds: smg's own health checks decide, and one that passes them serves again (a worker an
interrupted run drained, or one whose link dropped before its restart) and leaves the roll
state. A worker of the fleet the router has never listed (a fleet's first deploy, from hosts
that already serve) is not out of the router: it is neither waited for nor counted, its own
``join`` (or the router check at the end of the run) adds it. Then the worker is taken out
unless it is the last serving worker: itself listed and serving, and no other listed worker
serving (a fleet of one worker is taken out, said); and unless ``--max-unavailable``
(``gpuhost_roll_max_unavailable``) of the fleet's other workers are out by the roll state;
either way exit 3, saying which hosts are where, and nothing is changed. Taken out: the roll
state says ``draining``, the worker is removed, and waited for until the router lists it no
more (its in-flight requests drained), up to ``--timeout`` seconds; past that the drain is cut
short (said on stderr): the bound the user set; the roll state says ``drained``. One the
router does not list is not taken out and gets no entry (an earlier roll's entry stays).
``restarting``: the roll state says so where it names the worker (its restart begins; only its
health gate and ``join`` take it out of the roll state). ``join``: add the worker (already listed:
kept) and wait until it is listed healthy, up to ``--timeout`` (exit 1 past it); then its entry
leaves the roll state. A router that refuses the connection is not running: nothing routes to the
worker, exit 0, said; so too where the control-plane key file does not exist yet and nothing answers
at the router's URL (a fleet's first run, on a router host that serves too: its server rolls before
the router stage makes the key and starts the router). A roll state that cannot be written (a full
disk) stops the action with one line, the old file left as it was.
Standard library only.
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
    import roll_state
    from secret_file import SecretFileError, read_secret
except ImportError:  # imported as operations.files.<this module> (the unit tests)
    from operations.files import roll_state
    from operations.files.secret_file import SecretFileError, read_secret

#: exit status of a ``leave`` refused by the roll's rules (nothing changed)
REFUSED = 3

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


def all_listed(router: str) -> list[dict]:
    _, body = call("GET", router + "/workers")
    return [w for w in body.get("workers", []) if isinstance(w, dict)]


def listed(router: str, url: str) -> dict | None:
    return next((w for w in all_listed(router) if w.get("url") == url), None)


def serving(worker: dict) -> bool:
    """Whether the router sends ``worker`` new requests: healthy and not draining."""
    return bool(worker.get("is_healthy")) and worker.get("status") != "draining"


class Roll:
    """What ``leave`` needs beyond the worker: its host's name, the fleet's other workers
    (URL: host name), the unavailable budget, the roll state's file, the resume's bound."""

    host = ""
    fleet: dict[str, str] = {}
    max_unavailable = 1
    state = roll_state.PATH
    resume_timeout = 60.0


def _name(url: str, entries: dict[str, dict]) -> str:
    return Roll.fleet.get(url) or entries.get(url, {}).get("host") or url


def ours(entries: dict[str, dict], url: str) -> list[str]:
    """The fleet's other workers that the roll state names as taken out by a roll (draining,
    drained or restarting): the only ones a roll waits for and counts as out. A worker of the
    fleet the router has never listed (a fleet's first deploy, a worker just added) is not out:
    its own turn, or the router check at the end of the run, adds it."""
    return [u for u in Roll.fleet if u != url and u in entries]


def resume(router: str, url: str, interval: float) -> dict[str, dict]:
    """Every other worker of the fleet the roll state names (:func:`ours`) and the router does
    not list serving: registered again where it is not listed, and waited for (module
    docstring); returns the roll state as it is then. smg 1.13.0 lists a worker added by
    ``POST /workers`` only once its own checks of it passed (``/health``, ``/v1/models``,
    ``/server_info``, ``/model_info``: router_workers.py), so a listed worker is one smg found
    answering; whether it serves is its ``is_healthy`` and ``status``."""
    entries = roll_state.read(Roll.state)
    deadline = time.monotonic() + Roll.resume_timeout
    asked: set[str] = set()
    while True:
        by_url = {w.get("url"): w for w in all_listed(router)}
        for u in [u for u in ours(entries, url) if u in by_url and serving(by_url[u])]:
            print(f"router: {_name(u, entries)} ({u}) back in, healthy (the router's own health "
                  f"checks; it was {entries[u]['state']} by an earlier roll)", flush=True)
            entries = roll_state.mark(u, "", None, Roll.state)
        # one listed but not serving is the router's own health checks' (or its drain's) to
        # bring back; one it does not list, only a registration
        waiting = ours(entries, url)
        if not waiting or time.monotonic() >= deadline:
            return entries
        for u in [u for u in waiting if u not in by_url]:
            status, body = call("POST", router + "/workers",
                                {"url": u, **({"api_key": KEYS["worker"]}
                                              if KEYS["worker"] else {})})
            if u not in asked:
                print(f"router: {_name(u, entries)} ({u}) is out of the router "
                      f"({entries[u]['state']} by an earlier roll): registering it again "
                      f"({status})", flush=True)
                asked.add(u)
        time.sleep(interval)


def budget(router: str, url: str, entries: dict[str, dict]) -> str | None:
    """Why ``url`` may not be taken out now, or None (module docstring): the last serving
    worker is ``url`` itself listed and serving with no other listed worker serving; the
    workers out are those of :func:`ours` still in the roll state."""
    by_url = {w.get("url"): w for w in all_listed(router)}

    def why(u: str) -> str:
        return (f"({entries[u]['state']} by a roll)" if u in entries else
                "(draining)" if u in by_url and by_url[u].get("status") == "draining" else
                "(listed, unhealthy)" if u in by_url else "(not listed)")

    others = [u for u in Roll.fleet if u != url]
    name = Roll.host or url
    me = by_url.get(url)
    if others and me is not None and serving(me) \
            and not any(serving(w) for u, w in by_url.items() if u != url):
        down = [u for u in others if not (u in by_url and serving(by_url[u]))]
        words = ", ".join(f"{_name(u, entries)} {why(u)}" for u in down)
        return (f"{name} not taken out: it is the last worker the router serves through "
                f"({words} out of the router): the fleet would serve nothing")
    out = ours(entries, url)
    if len(out) >= Roll.max_unavailable:
        words = ", ".join(f"{_name(u, entries)} {why(u)}" for u in out)
        return (f"{name} not taken out: {len(out)} other worker(s) of the fleet already out of "
                f"the router ({words}), and gpuhost_roll_max_unavailable = "
                f"{Roll.max_unavailable}")
    return None


def leave(router: str, url: str, timeout: float, interval: float) -> int:
    entries = resume(router, url, interval)
    refused = budget(router, url, entries)
    if refused:
        print(f"router: {refused}", file=sys.stderr)
        return REFUSED
    if not [u for u in Roll.fleet if u != url] and Roll.fleet:
        print(f"router: {Roll.host or url} is the fleet's only worker: requests through the "
              "router fail until it is back", flush=True)
    worker = listed(router, url)
    if worker is None:
        # an earlier roll's entry stays as it is; one the router never listed (a first
        # deploy) is not out of it: join adds it after its restart
        print(f"router: {url} is not listed: nothing to take out"
              + (f" ({entries[url]['state']} by an earlier roll)" if url in entries else
                 " (added once its restart passed the health gate)"))
        return 0
    roll_state.mark(url, Roll.host, "draining", Roll.state)
    status, body = call("DELETE", f"{router}/workers/{worker['id']}")
    if status not in (200, 202):
        print(f"router: removing {url} answered {status} {body}", file=sys.stderr)
        roll_state.mark(url, Roll.host, None, Roll.state)
        return 1
    print(f"router: {url} taken out, draining its in-flight requests", flush=True)
    deadline = time.monotonic() + timeout
    while (worker := listed(router, url)) is not None:
        if time.monotonic() >= deadline:
            roll_state.mark(url, Roll.host, "drained", Roll.state)
            print(f"router: {url} still {worker.get('status')} after {timeout:.0f} s: going on "
                  "(the drain timeout)", file=sys.stderr)
            return 0
        time.sleep(interval)
    roll_state.mark(url, Roll.host, "drained", Roll.state)
    print(f"router: {url} drained and out")
    return 0


def restarting(router: str, url: str, timeout: float, interval: float) -> int:
    """The roll state says ``restarting`` where it names ``url`` (a roll took it out); a
    worker the router never listed gets no entry: it is not out of the router."""
    if url in roll_state.read(Roll.state):
        roll_state.mark(url, Roll.host, "restarting", Roll.state)
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
    roll_state.mark(url, Roll.host, None, Roll.state)
    print(f"router: {url} back in, healthy")
    return 0


ACTIONS = {"leave": leave, "restarting": restarting, "join": join}


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
    parser.add_argument("action", choices=tuple(ACTIONS))
    parser.add_argument("--router", required=True, help="the router's own URL, on the loopback")
    parser.add_argument("--url", required=True, help="the worker's URL, as the router lists it")
    parser.add_argument("--timeout", type=float, required=True, help="seconds")
    parser.add_argument("--interval", type=float, default=1, help="seconds")
    parser.add_argument("--control-key-file", required=True)
    parser.add_argument("--worker-key-file")
    parser.add_argument("--host", default="", help="the worker's host name, for messages")
    parser.add_argument("--fleet", action="append", default=[], metavar="NAME=URL",
                        help="each worker of the router's fleet (with leave)")
    parser.add_argument("--max-unavailable", type=int, default=1)
    parser.add_argument("--state", default=roll_state.PATH, help="the roll state's file")
    parser.add_argument("--resume-timeout", type=float, default=60, help="seconds")
    args = parser.parse_args()
    Roll.host, Roll.max_unavailable, Roll.state = args.host, args.max_unavailable, args.state
    Roll.resume_timeout = args.resume_timeout
    Roll.fleet = {url: name for name, _, url in (f.partition("=") for f in args.fleet)}
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
        return ACTIONS[args.action](router, args.url, args.timeout, args.interval)
    except roll_state.StateError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 1
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
