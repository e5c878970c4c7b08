"""operations/runtime/global_arguments.py: pyinfra's global arguments listed once, the same list."""

from __future__ import annotations

import importlib

import pytest

from operations.runtime import global_arguments

arguments = importlib.import_module("pyinfra.api.arguments")
facts = importlib.import_module("pyinfra.api.facts")


@pytest.fixture
def pyinfra_own(monkeypatch):
    own = global_arguments.pyinfra_own
    monkeypatch.setattr(arguments, "all_global_arguments", own)
    monkeypatch.setattr(facts, "all_global_arguments", own)
    return own


def test_the_same_list_from_one_reading(pyinfra_own, monkeypatch):
    expected = list(pyinfra_own())
    calls = []
    monkeypatch.setattr(arguments, "get_type_hints",
                        lambda cls: (calls.append(cls), {k: v for k, v in expected})[1])
    global_arguments.install()
    first = arguments.all_global_arguments()
    first.append(("_mutated", str))
    assert arguments.all_global_arguments() == expected
    assert facts.all_global_arguments() == expected
    assert len(calls) == 1  # read at install, never again
    global_arguments.install()
    assert facts.all_global_arguments is arguments.all_global_arguments


def test_pyinfra_still_splits_an_operations_global_arguments(pyinfra_own):
    global_arguments.install()
    from pyinfra.api import Config, Inventory, State
    from pyinfra.context import ctx_host, ctx_state
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    host = inventory.get_host("@local")
    with ctx_state.use(state), ctx_host.use(host):
        kwargs = {"_sudo": True, "path": "/x"}
        found, keys = arguments.pop_global_arguments(state, host, kwargs)
    assert found["_sudo"] is True and kwargs == {"path": "/x"} and "_sudo" in keys
