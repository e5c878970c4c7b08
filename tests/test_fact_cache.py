"""operations/runtime/fact_cache.py: a fact is read once per host until the host runs a command or
gets a file. pyinfra's own State, Host and @local connector: each fact read runs a real command
here, which appends to a file, so the file's lines count the readings."""

from __future__ import annotations

from io import BytesIO
from pathlib import Path

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api import host as host_module
from pyinfra.api.host import Host
from pyinfra.api.state import StateStage
from pyinfra.context import ctx_host, ctx_state
from pyinfra.facts.server import Command

from operations.runtime import fact_cache


@pytest.fixture
def local(monkeypatch):
    """pyinfra's @local host, with the cache installed for the test only."""
    monkeypatch.setattr(host_module, "get_fact", host_module.get_fact)
    monkeypatch.setattr(Host, "run_shell_command", Host.run_shell_command)
    monkeypatch.setattr(Host, "put_file", Host.put_file)
    monkeypatch.delattr(host_module, "_gpuhost_fact_cache", raising=False)
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    state.current_stage = StateStage.Prepare
    target = inventory.get_host("@local")
    with ctx_state.use(state), ctx_host.use(target):
        target.connect()
        fact_cache.install()
        yield target


def reading(log: Path, what: str = "x") -> str:
    """A fact command that counts its runs in ``log`` and answers ``what`` and the count."""
    return f"echo r >> {log}; echo {what}-$(wc -l < {log})"


def test_a_fact_is_read_once_until_a_command_runs(local, tmp_path):
    log = tmp_path / "reads"
    assert local.get_fact(Command, reading(log)) == "x-1"
    assert local.get_fact(Command, reading(log)) == "x-1"
    assert local.get_fact(Command, command=reading(log)) == "x-1"
    assert local.run_shell_command(f"touch {tmp_path}/changed")[0]
    assert local.get_fact(Command, reading(log)) == "x-2"
    assert len(log.read_text().splitlines()) == 2


def test_each_argument_is_a_fact_of_its_own(local, tmp_path):
    log = tmp_path / "reads"
    assert local.get_fact(Command, reading(log, "a")) == "a-1"
    assert local.get_fact(Command, reading(log, "b")) == "b-2"
    assert local.get_fact(Command, reading(log, "a")) == "a-1"


def test_a_file_sent_drops_what_was_read(local, tmp_path):
    log = tmp_path / "reads"
    local.get_fact(Command, reading(log))
    assert local.get_fact(Command, reading(log)) == "x-1"
    assert local.put_file(BytesIO(b"new"), str(tmp_path / "sent"))
    assert local.get_fact(Command, reading(log)) == "x-2"


def test_each_caller_gets_a_copy(local, tmp_path):
    class Lines(Command):
        def process(self, output):
            return {"lines": list(output)}

    log = tmp_path / "reads"
    first = local.get_fact(Lines, reading(log))
    first["lines"].append("changed by an operation")
    assert local.get_fact(Lines, reading(log)) == {"lines": ["x-1"]}


def test_forget(local, tmp_path):
    log = tmp_path / "reads"
    local.get_fact(Command, reading(log))
    assert local.get_fact(Command, reading(log)) == "x-1"
    fact_cache.forget(local)
    assert local.get_fact(Command, reading(log)) == "x-2"
