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
