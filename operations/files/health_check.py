"""Health gate of the SGLang server: ready means it serves the model and answers a fixed greedy
chat completion with text that is neither empty nor degenerate.

Runs on the GPU host with the system python3 (standard library only), in one of two modes:

  --health-only   poll /health until it answers 200 (the unit's ExecStartPost: the unit stays
                  "activating" until then). Exit 0, or 1 at the timeout or as soon as the
                  server's process (--main-pid, systemd's $MAINPID) is gone: systemd waits for
                  ExecStartPost even when the main process has died.
  (default)       the gate: the unit must stay up (a crash, the unit failed or waiting to be
                  restarted by systemd is a failure at once) and be active (systemd finished
                  starting it), /health 200, /v1/models lists the
                  model, then POST /v1/chat/completions with temperature 0 must return a
                  non-empty answer that is not degenerate (NaN text, one token repeated). With
                  --public-url and --api-key-file it also checks the API key gate: a request
                  without the key is refused (401/403), one with it served, and /get_server_info
                  does not contain the key; an https:// --public-url is verified with --ca-file
                  (the fleet CA) and must refuse plain HTTP; with --gate-unit, the gate's unit must not have
                  failed (its journal is shown when it did). The key file must hold one line of
                  header-safe text (secret_file.py, shipped beside this script): else exit 1
                  saying so, the unit left as it is.

Progress lines ("waiting N s: <last journal line>") every 10 s. With --poll-for S it returns
exit 3 after S seconds still waiting (the deploy calls it again and prints the progress);
--elapsed-offset carries the seconds already waited. On failure or timeout: the reason, the
last 50 journal lines, the unit stopped (so systemd does not restart a broken server in a
loop; with --keep-unit, bench.py's gate, left as it is), exit 1. The key is never printed,
whatever fails: an unexpected error is reported as
its type alone once the key is loaded (secret_file.describe), never as a traceback.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

from secret_file import SecretFileError, describe, read_secret

PROMPT = "What is the capital of France? Answer with one word."
MAX_TOKENS = 32
WAITING = 3


#: Seconds between two looks at the server (its unit, /health, /v1/models): the end of a wait
#: is seen within a second (issue #20), and each look is one local request.
WATCH_EVERY_S = 0.25
#: The TLS context https:// URLs are verified with (--ca-file: the fleet CA); None: the
#: system's trust store.
_TLS: ssl.SSLContext | None = None

def _request(url: str, data: dict | None = None, key: str | None = None,
             timeout: float = 5.0) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps(data).encode() if data is not None else None
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=_TLS) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return 0, ""


#: Characters shown of one journal line: sglang logs its whole ServerArgs on one line, kilobytes.
LINE_CHARS = 400


def _invocation(unit: str) -> str:
    """The unit's InvocationID: its current start, or its last one once it stopped."""
    result = subprocess.run(["systemctl", "show", "-p", "InvocationID", unit],
                            capture_output=True, text=True, check=False)
    for line in result.stdout.splitlines():
        if line.startswith("InvocationID="):
            return line.split("=", 1)[1].strip()
    return ""


def cut(line: str) -> str:
    """A journal line of at most LINE_CHARS characters, saying how long it was."""
    if len(line) <= LINE_CHARS:
        return line
    return f"{line[:LINE_CHARS]} ... ({len(line)} characters)"


def _journal(unit: str, lines: int) -> str:
    """The last ``lines`` journal lines of the unit's current (or last) start only: its
    processes' (``_SYSTEMD_INVOCATION_ID``) and systemd's about it (``INVOCATION_ID``),
    systemd.journal-fields(7); the unit's last lines where systemd names no invocation. Each
    line cut to LINE_CHARS."""
    invocation = _invocation(unit)
    match = ([f"_SYSTEMD_INVOCATION_ID={invocation}", "+", f"INVOCATION_ID={invocation}"]
             if invocation else ["-u", unit])
    result = subprocess.run(
        ["journalctl", *match, "-n", str(lines), "--no-pager", "-o", "cat"],
        capture_output=True, text=True, check=False,
    )
    return "\n".join(cut(line) for line in result.stdout.strip().splitlines())


def _unit_state(unit: str) -> tuple[str, str, str]:
    """ActiveState, SubState and MainPID ("0" once the main process has exited)."""
    result = subprocess.run(
        ["systemctl", "show", "-p", "ActiveState", "-p", "SubState", "-p", "MainPID", unit],
        capture_output=True, text=True, check=False,
    )
    props = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return props.get("ActiveState", ""), props.get("SubState", ""), props.get("MainPID", "")


def _fail(unit: str, why: str, secret: str | None, journal_of: str | None = None) -> int:
    """Say why, show the journal (of ``journal_of``, else of ``unit``), stop ``unit``."""
    journal_of = journal_of or unit
    journal = _journal(journal_of, 50)
    if secret:
        journal = journal.replace(secret, "<api key>")
    print(f"server not ready: {why}", flush=True)
    print(f"--- last 50 lines of the journal of {journal_of}'s last start ---")
    print(journal)
    if _KEEP_UNIT:
        print(f"--- {unit} left as it is ---", flush=True)
        return 1
    subprocess.run(["systemctl", "stop", unit], check=False)
    print(f"--- {unit} stopped ---", flush=True)
    return 1


def degenerate(text: str) -> str | None:
    """Why an answer is degenerate, or None: NaN text, or one token (word or character)
    repeated, which is what NaN logits decode to."""
    if re.search(r"\bnan\b", text, re.IGNORECASE):
        return "it contains NaN"
    words = text.split()
    if len(words) >= 3 and len(set(words)) == 1:
        return f"one token repeated ({words[0][:20]!r} x {len(words)})"
    compact = "".join(words)
    if len(compact) >= 4 and len(set(compact)) == 1:
        return f"one character repeated ({compact[0]!r} x {len(compact)})"
    return None


def completion(url: str, model: str, key: str | None) -> tuple[str | None, str]:
    """(answer, problem): the greedy answer to PROMPT, or None and why there is none."""
    status, body = _request(
        f"{url}/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": PROMPT}],
         "temperature": 0, "max_tokens": MAX_TOKENS, "stream": False},
        key=key, timeout=60,
    )
    if status != 200:
        return None, f"POST /v1/chat/completions answered {status or 'nothing'}"
    try:
        message = json.loads(body)["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None, "POST /v1/chat/completions answered without choices[0].message"
    return (message.get("content") or "").strip(), ""


def check_gate(public_url: str, key: str, wait: float = 10.0) -> str | None:
    """Why the API key gate is not safe, or None. A gate that answers nothing yet (just
    started) is given ``wait`` seconds."""
    deadline = time.monotonic() + wait
    status, _ = _request(f"{public_url}/v1/models")
    while status == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        status, _ = _request(f"{public_url}/v1/models")
    if status not in (401, 403):
        return f"GET {public_url}/v1/models without the key answered {status or 'nothing'}, " \
               "not 401/403"
    status, body = _request(f"{public_url}/get_server_info", key=key)
    if status == 503:
        return f"GET {public_url}/get_server_info with the key answered 503: the gate cannot " \
               "read its key file (its journal says why)"
    if status != 200:
        return f"GET {public_url}/get_server_info with the key answered {status or 'nothing'}"
    if key in body:
        return f"GET {public_url}/get_server_info returns the API key"
    if public_url.startswith("https://"):
        plain = "http://" + public_url.removeprefix("https://")
        status, _ = _request(f"{plain}/v1/models")  # the key never in clear
        if status != 400:
            return f"GET {plain}/v1/models (plain HTTP on the TLS port) answered " \
                   f"{status or 'nothing'}, not 400"
    return None


def health_only(url: str, timeout: float, main_pid: int | None) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _request(f"{url}/health")[0] == 200:
            return 0
        if main_pid and not os.path.exists(f"/proc/{main_pid}"):
            print(f"the server (PID {main_pid}) exited before {url}/health answered",
                  file=sys.stderr)
            return 1
        time.sleep(WATCH_EVERY_S)
    print(f"{url}/health did not answer 200 within {timeout:.0f} s", file=sys.stderr)
    return 1


#: Whether a secret is loaded in this process: from then on an unexpected error is reported as
#: its type alone (its text may quote a header).
_SECRET_LOADED = False
#: Whether a failure leaves the unit as it is (--keep-unit: bench.py's gate, which only reads).
_KEEP_UNIT = False


def main() -> int:
    try:
        return _main()
    except Exception as exc:  # no traceback, and no secret, whatever went wrong
        print(f"server not ready: the health check failed: {describe(exc, _SECRET_LOADED)}",
              flush=True)
        return 1


def _main() -> int:
    global _KEEP_UNIT, _TLS
    parser = _parser()
    args = parser.parse_args()
    _KEEP_UNIT = args.keep_unit
    if args.ca_file:
        _TLS = ssl.create_default_context(cafile=args.ca_file)
    if args.health_only:
        return health_only(args.url, args.timeout, args.main_pid)
    if not args.model or not args.unit:
        parser.error("--model and --unit are needed unless --health-only")

    loaded, key = _key(args)
    if not loaded:
        return 1
    start = time.monotonic() - args.elapsed_offset
    began = time.monotonic()
    last_report = began
    while True:
        elapsed = time.monotonic() - start
        if elapsed > args.timeout:
            return _fail(args.unit, f"no good answer after {args.timeout:.0f} s", key)
        active, failed = _units_failed(args, elapsed, key)
        if failed is not None:
            return failed
        # Ready needs systemd's word too: "active" once the unit's ExecStartPost saw /health
        # (until then the unit is "activating", and a deploy that ended would leave it so).
        if active == "active" and _request(f"{args.url}/health")[0] == 200:
            verdict = _answers(args, elapsed, key)
            if verdict is not None:
                return verdict
        if time.monotonic() - last_report >= 10:
            last_report = time.monotonic()
            line = (_journal(args.unit, 1).splitlines() or [""])[-1]
            if key:
                line = line.replace(key, "<api key>")
            print(f"waiting {elapsed:.0f} s: {line[:200]}", flush=True)
        if args.poll_for is not None and time.monotonic() - began >= args.poll_for:
            return WAITING
        time.sleep(WATCH_EVERY_S)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the server's own base URL (loopback)")
    parser.add_argument("--health-only", action="store_true")
    parser.add_argument("--main-pid", type=int, help="with --health-only: the server's PID")
    parser.add_argument("--model", help="the served model name")
    parser.add_argument("--unit")
    parser.add_argument("--timeout", type=float, required=True, help="seconds in all")
    parser.add_argument("--poll-for", type=float, help="return 3 after this many seconds")
    parser.add_argument("--elapsed-offset", type=float, default=0.0, help="seconds already waited")
    parser.add_argument("--public-url", help="the API key gate's base URL")
    parser.add_argument("--api-key-file", help="root-only file holding the API key")
    parser.add_argument("--gate-unit", help="the API key gate's unit")
    parser.add_argument("--ca-file", help="the CA certificate an https:// URL is verified with")
    parser.add_argument("--keep-unit", action="store_true",
                        help="on failure, leave the unit running (bench.py's gate)")
    return parser


def _key(args: argparse.Namespace) -> tuple[bool, str | None]:
    """(whether the API key could be read, the key or None without --api-key-file); a key
    file that is not a secret file is said."""
    global _SECRET_LOADED
    if not args.api_key_file:
        return True, None
    try:
        key = read_secret(args.api_key_file, "key file")
    except SecretFileError as exc:
        print(f"server not ready: cannot check the API key gate: {exc}", flush=True)
        return False, None
    _SECRET_LOADED = True
    return True, key


def _units_failed(args: argparse.Namespace, elapsed: float, key: str | None
                  ) -> tuple[str, int | None]:
    """(the unit's ActiveState, :func:`_fail`'s exit status where the server or its gate
    exited, else None)."""
    active, sub, main_pid = _unit_state(args.unit)
    if active == "failed" or sub == "auto-restart" or (active == "inactive" and elapsed > 5) \
            or (sub == "start-post" and main_pid == "0"):
        return active, _fail(args.unit, f"the unit is {active} ({sub}): the server exited", key)
    if args.gate_unit and args.public_url:
        gate_active, gate_sub, _ = _unit_state(args.gate_unit)
        if gate_active == "failed" or gate_sub == "auto-restart":
            return active, _fail(args.unit, f"{args.gate_unit} is {gate_active} ({gate_sub}): "
                                 "the API key gate exited", key, journal_of=args.gate_unit)
    return active, None


def _answers(args: argparse.Namespace, elapsed: float, key: str | None) -> int | None:
    """The server that answers /health asked for the model and a greedy completion (and the
    gate checked): 0 where it is ready (said), :func:`_fail`'s status where its answer is
    bad, None where it is not there yet."""
    status, body = _request(f"{args.url}/v1/models")
    try:
        names = [m.get("id") for m in json.loads(body).get("data", [])]
    except (ValueError, AttributeError):
        names = []
    if status != 200 or args.model not in names:
        return None
    answer, problem = completion(args.url, args.model, None)
    if answer is not None and not answer:
        return _fail(args.unit, "the greedy completion is empty", key)
    if answer is not None:
        why = degenerate(answer)
        if why:
            return _fail(args.unit, f"the greedy completion is degenerate: {why}: "
                                    f"{answer[:80]!r}", key)
        if args.public_url and key:
            why = check_gate(args.public_url, key)
            if why:
                return _fail(args.unit, why, key, journal_of=args.gate_unit)
        print(f"ready after {elapsed:.0f} s: {args.model} answers {answer[:60]!r}",
              flush=True)
        return 0
    if problem and _request(f"{args.url}/health")[0] == 200:
        return _fail(args.unit, problem, key)
    return None


if __name__ == "__main__":
    sys.exit(main())
