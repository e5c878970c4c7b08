"""What the server stage says about the units it finds: which inputs changed since a unit
started (operations/files/unit_inputs.py records them), which unit the health gate has not
passed for, and a unit systemd left failed, with its journal."""

from __future__ import annotations

import importlib.util

from operations import REPO_ROOT
from operations.stages import server_state, server_unit
from operations.stages.server_state import UnitState

_spec = importlib.util.spec_from_file_location(
    "unit_inputs", REPO_ROOT / "operations" / "files" / "unit_inputs.py")
unit_inputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unit_inputs)


def test_unit_inputs_names_the_inputs_that_changed_since_the_record(tmp_path):
    env, p2p, stamp = tmp_path / "server.env", tmp_path / "p2p.env", tmp_path / "stamp"
    env.write_text("A=1\n")
    p2p.write_text("NCCL_IB_DISABLE=1\n")
    record = tmp_path / "run" / "inputs"
    assert unit_inputs.main(["--write", str(record), str(env), str(p2p)]) == 0
    digest = record.read_text().strip()
    # The digest is the one it always was: servers started before keep comparing equal.
    assert digest == unit_inputs.inputs_digest([str(env), str(p2p)])
    env.write_text("A=2\n")
    now = unit_inputs.inputs_parts([str(env), str(p2p), str(stamp)])
    recorded = unit_inputs._read_parts(f"{record}.parts")
    assert unit_inputs.changed_inputs(recorded, now) == [
        str(env), f"{stamp} (not an input at its start)"]
    assert unit_inputs.changed_inputs(recorded, unit_inputs.inputs_parts([str(env)])) == [
        str(env), f"{p2p} (an input at its start, no longer)"]


def test_unit_inputs_changed_prints_nothing_without_a_record(tmp_path, capsys):
    assert unit_inputs.main(["--changed", str(tmp_path / "none"), str(tmp_path)]) == 0
    assert capsys.readouterr().out == ""


def test_service_state_reads_what_changed_and_systemds_result():
    state = server_state.ServiceState().process([
        "ActiveState=active", "InvocationID=ab", "NeedDaemonReload=no", "Result=success",
        "started_with=aa", "now=bb", "changed=/etc/gpuhost/server.env|/etc/gpuhost/p2p.env"])
    assert state.changed == ("/etc/gpuhost/server.env", "/etc/gpuhost/p2p.env")
    assert state.result == "success"
    assert server_state.ServiceState().process(["ActiveState=failed", "Result=start-limit-hit",
                                          "changed="]).changed == ()


def test_a_stale_unit_is_told_by_what_changed_not_by_a_guess_at_history():
    state = UnitState(active="active", started_with="aa", now="bb",
                      changed=("/etc/gpuhost/server.env",))
    message = server_state.stale_message(server_unit.UNIT, state)
    assert message == ("sglang.service runs with other inputs than the files now: "
                       "/etc/gpuhost/server.env changed since it started: restarting it")
    assert "earlier run" not in server_state.stale_message(
        server_unit.UNIT, UnitState(active="active", started_with="aa", now="bb"))
    assert "recorded no inputs" in server_state.stale_message(
        server_unit.UNIT, UnitState(active="active", started_with="", now="bb"))


def test_unverified_names_the_unit_started_since_the_gate_passed():
    units = (server_unit.UNIT, server_unit.GATE_UNIT)
    states = (UnitState(active="active", invocation="s1"),
              UnitState(active="active", invocation="g2"))
    message = server_state.unverified_message(units, states, ["s1", "g1"])
    assert message == ("not verified as it runs now: sglang-gate.service started since the "
                       "health gate last passed (its InvocationID differs from the one "
                       "recorded then): the health gate runs")
    switched = server_state.unverified_message(units[:1], states[:1], ["s1", "g1"])
    assert "last passed for sglang.service and sglang-gate.service" in switched
    assert "bind address changed" in switched
    assert "no passed health gate is recorded" in server_state.unverified_message(
        units[:1], states[:1], [])


def test_a_failed_unit_is_named_with_systemds_result_and_its_journal():
    journal = server_state.UnitJournal().process([
        "-- Boot 1 --", "2026-12-01T14:00:00+0000 gpu1 systemd[1]: sglang.service: Start "
        "request repeated too quickly."])
    message = server_state.failed_message(
        server_unit.UNIT, UnitState(active="failed", result="start-limit-hit"), journal)
    assert message.startswith("sglang.service had failed (systemd's Result: start-limit-hit): "
                              "starting it again. The last lines of its journal:\n    2026")
    assert "Start request repeated too quickly." in message and "-- Boot" not in message


def test_a_drop_in_folder_is_its_drop_ins(tmp_path):
    from operations.files import unit_inputs

    folder = tmp_path / "sglang.service.d"
    folder.mkdir()
    (folder / "10-gpuhost-driver-gate.conf").write_text("[Unit]\n")
    (folder / "README").write_text("not a drop-in\n")
    unit = tmp_path / "sglang.service"
    unit.write_text("[Service]\n")
    record = tmp_path / "inputs"
    assert unit_inputs.main(["--write", str(record), str(unit), str(folder)]) == 0
    (folder / "60-local.conf").write_text("[Service]\nRestart=no\n")
    now = unit_inputs.inputs_parts([str(unit), str(folder)])
    recorded = unit_inputs._read_parts(f"{record}.parts")
    assert unit_inputs.changed_inputs(recorded, now) == [
        f"{folder}/60-local.conf (not an input at its start)"]


def test_a_failed_starts_lines_are_of_that_start_only_and_cut(monkeypatch):
    """The "last lines of the failed start" showed the previous, healthy start too, and
    several-kilobyte argument dumps (sglang logs its ServerArgs on one line): the journal is
    read for the unit's InvocationID alone, each line cut."""
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operations" / "files"))
    try:
        import health_check
    finally:
        sys.path.pop(0)
    asked = []

    def run(argv, **_):
        asked.append(argv)
        if argv[0] == "systemctl":
            return subprocess.CompletedProcess(argv, 0, "InvocationID=4f1c\n", "")
        return subprocess.CompletedProcess(argv, 0, "server_args=ServerArgs(" + "x" * 5000
                                           + ")\nRuntimeError: CUDA error\n", "")

    monkeypatch.setattr(health_check.subprocess, "run", run)
    text = health_check._journal("sglang.service", 50)
    assert asked[-1][:4] == ["journalctl", "_SYSTEMD_INVOCATION_ID=4f1c", "+",
                             "INVOCATION_ID=4f1c"]
    first, second = text.splitlines()
    assert len(first) < 500 and first.endswith("... (5024 characters)")
    assert second == "RuntimeError: CUDA error"
