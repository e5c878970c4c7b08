"""Reliability figures: bad inputs refused cleanly, interruption points recovered, dry runs proven
pure, secrets kept out of the output, from the end-to-end tests that check each.

    .venv/bin/python bench/reliability.py [--lab L]

Runs, on sandbox lab L (GPUHOST_SANDBOX_LAB; default: this shell's, else 0; the tests boot
their own hosts there, replacing what the lab had), the tests:

- tests/e2e/test_bad_input.py: each malformed inventory or host data (a host given twice with
  different data and a --limit that matches no host among them) is refused with a message
  naming the key, the value and what is allowed, a non-zero exit, and no command on the host
  (recorded there by a forced command; the audit's own control case is counted apart); each bad
  secret file (several lines, empty, not UTF-8, a space, a symlink) is refused while planning,
  naming the key and the file but never the content, with nothing changed on the host (counted
  among the bad inputs, and apart);
- tests/e2e/test_interrupted.py: the deploy killed at six points, each recovered by the next run;
- tests/e2e/test_dry_purity.py: --dry on a bare host and on a converged one with a pending
  change in every stage, the host's state checksummed before and after;

and prints, per kind, how many were tried and how many held, the secret guard's summary
(tests/secret_guard.py) and the wall time. Prints figures, asserts nothing; exits non-zero only
when pytest could not run. Takes about 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = {
    "bad inputs": ("tests/e2e/test_bad_input.py", "refused cleanly"),
    "interruption points": ("tests/e2e/test_interrupted.py", "recovered"),
    "dry runs": ("tests/e2e/test_dry_purity.py", "proven pure"),
}
#: The bad-input file's control case: a real run the audit must see (not a bad input).
CONTROL = "test_the_audit_sees_a_real_run"
#: The bad-input file's secret-file cases: refused on the host while planning.
SECRET_FILES = "test_bad_secret_file_refused_while_planning"


def outcomes(junit: Path) -> dict[str, list[tuple[str, str]]]:
    """Per test file: (test name, "passed" | "failed" | "skipped") for each test case."""
    found: dict[str, list[tuple[str, str]]] = {}
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        kinds = {child.tag for child in case}
        outcome = ("failed" if kinds & {"failure", "error"} else
                   "skipped" if "skipped" in kinds else "passed")
        found.setdefault(path, []).append((case.get("name", ""), outcome))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lab", help="sandbox lab number (GPUHOST_SANDBOX_LAB)")
    args = parser.parse_args()
    env = dict(os.environ)
    if args.lab is not None:
        env["GPUHOST_SANDBOX_LAB"] = args.lab
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        began = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             f"--junitxml={junit}", *(f for f, _ in FILES.values())],
            cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        minutes = (time.monotonic() - began) / 60
        if not junit.exists():
            print(result.stdout[-4000:] + result.stderr[-4000:], file=sys.stderr)
            return 1
        found = outcomes(junit)
    print(f"reliability (sandbox lab {env.get('GPUHOST_SANDBOX_LAB', '0')}, "
          f"{minutes:.1f} min):")
    for kind, (path, held) in FILES.items():
        cases = [(name, outcome) for name, outcome in found.get(path, [])
                 if not name.startswith(CONTROL)]
        passed = sum(outcome == "passed" for _, outcome in cases)
        print(f"  {kind}: {len(cases)} tried, {passed} {held}")
        secret_cases = [outcome for name, outcome in cases if name.startswith(SECRET_FILES)]
        if secret_cases:
            print(f"    of which bad secret files: {len(secret_cases)} tried, "
                  f"{secret_cases.count('passed')} refused while planning, content unseen")
        for name, outcome in cases:
            if outcome != "passed":
                print(f"    {outcome}: {name}")
        for name, outcome in found.get(path, []):
            if name.startswith(CONTROL):
                print(f"    audit control (a real run is seen on the host): {outcome}")
    guard = re.search(r"(\d+) secret value\(s\) registered, (\d+) output\(s\) observed, "
                      r"(\d+) leak\(s\)", result.stdout)
    if guard:
        print(f"  secrets: {guard[1]} registered, {guard[2]} outputs observed, "
              f"{guard[3]} leaked")
    else:
        print("  secrets: no guard summary in pytest's output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
