"""operations/runtime/call_order.py: pyinfra's operation order, the same list without
inspect.stack()."""

from __future__ import annotations

from types import SimpleNamespace

import pyinfra
import pytest
from pyinfra.api import util as pyinfra_util

from operations.runtime import call_order

pyinfra_operation = call_order.pyinfra_operation

THIS_FILE = __file__


def both(state):
    """pyinfra's order and ours, taken from one line (so the caller's line is the same)."""
    return pyinfra_util.get_operation_order_from_stack(state), call_order.operation_order(state)


def nested(state, depth):
    if depth:
        return nested(
            state,
            depth - 1,
        )
    return both(state)


def in_generator(state):
    yield both(state)


@pytest.fixture(params=[True, False], ids=["cli", "api"])
def cli(request, monkeypatch):
    monkeypatch.setattr(pyinfra, "is_cli", request.param)


@pytest.mark.parametrize("deploy_file", [THIS_FILE, None, "/nowhere/deploy.py"],
                         ids=["deploy-file-on-stack", "no-deploy-file", "deploy-file-not-on-stack"])
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_same_order_as_pyinfra(cli, deploy_file, depth):
    state = SimpleNamespace(current_deploy_filename=deploy_file, current_op_file_number=7)
    theirs, ours = nested(state, depth)
    assert ours == theirs
    if deploy_file == THIS_FILE:
        assert len(ours) >= depth + 2  # the lines are really read, not an empty list each


def test_same_order_through_a_multiline_call_and_a_generator(cli):
    state = SimpleNamespace(current_deploy_filename=THIS_FILE, current_op_file_number=3)
    theirs, ours = next(
        in_generator(
            state,
        )
    )
    assert ours == theirs


def test_lines_differ_between_calls_from_different_lines():
    state = SimpleNamespace(current_deploy_filename=THIS_FILE, current_op_file_number=0)
    first = call_order.operation_order(state)
    second = call_order.operation_order(state)
    assert first[:-1] == second[:-1] and first[-1] + 1 == second[-1]


def test_install_replaces_pyinfra_order(monkeypatch):
    monkeypatch.setattr(pyinfra_operation, "get_operation_order_from_stack",
                        pyinfra_util.get_operation_order_from_stack)
    call_order.install()
    assert pyinfra_operation.get_operation_order_from_stack is call_order.operation_order
    call_order.install()
    assert pyinfra_operation.get_operation_order_from_stack is call_order.operation_order
