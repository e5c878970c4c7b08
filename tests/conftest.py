import os
from pathlib import Path

import pytest


def _lab_of_this_worker() -> None:
    """Under pytest-xdist (bin/test), worker gwN boots its sandbox hosts in lab
    GPUHOST_SANDBOX_LAB + N, so that two test files never take each other's hosts. Set before
    anything imports sandbox.layout, which reads the variable once."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    base = os.environ.get("GPUHOST_SANDBOX_LAB", "0")
    lab = int(base) + int(worker[2:]) if base.isdigit() else -1
    if not 0 <= lab <= 9:
        raise pytest.UsageError(f"GPUHOST_SANDBOX_LAB = {base!r} with worker {worker}: the "
                                "worker's lab would be outside 0 to 9; use a lower lab or fewer "
                                "workers (GPUHOST_TEST_WORKERS)")
    os.environ["GPUHOST_SANDBOX_LAB"] = str(lab)


_lab_of_this_worker()

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


# --- no secret in the suite's own output (tests/secret_guard.py) ---------------------------------

from tests.secret_guard import GUARD  # noqa: E402


#: The guard's summaries handed over by pytest-xdist workers (empty without xdist).
WORKERS: list[dict] = []


def _is_xdist_controller(config) -> bool:
    return config.pluginmanager.has_plugin("dsession")


def pytest_runtest_logreport(report):
    """Observe what pytest would show of each test: captured output and log, the failure. (The
    worker that ran the test observes it; the controller sees the same report again.)"""
    text = "\n".join(content for _, content in report.sections)
    if report.longrepr is not None:
        text += "\n" + str(report.longrepr)
    GUARD.observe(f"{report.nodeid} ({report.when})", text)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    summary = getattr(node, "workeroutput", {}).get("secret_guard")
    if summary is not None:
        WORKERS.append(summary)


def _summaries(config) -> list[dict]:
    return WORKERS if _is_xdist_controller(config) else [GUARD.summary()]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller reports
        workeroutput["secret_guard"] = GUARD.summary()
    if any(s["leaks"] for s in _summaries(session.config)):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    summaries = _summaries(config)
    secrets = sum(s["secrets"] for s in summaries)
    leaks = sorted({line for s in summaries for line in s["leaks"]})
    if secrets or leaks:
        terminalreporter.section("secrets in the suite's output")
        terminalreporter.line(f"{secrets} secret value(s) registered, "
                              f"{sum(s['observed'] for s in summaries)} output(s) observed, "
                              f"{len(leaks)} leak(s)")
        for line in leaks:
            terminalreporter.line(f"LEAK {line}", red=True)
