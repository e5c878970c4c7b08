"""The last known good recorded after the health gate (operations/stages/server.py): a write that
fails (ENOSPC) never fails the gate (the host serves and goes back in the router); the
record is then written again at the end of the stage, which says why not in one line."""

from __future__ import annotations

from types import SimpleNamespace

from operations.stages import server_health, server_last_good

FULL = ("could not write the last known good (/var/lib/gpuhost/last-known-good.json."
        "gpuhost-tmp): No space left on device: the record /var/lib/gpuhost/last-known-good"
        ".json is as it was; free space there and run the deploy again, which records what "
        "serves")


def out(*lines):
    return SimpleNamespace(stdout_lines=list(lines), stderr_lines=[])


def host():
    return SimpleNamespace(print_prefix="[gpu1] ", name="gpu1")


def test_a_record_the_disk_cannot_hold_does_not_fail_the_gate(monkeypatch):
    monkeypatch.setattr(server_health, "health_gate", lambda host, argv: True)
    monkeypatch.setattr(server_health, "mark_verified", lambda host, units: True)
    ran = []
    monkeypatch.setattr(server_health.remote, "shell",
                        lambda host, command, **kw: ran.append(command) or (True, out(FULL)))
    assert server_health._wait_serving(None, host(), ["gate"], 60, ["sglang.service"],
                                record="python3 last_known_good.py record") is True
    assert ran == ["python3 last_known_good.py record"]


def test_the_end_of_the_stage_records_a_stale_record_and_says_a_full_disk_in_one_line(
        monkeypatch):
    said = []
    monkeypatch.setattr(server_last_good.logger, "error", said.append)
    monkeypatch.setattr(server_last_good.logger, "warning", said.append)
    answers = {"check": (True, out("stale: /etc/gpuhost/server.env differ from what it "
                                   "recorded")), "record": (True, out(FULL))}
    monkeypatch.setattr(server_last_good.remote, "shell",
                        lambda host, command, **kw: answers[command])
    assert server_last_good._record_if_stale(None, host(), "check", "record") is False
    assert said == [f"[gpu1] last known good: {FULL}"]
    answers["check"] = (True, out("fresh"))
    said.clear()
    assert server_last_good._record_if_stale(None, host(), "check", "record") is True and said == []


def test_the_record_state_reads_the_scripts_first_line():
    state = server_last_good.LastGoodState()
    assert state.process(["fresh"]) == "fresh"
    assert state.process([]).startswith("stale")
    # a fresh host has no record yet: nothing is stale (issue 42: "stale" on a new host)
    assert "absent: no last_known_good.py on the host yet" in state.command("python3 x check")
