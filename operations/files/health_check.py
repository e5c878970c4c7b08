"""Wait until the SGLang server is ready: /health answers and /v1/models lists the model.

Runs on the GPU host with the system python3 (standard library only). Prints progress
(elapsed seconds, the unit's last journal line) every 10 s. On failure or timeout: the last 50
journal lines, the unit stopped (so systemd does not restart a broken server in a loop), exit 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def _journal(unit: str, lines: int) -> str:
    result = subprocess.run(
        ["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"],
        capture_output=True, text=True, check=False,
    )
    return result.stdout.strip()


def _active(unit: str) -> str:
    result = subprocess.run(["systemctl", "is-active", unit], capture_output=True, text=True,
                            check=False)
    return result.stdout.strip()


def _fail(unit: str, why: str) -> int:
    print(f"server not ready: {why}", file=sys.stderr)
    print(f"--- last 50 lines of the journal of {unit} ---", file=sys.stderr)
    print(_journal(unit, 50), file=sys.stderr)
    subprocess.run(["systemctl", "stop", unit], check=False)
    print(f"--- {unit} stopped ---", file=sys.stderr)
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--unit", required=True)
    parser.add_argument("--timeout", type=float, required=True, help="seconds")
    args = parser.parse_args()

    start = time.monotonic()
    last_report = start
    while True:
        elapsed = time.monotonic() - start
        if elapsed > args.timeout:
            return _fail(args.unit, f"not ready after {args.timeout:.0f} s")
        state = _active(args.unit)
        if state in ("failed", "inactive"):
            return _fail(args.unit, f"the unit is {state}")
        status, _ = _get(f"{args.url}/health")
        if status == 200:
            status, body = _get(f"{args.url}/v1/models")
            try:
                names = [m.get("id") for m in json.loads(body).get("data", [])]
            except (ValueError, AttributeError):
                names = []
            if status == 200 and args.model in names:
                print(f"ready after {elapsed:.0f} s: /v1/models lists {args.model}")
                return 0
        if time.monotonic() - last_report >= 10:
            last_report = time.monotonic()
            line = (_journal(args.unit, 1).splitlines() or [""])[-1]
            print(f"waiting {elapsed:.0f} s: {line}", flush=True)
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
