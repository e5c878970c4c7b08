"""A rank >= 1 after rank 0's health gate (operations/stages/group_restart.py, step 7): the group
goes down on every node, and each rank shows its own journal."""

from __future__ import annotations

from types import SimpleNamespace

from pyinfra.connectors.util import CommandOutput, OutputLine

from operations.stages import group_restart


def _output(*lines):
    return CommandOutput([OutputLine("stdout", line) for line in lines])


class Host:
    name = "gpu2"
    print_prefix = "[gpu2] "

    def __init__(self, active):
        self.active = active
        self.commands: list[str] = []


def _follow(monkeypatch, active, rank0_failed):
    host = Host(active)
    journal = [f"journal line {i}" for i in range(50)]

    def shell(h, command, **kwargs):
        h.commands.append(str(command))
        if "is-active" in str(command):
            return True, _output(h.active)
        return True, _output(*journal)

    said = []
    monkeypatch.setattr(group_restart.remote, "shell", shell)
    monkeypatch.setattr(group_restart.logger, "error", said.append)
    state = SimpleNamespace(failed_hosts=[SimpleNamespace(name="gpu1")] if rank0_failed else [])
    ok = group_restart._follow_rank0(state, host, "gpu1", 1, group_restart.JOURNAL_LINES)
    return ok, host, said


def test_a_rank_whose_server_died_shows_its_own_last_50_journal_lines(monkeypatch):
    ok, host, said = _follow(monkeypatch, "failed", rank0_failed=True)
    assert ok is False
    assert any("journalctl -u sglang.service -n 50" in c for c in host.commands)
    (message,) = said
    assert message.startswith("[gpu2] Nodes: sglang.service (node rank 1) died here (it is "
                              "failed); rank 0 (gpu1) failed its health gate: the group is "
                              "down, every rank stopped. The last 50 lines of its journal on "
                              "gpu2:")
    assert "journal line 0" in message and "journal line 49" in message


def test_a_rank_that_died_fails_even_when_rank_0_passed(monkeypatch):
    ok, _, said = _follow(monkeypatch, "inactive", rank0_failed=False)
    assert ok is False and "died here (it is inactive): the group is down" in said[0]


def test_a_running_rank_follows_rank_0_down(monkeypatch):
    ok, host, said = _follow(monkeypatch, "active", rank0_failed=True)
    assert ok is False and any("systemctl stop sglang.service" in c for c in host.commands)
    assert "rank 0 (gpu1) failed its health gate: sglang.service (node rank 1) stopped here " \
           "too. The last 50 lines" in said[0]


def test_a_running_rank_of_a_serving_group_is_left_alone(monkeypatch):
    ok, host, said = _follow(monkeypatch, "active", rank0_failed=False)
    assert ok is True and said == []
    assert not any("stop" in c for c in host.commands)


def test_the_rank_that_stopped_first_is_named(monkeypatch):
    """Rank 1 was stopped; rank 0 failed after it (its peer left the collectives). The reason
    used to name rank 0 only ("gpu1: sglang.service is not running (failed)")."""
    from operations.stages.server_state import ServiceState

    nodes = ("gpu1", "gpu2")
    rank0 = ServiceState().process(["ActiveState=failed", "Result=exit-code",
                                    "InactiveEnterTimestamp=Thu 2026-12-03 09:48:05 UTC"])
    rank1 = ServiceState().process(["ActiveState=inactive", "Result=success",
                                    "InactiveEnterTimestamp=Thu 2026-12-03 09:48:01 UTC"])
    monkeypatch.setitem(group_restart.GROUPS, nodes, {
        "gpu1": group_restart.NodePlan([], "sglang.service is not running (failed)",
                                       rank0.stopped_at),
        "gpu2": group_restart.NodePlan([], "sglang.service is not running (inactive)",
                                       rank1.stopped_at)})
    assert group_restart.restart_reason(nodes) == (
        "gpu2: sglang.service is not running (inactive); gpu2 (node rank 1) stopped first, at "
        "09:48:01 UTC; gpu1 (node rank 0) 4 s later")
    # a fresh group (never started: no time) is named as before
    never = ServiceState().process(["ActiveState=inactive", "InactiveEnterTimestamp="])
    assert never.stopped_at is None
    monkeypatch.setitem(group_restart.GROUPS, nodes, {
        n: group_restart.NodePlan([], "sglang.service is not running (inactive)", None)
        for n in nodes})
    assert group_restart.restart_reason(nodes) == \
        "gpu1: sglang.service is not running (inactive)"
