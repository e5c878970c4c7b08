"""The suite's secret guard (tests/secret_guard.py) and its pytest hooks (tests/conftest.py)."""

from types import SimpleNamespace

import pytest

from tests import conftest
from tests.secret_guard import Guard


def test_a_registered_value_is_found_where_it_was_observed():
    guard = Guard()
    key = guard.register("sk-0123456789abcdef0123\n", "API key")
    assert key == "sk-0123456789abcdef0123"
    guard.observe("pyinfra -vvv", "connecting...\nAuthorization: Bearer sk-0123456789abcdef0123")
    guard.observe("tests/x.py::t (call)", "nothing here")
    assert guard.leaks() == ["pyinfra -vvv: the API key"]
    leak = guard.leaks()[0]
    assert key not in leak  # where and what kind, never the value


def test_nothing_registered_nothing_found():
    guard = Guard()
    guard.observe("anywhere", "sk-0123456789abcdef0123")
    assert guard.leaks() == []


def test_short_values_are_refused():
    with pytest.raises(ValueError, match="a token of 5 characters: too short"):
        Guard().register("abcde", "token")


def test_the_hook_observes_captured_output_and_failures(monkeypatch):
    guard = Guard()
    monkeypatch.setattr(conftest, "GUARD", guard)
    secret = guard.register("hf_" + "x" * 30, "Hugging Face token")
    report = SimpleNamespace(nodeid="tests/e2e/t.py::test_a", when="call",
                             sections=[("Captured stdout call", "ok")],
                             longrepr=f"AssertionError: {secret} in output")
    conftest.pytest_runtest_logreport(report)
    assert guard.leaks() == ["tests/e2e/t.py::test_a (call): the Hugging Face token"]


def _config(controller: bool, **attributes) -> SimpleNamespace:
    plugins = SimpleNamespace(has_plugin=lambda name: controller and name == "dsession")
    return SimpleNamespace(pluginmanager=plugins, **attributes)


def test_a_worker_hands_its_leaks_to_the_controller_which_fails_the_run(monkeypatch):
    """Under pytest-xdist the secrets are registered in the workers: a leak one of them found
    must reach the controller's exit status and report, not die with the worker."""
    guard = Guard()
    monkeypatch.setattr(conftest, "GUARD", guard)
    monkeypatch.setattr(conftest, "WORKERS", [])
    guard.register("hf_" + "y" * 30, "Hugging Face token")
    guard.observe("pyinfra -y deploy.py", "token hf_" + "y" * 30)
    worker = SimpleNamespace(config=_config(False, workeroutput={}), exitstatus=0)
    conftest.pytest_sessionfinish(worker)
    assert worker.exitstatus == pytest.ExitCode.TESTS_FAILED
    handed = worker.config.workeroutput["secret_guard"]
    assert handed == {"secrets": 1, "observed": 1,
                      "leaks": ["pyinfra -y deploy.py: the Hugging Face token"]}

    monkeypatch.setattr(conftest, "GUARD", Guard())  # the controller registered nothing
    conftest.pytest_testnodedown(SimpleNamespace(workeroutput={"secret_guard": handed}), None)
    conftest.pytest_testnodedown(SimpleNamespace(workeroutput={"secret_guard": {
        "secrets": 2, "observed": 5, "leaks": []}}), None)
    controller = SimpleNamespace(config=_config(True), exitstatus=0)
    conftest.pytest_sessionfinish(controller)
    assert controller.exitstatus == pytest.ExitCode.TESTS_FAILED
    lines = []
    reporter = SimpleNamespace(section=lambda title: lines.append(title),
                               line=lambda text, **_: lines.append(text))
    conftest.pytest_terminal_summary(reporter, controller.config)
    assert lines == ["secrets in the suite's output",
                     "3 secret value(s) registered, 6 output(s) observed, 1 leak(s)",
                     "LEAK pyinfra -y deploy.py: the Hugging Face token"]


def test_a_clean_controller_run_passes(monkeypatch):
    monkeypatch.setattr(conftest, "WORKERS", [{"secrets": 2, "observed": 5, "leaks": []}])
    controller = SimpleNamespace(config=_config(True), exitstatus=0)
    conftest.pytest_sessionfinish(controller)
    assert controller.exitstatus == 0
