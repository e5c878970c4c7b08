"""operations/runtime/planned_facts.py: the facts one run's planning read are read in one command at
the next run's first planning reading, then served from the fact cache; their answers are the
host's own in that run. pyinfra's own State, Host and @local connector; each fact command
appends to a file, so the file's lines count the readings, and the connector's calls count
the round trips."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api import host as host_module
from pyinfra.api.host import Host
from pyinfra.api.state import StateStage
from pyinfra.connectors.local import LocalConnector
from pyinfra.context import ctx_host, ctx_state
from pyinfra.facts.server import Command

from operations.runtime import fact_cache, planned_facts


class Ports(Command):
    """A fact with a tuple argument (as operations.stages.server.PortListeners)."""

    def command(self, ports):  # type: ignore[override]
        return "echo " + " ".join(str(p) for p in ports)


@pytest.fixture
def runs(monkeypatch, tmp_path):
    """A factory of runs: each a fresh pyinfra State and @local host, the caches installed;
    the records under tmp_path; ``calls`` counts the commands sent to the host."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(host_module, "get_fact", host_module.get_fact)
    monkeypatch.setattr(Host, "run_shell_command", Host.run_shell_command)
    monkeypatch.setattr(Host, "put_file", Host.put_file)
    monkeypatch.delattr(host_module, "_gpuhost_fact_cache", raising=False)
    monkeypatch.delattr(host_module, "_gpuhost_planned_facts", raising=False)
    calls = []
    sent = LocalConnector.run_shell_command

    def counted(self, command, *args, **kwargs):
        calls.append(command)
        return sent(self, command, *args, **kwargs)

    monkeypatch.setattr(LocalConnector, "run_shell_command", counted)
    fact_cache.install()
    planned_facts.install()

    def start() -> tuple[State, Host]:
        inventory = Inventory((["@local"], {}))
        state = State(inventory, Config())
        state.current_stage = StateStage.Prepare
        target = inventory.get_host("@local")
        target.connect()
        calls.clear()
        return state, target

    start.calls = calls  # type: ignore[attr-defined]
    return start


def reading(log: Path, what: str) -> str:
    """A fact answering how often it was read (its own count: a batch reads its facts at once,
    in no set order); every reading also counts in ``log``."""
    return f"echo r >> {log}; echo r >> {log}.{what}; echo {what}-$(wc -l < {log}.{what})"


def plan(state: State, target: Host, log: Path) -> list:
    """Planning code reading three facts, the record written at its end."""
    with ctx_state.use(state), ctx_host.use(target):
        answers = [target.get_fact(Command, reading(log, "a")),
                   target.get_fact(Command, command=reading(log, "b")),
                   target.get_fact(Ports, ports=(1, 2))]
        planned_facts.save()
    return answers


def test_the_next_run_reads_last_runs_planning_facts_in_one_command(runs, tmp_path):
    log = tmp_path / "reads"
    assert plan(*runs(), log) == ["a-1", "b-1", "1 2"]
    assert len(runs.calls) == 3

    assert plan(*runs(), log) == ["a-2", "b-2", "1 2"]
    assert len(runs.calls) == 1
    assert len(log.read_text().splitlines()) == 4


def test_the_record_names_facts_never_their_answers(runs, tmp_path):
    log = tmp_path / "reads"
    state, target = runs()
    plan(state, target, log)
    text = planned_facts.record_path(target).read_text()
    assert "a-1" not in text and "1 2" not in text
    assert json.loads(text)["facts"][2] == {
        "fact": f"{Ports.__module__}:Ports", "arguments": {"ports": {"tuple": [1, 2]}}}


def test_a_command_run_while_planning_drops_the_batched_answers(runs, tmp_path):
    log = tmp_path / "reads"
    plan(*runs(), log)
    state, target = runs()
    with ctx_state.use(state), ctx_host.use(target):
        assert target.get_fact(Command, reading(log, "a")) == "a-2"
        assert target.run_shell_command(f"touch {tmp_path}/changed")[0]
        assert target.get_fact(Command, command=reading(log, "b")) == "b-3"
    assert len(log.read_text().splitlines()) == 6  # both read again, together


@pytest.mark.parametrize("record", [
    "not json",
    json.dumps({"format": 1, "facts": [{"fact": "os:path", "arguments": {}}]}),
    json.dumps({"format": 1, "facts": [{"fact": "no.such.module:Fact", "arguments": {}}]}),
    json.dumps({"format": 1, "facts": [{"fact": "pyinfra.facts.server:Command",
                                        "arguments": {"wrong": 1}}]}),
    json.dumps({"format": 1, "facts": [{"fact": "pyinfra.api:FactBase", "arguments": {}}]}),
    json.dumps({"format": 1, "facts": [], "executing": [{"fact": "pyinfra.api:FactBase",
                                                         "arguments": {}}]}),
    json.dumps({"format": 2, "facts": []}),
    json.dumps([1, 2]),
])
def test_a_record_that_is_not_a_list_of_facts_is_ignored(runs, tmp_path, record):
    log = tmp_path / "reads"
    state, target = runs()
    path = planned_facts.record_path(target)
    path.parent.mkdir(parents=True)
    path.write_text(record)
    assert plan(state, target, log) == ["a-1", "b-1", "1 2"]
    assert len(runs.calls) == 3


def test_readings_in_an_operation_or_with_pyinfra_arguments_are_not_recorded(runs, tmp_path):
    log = tmp_path / "reads"
    state, target = runs()
    with ctx_state.use(state), ctx_host.use(target):
        target.get_fact(Command, reading(log, "a"), _sudo=False)
        target.in_op = True
        target.get_fact(Command, reading(log, "b"))
        target.in_op = False
        planned_facts.save()
    assert json.loads(planned_facts.record_path(target).read_text())["facts"] == []


def test_executing_reads_nothing_from_the_record(runs, tmp_path):
    log = tmp_path / "reads"
    plan(*runs(), log)
    state, target = runs()
    state.current_stage = StateStage.Execute
    with ctx_state.use(state), ctx_host.use(target):
        assert target.get_fact(Command, reading(log, "b")) == "b-2"
    assert len(runs.calls) == 1
    assert len(log.read_text().splitlines()) == 3


def test_after_a_change_while_executing_a_recorded_fact_is_read_alone(runs, tmp_path):
    log = tmp_path / "reads"
    plan(*runs(), log)
    state, target = runs()
    with ctx_state.use(state), ctx_host.use(target):
        assert target.get_fact(Command, reading(log, "a")) == "a-2"
        state.current_stage = StateStage.Execute
        assert target.get_fact(Command, command=reading(log, "b")) == "b-2"
        assert target.run_shell_command(f"touch {tmp_path}/changed")[0]
        runs.calls.clear()
        assert target.get_fact(Command, reading(log, "a")) == "a-3"
    assert len(runs.calls) == 1
    assert len(log.read_text().splitlines()) == 5


def execute(state: State, target: Host, log: Path, global_arguments=None) -> str:
    """An operation's body reading a fact while executing."""
    state.current_stage = StateStage.Execute
    with ctx_state.use(state), ctx_host.use(target):
        target.in_op = True
        target.current_op_global_arguments = global_arguments
        try:
            return target.get_fact(Command, reading(log, "c"))
        finally:
            target.in_op = False
            target.current_op_global_arguments = None


def test_a_fact_an_operation_read_while_executing_is_read_with_the_planning_facts(runs, tmp_path):
    log = tmp_path / "reads"
    state, target = runs()
    plan(state, target, log)
    assert execute(state, target, log) == "c-1"
    target.disconnect()  # the end of the run (pyinfra_cli's disconnect_all)

    state, target = runs()
    assert plan(state, target, log) == ["a-2", "b-2", "1 2"]
    assert len(runs.calls) == 1
    assert execute(state, target, log) == "c-2"
    assert len(runs.calls) == 1
    assert len(log.read_text().splitlines()) == 6


def test_one_read_with_other_connector_arguments_is_not_recorded(runs, tmp_path):
    log = tmp_path / "reads"
    state, target = runs()
    plan(state, target, log)
    assert execute(state, target, log, {"_chdir": str(tmp_path)}) == "c-1"
    assert json.loads(planned_facts.record_path(target).read_text())["executing"] == []


class FileLines(Command):
    """A fact whose command takes a path, as operations.facts.host.FileText's."""

    def command(self, path):  # type: ignore[override]
        return "cat " + path.replace("'", "")


@pytest.mark.parametrize("path", [5, {"x": 1}, ["a"]])
def test_a_recorded_argument_the_fact_cannot_take_is_not_read(runs, tmp_path, path):
    log = tmp_path / "reads"
    plan(*runs(), log)
    record = planned_facts.record_path(runs()[1])
    kept = json.loads(record.read_text())
    kept["facts"].append({"fact": f"{FileLines.__module__}:FileLines", "arguments": {"path": path}})
    record.write_text(json.dumps(kept))
    assert plan(*runs(), log) == ["a-2", "b-2", "1 2"]  # the others read in one command still
    assert len(runs.calls) == 1


def test_a_record_nested_past_pythons_stack_is_ignored(runs, tmp_path):
    log = tmp_path / "reads"
    state, target = runs()
    path = planned_facts.record_path(target)
    path.parent.mkdir(parents=True)
    path.write_text('{"format": 1, "facts": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert plan(state, target, log) == ["a-1", "b-1", "1 2"]


def test_a_relative_xdg_cache_home_is_ignored(runs, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "cache")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    plan(*runs(), tmp_path / "reads")
    assert list((tmp_path / "cwd").iterdir()) == []
    assert planned_facts.record_dir() == tmp_path / "home/.cache/gpuhost/planned-facts"
    assert planned_facts.record_path(runs()[1]).is_file()


def test_no_home_and_no_cache_folder_is_no_record(runs, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setattr(planned_facts.os.path, "expanduser", lambda path: path)
    monkeypatch.chdir(tmp_path)
    assert plan(*runs(), tmp_path / "reads") == ["a-1", "b-1", "1 2"]
    assert planned_facts.record_path(runs()[1]) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reads", "reads.a", "reads.b"]


def test_a_record_that_cannot_be_written_leaves_nothing_half_written(runs, tmp_path,
                                                                     monkeypatch):
    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(planned_facts.os, "replace", full)
    state, target = runs()
    assert plan(state, target, tmp_path / "reads") == ["a-1", "b-1", "1 2"]
    assert list(planned_facts.record_dir().iterdir()) == []


def test_a_record_that_is_a_fifo_is_ignored_without_waiting(runs, tmp_path):
    state, target = runs()
    path = planned_facts.record_path(target)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)  # nobody writes it: reading it would wait forever

    class Hung(BaseException):
        """No OSError (load takes those for an unreadable record): the test fails with it."""

    def hung(*_):
        raise Hung("the record's reading waited for a writer")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        assert plan(state, target, tmp_path / "reads") == ["a-1", "b-1", "1 2"]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_executing_readings_are_written_once_when_the_host_disconnects(runs, tmp_path,
                                                                       monkeypatch):
    log = tmp_path / "reads"
    state, target = runs()
    plan(state, target, log)
    writes = []
    write = planned_facts._write
    monkeypatch.setattr(planned_facts, "_write", lambda host: (writes.append(host), write(host)))
    execute(state, target, log)
    execute(state, target, log, {"_chdir": str(tmp_path)})
    assert writes == []
    assert json.loads(planned_facts.record_path(target).read_text())["executing"] == []
    target.disconnect()
    assert writes == [target]
    assert [e["arguments"] for e in json.loads(
        planned_facts.record_path(target).read_text())["executing"]] == [
        {"command": reading(log, "c")}]
    target.disconnect()
    assert writes == [target]  # nothing new to write
