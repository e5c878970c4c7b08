from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def fixture_text():
    def read(name: str) -> str:
        return (FIXTURES / name).read_text()

    return read


def command_output(text: str, command: str) -> list[str]:
    """The lines a fixture recorded for one command (between its "$ command" line and the next
    "# rc=" line)."""
    lines = text.splitlines()
    start = lines.index(f"$ {command}") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("# rc="))
    return lines[start:end]



@pytest.fixture(scope="session")
def promtool() -> str:
    """The real promtool (Debian's prometheus package): on PATH, or put in .venv/bin by
    bin/setup. Missing, the test fails: the alert rules are checked by nothing else."""
    import shutil
    import sys

    found = shutil.which("promtool") or shutil.which("promtool", path=str(Path(sys.executable)
                                                                         .parent))
    if found is None:
        pytest.fail("promtool not found: run bin/setup (it takes promtool out of Debian's "
                    "prometheus package into .venv/bin)")
    return found


@pytest.fixture(scope="session")
def amtool() -> str:
    """The real amtool (Debian's prometheus-alertmanager package): on PATH, or put in .venv/bin
    by bin/setup. Missing, the test fails."""
    import shutil
    import sys

    found = shutil.which("amtool") or shutil.which("amtool", path=str(Path(sys.executable)
                                                                     .parent))
    if found is None:
        pytest.fail("amtool not found: run bin/setup (it takes amtool out of Debian's "
                    "prometheus-alertmanager package into .venv/bin)")
    return found


#: promtool's lint findings that the names themselves cause where they are another project's,
#: kept as that project wrote them: sglang's colons, DCGM exporter's UUID and modelName labels
#: and its counters without _total (DCGM_FI_DEV_PCIE_REPLAY_COUNTER, the ECC totals).
FOREIGN_NAME_LINTS = ("metric names should not contain ':'",
                      "label names should be written in 'snake_case' not 'camelCase'",
                      'counter metrics should have "_total" suffix',
                      "metric name should not include type 'counter'",
                      "non-histogram and non-summary metrics should not have \"_count\" suffix")


def promtool_check_metrics(promtool: str, text: str) -> list[str]:
    """``promtool check metrics`` on an exposition text: [] when it parses and lints clean but
    for FOREIGN_NAME_LINTS, else promtool's words (exit 1: it does not parse; 3: lint)."""
    import subprocess

    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True, check=False)
    findings = [line for line in done.stderr.splitlines()
                if not line.endswith(FOREIGN_NAME_LINTS)]
    if done.returncode not in (0, 3) or findings:
        return findings or [f"promtool exited {done.returncode}: {done.stderr}{done.stdout}"]
    return []

# --- no secret in the suite's own output (tests/secret_guard.py) ---------------------------------

from tests.secret_guard import GUARD  # noqa: E402


def pytest_runtest_logreport(report):
    """Observe what pytest would show of each test: captured output and log, the failure."""
    text = "\n".join(content for _, content in report.sections)
    if report.longrepr is not None:
        text += "\n" + str(report.longrepr)
    GUARD.observe(f"{report.nodeid} ({report.when})", text)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    if GUARD.leaks():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    leaks = GUARD.leaks()
    if GUARD.secrets or leaks:
        terminalreporter.section("secrets in the suite's output")
        terminalreporter.line(f"{len(GUARD.secrets)} secret value(s) registered, "
                              f"{len(GUARD.observed)} output(s) observed, "
                              f"{len(leaks)} leak(s)")
        for line in leaks:
            terminalreporter.line(f"LEAK {line}", red=True)
