"""The deploy lock's host side (operations/files/deploy_lock.py), run here as the host runs it,
and how the controller says who holds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from operations.stages import deploy_lock

SCRIPT = Path(deploy_lock.SCRIPT)


class Holder:
    """The holder process, its stdin the controller's heartbeats, its stdout the protocol."""

    def __init__(self, run_dir: Path, mode: str = "exclusive", wait: float = 0,
                 silence: float = 300, who: str = "ops@laptop", pid: int = 4242,
                 evict: list | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--mode", mode, "--wait", str(wait), "--run-dir",
             str(run_dir), "--silence", str(silence),
             "--holder", json.dumps({"controller": who, "controller_pid": pid}),
             *(["--evict", json.dumps(evict)] if evict is not None else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def line(self) -> str:
        return self.proc.stdout.readline().strip().lstrip(".")

    def end(self) -> int:
        self.proc.stdin.close()
        return self.proc.wait(timeout=10)


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


def test_a_second_deploy_is_told_who_holds_it(run_dir):
    first = Holder(run_dir)
    assert first.line() == "held"
    second = Holder(run_dir, who="cron@ctl")
    said = second.line()
    assert said.startswith("busy ")
    (holder,) = json.loads(said[len("busy "):])
    assert holder["controller"] == "ops@laptop" and holder["controller_pid"] == 4242
    assert holder["mode"] == "exclusive" and holder["since"].endswith("Z")
    assert second.proc.wait(timeout=10) == 75
    assert first.end() == 0
    assert list((run_dir / "deploy-lock.d").iterdir()) == []


def test_dry_runs_share_it_and_a_deploy_waits_for_them(run_dir):
    dry1, dry2 = Holder(run_dir, "shared"), Holder(run_dir, "shared")
    assert dry1.line() == "held" and dry2.line() == "held"
    deploy = Holder(run_dir, wait=30)
    assert deploy.line().startswith("waiting ")
    dry1.end()
    dry2.end()
    assert deploy.line() == "held"
    assert deploy.end() == 0


def test_it_lets_go_when_the_run_falls_silent(run_dir):
    first = Holder(run_dir, silence=1)
    assert first.line() == "held"
    time.sleep(1.5)  # no heartbeat: the link dropped without a word
    assert first.proc.wait(timeout=20) == 0
    second = Holder(run_dir)
    assert second.line() == "held"
    second.end()


def test_heartbeats_keep_it(run_dir):
    first = Holder(run_dir, silence=1)
    assert first.line() == "held"
    for _ in range(4):
        time.sleep(0.5)
        first.proc.stdin.write("\n")
        first.proc.stdin.flush()
    assert first.proc.poll() is None
    assert Holder(run_dir).line().startswith("busy ")
    first.end()


def test_a_holder_killed_with_its_channel_is_not_reported(run_dir):
    first = Holder(run_dir)
    assert first.line() == "held"
    first.proc.kill()
    first.proc.wait()
    second = Holder(run_dir)
    assert second.line() == "held"  # the lock died with the process; its record is swept
    assert [p.name for p in (run_dir / "deploy-lock.d").iterdir()] == [f"{second.proc.pid}.json"]
    second.end()


def test_who_holds_it_in_words():
    said = deploy_lock._describe(json.dumps([
        {"mode": "exclusive", "controller": "ops@laptop", "controller_pid": 4242,
         "login": "ubuntu", "since": "2026-12-01T14:02:11Z"}]))
    assert said == ("a deploy by ops@laptop (pyinfra pid 4242, logged in as ubuntu, since "
                    "2026-12-01T14:02:11Z)")
    assert deploy_lock._describe("[]") == "another run"
    assert deploy_lock._describe("not json") == "another run"


def test_a_holder_whose_run_is_gone_is_evicted_by_the_next_run(run_dir):
    # a link that dropped mid-run: the old holder still waits for heartbeats
    stale = Holder(run_dir)
    assert stale.line() == "held"
    nxt = Holder(run_dir, who="ops@laptop", pid=5151,
                 evict=[{"controller": "ops@laptop", "controller_pid": 4242}])
    said = nxt.line()
    assert said.startswith("evicted ") and json.loads(said[8:])[0]["controller_pid"] == 4242
    assert nxt.line() == "held"
    assert stale.proc.wait(timeout=10) == 0
    assert [p.name for p in (run_dir / "deploy-lock.d").iterdir()] == [f"{nxt.proc.pid}.json"]
    nxt.end()


def test_a_holder_not_named_keeps_the_lock(run_dir):
    dry_gone = Holder(run_dir, "shared")
    dry_live = Holder(run_dir, "shared", who="cron@ctl", pid=7)
    assert dry_gone.line() == "held" and dry_live.line() == "held"
    deploy = Holder(run_dir, evict=[{"controller": "ops@laptop", "controller_pid": 4242}])
    assert deploy.line().startswith("busy ")  # the live dry run holds it too: nobody evicted
    assert deploy.proc.wait(timeout=10) == 75
    assert dry_gone.proc.poll() is None
    dry_gone.end()
    dry_live.end()


def _ended_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_controller_names_only_its_own_runs_that_ended(monkeypatch):
    monkeypatch.setattr(deploy_lock, "_holder",
                        lambda: json.dumps({"controller": "ops@ctl", "controller_pid": 1}))
    ended = _ended_pid()
    mine_ended = {"controller": "ops@ctl", "controller_pid": ended, "pid": 99, "mode": "exclusive"}
    assert deploy_lock.gone_runs(json.dumps([mine_ended])) == [
        {"controller": "ops@ctl", "controller_pid": ended}]
    live = {**mine_ended, "controller_pid": os.getpid()}
    other = {**mine_ended, "controller": "cron@other"}
    itself = {**mine_ended, "controller_pid": 1}
    for holders in ([live], [other], [itself], [mine_ended, other], []):
        assert deploy_lock.gone_runs(json.dumps(holders)) == []
    assert deploy_lock.gone_runs("not json") == []


@pytest.mark.parametrize("record", [
    {"controller": "ops@laptop", "controller_pid": 4242, "pid": 1},  # a pid another has now
    {"controller": "ops@laptop", "controller_pid": 4242, "pid": 0},  # kill(0) is the group
    {"controller": "ops@laptop", "controller_pid": 4242, "pid": True},
    '{"controller": "ops@laptop", "pid": ',  # cut short
    ["a list"],
])
def test_a_record_of_no_holder_neither_blocks_nor_is_reported(run_dir, record):
    records = run_dir / "deploy-lock.d"
    records.mkdir(parents=True)
    (records / "1.json").write_text(record if isinstance(record, str) else json.dumps(record))
    first = Holder(run_dir)
    assert first.line() == "held"
    assert [p.name for p in records.iterdir()] == [f"{first.proc.pid}.json"]  # swept
    (records / "1.json").write_text(record if isinstance(record, str) else json.dumps(record))
    second = Holder(run_dir, who="cron@ctl")
    (holder,) = json.loads(second.line()[len("busy "):])
    assert holder["pid"] == first.proc.pid
    nxt = Holder(run_dir, pid=5151, evict=[{"controller": "ops@laptop", "controller_pid": 4242}])
    assert nxt.line().startswith("evicted ") and nxt.line() == "held"
    assert first.proc.wait(timeout=10) == 0
    nxt.end()


def test_a_lock_folder_it_cannot_make_is_said_in_one_line(tmp_path):
    (tmp_path / "run").write_text("a file where the folder should be")
    holder = Holder(tmp_path / "run")
    said = holder.line()
    assert said.startswith(f"error {tmp_path / 'run'} is a plain file, not a folder: "), said
    assert holder.proc.wait(timeout=10) == 73
    assert holder.proc.stdout.read() == ""


def test_a_run_of_another_pid_space_or_a_reused_pid_is_told_apart(monkeypatch):
    me = {"controller": "ops@ctl", "controller_pid": os.getpid(),
          "controller_pids": deploy_lock._pid_space(), "controller_start": 1}
    monkeypatch.setattr(deploy_lock, "_holder", lambda: json.dumps(me))
    ended = _ended_pid()
    gone = {**me, "controller_pid": ended, "pid": 99}
    assert deploy_lock.gone_runs(json.dumps([gone])) == [
        {k: gone[k] for k in deploy_lock._RUN_KEYS}]
    # the same user@host in another container: its pid means nothing here
    elsewhere = {**gone, "controller_pids": "another-boot pid:[1]"}
    unsaid = {k: v for k, v in gone.items() if k != "controller_pids"}
    # a live process has the pid now: started later than the run that took the lock
    reused = {**gone, "controller_pid": 1, "controller_start": -1}
    live = {**gone, "controller_pid": 1, "controller_start": deploy_lock._start(1)}
    assert deploy_lock.gone_runs(json.dumps([reused])) == [
        {k: reused[k] for k in deploy_lock._RUN_KEYS}]
    for holders in ([elsewhere], [unsaid], [live], [gone, live], ["a string"], [1]):
        assert deploy_lock.gone_runs(json.dumps(holders)) == []


def test_the_host_that_cannot_hold_it_is_named_with_why(monkeypatch):
    said = iter(["error [Errno 30] Read-only file system: '/run/gpuhost/deploy-lock.d'\n"])
    monkeypatch.setattr(deploy_lock, "_command", lambda *a: "")
    monkeypatch.setattr(deploy_lock, "_open", lambda target, command: deploy_lock._Held(
        "", None, lambda: next(said), lambda: None))
    why = deploy_lock._take(type("Target", (), {"print_prefix": "", "name": "gpu1"}),
                            "exclusive", 0)
    assert why == ("the host cannot hold the deploy lock: [Errno 30] Read-only file system: "
                   "'/run/gpuhost/deploy-lock.d'")


def test_two_takeovers_at_once_leave_one_holder(run_dir):
    stale = Holder(run_dir)
    assert stale.line() == "held"
    gone = [{"controller": "ops@laptop", "controller_pid": 4242}]
    a, b = Holder(run_dir, pid=5151, evict=gone), Holder(run_dir, pid=6161, evict=gone)
    said = {}
    for run in (a, b):
        line = run.line()
        said[run] = run.line() if line.startswith("evicted ") else line
    (winner,) = [run for run in (a, b) if said[run] == "held"]
    (loser,) = [run for run in (a, b) if run is not winner]
    (holder,) = json.loads(said[loser][len("busy "):])  # the winner, never evicted in turn
    assert holder["pid"] == winner.proc.pid and winner.proc.poll() is None
    assert loser.proc.wait(timeout=20) == 75
    winner.end()


def test_a_lock_held_by_a_process_of_no_run_names_that_process(run_dir):
    run_dir.mkdir()
    script = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
              "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", script, str(run_dir / "deploy.lock")],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "locked\n"
        said = Holder(run_dir).line()
        (holder,) = json.loads(said[len("busy "):])
        assert holder["pid"] == other.pid and holder["process"].startswith(sys.executable)
        assert deploy_lock._describe(said[len("busy "):]) == (
            f"process {other.pid} on the host ({holder['process']}), not a gpuhost run")
    finally:
        other.kill()
        other.wait()


class LocalConnector:
    """Named as pyinfra's: deploy_lock._open starts the holder as a local process for it."""


def test_a_holder_that_never_ran_is_said_with_its_complaint(monkeypatch):
    monkeypatch.setattr(deploy_lock, "_command", lambda *a: (
        "echo 'sudo: a terminal is required to read the password' >&2; exit 1"))
    target = type("Target", (), {"print_prefix": "", "name": "gpu1",
                                 "connector": LocalConnector()})
    assert deploy_lock._take(target, "exclusive", 0) == (
        "the deploy lock's holder on the host said 'nothing', and on stderr 'sudo: a terminal "
        "is required to read the password' (is python3 there?)")
    over_ssh = deploy_lock._Held("", None, None, None,
                                 errors=lambda: b"sh: 1: python3: not found\n")
    assert deploy_lock._complaint(over_ssh) == ", and on stderr 'sh: 1: python3: not found'"


def test_a_lock_path_that_is_a_symlink_is_refused_and_its_target_not_made(tmp_path):
    """/run/gpuhost/deploy.lock -> /etc/x must not make root create /etc/x (issue 29, 6)."""
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "etc-x"
    (run / "deploy.lock").symlink_to(target)
    holder = Holder(run)
    said = holder.line()
    assert said == (f"error {run}/deploy.lock is a symbolic link (to {target}), not a plain file:"
                    " the deploy lock does not follow or use it (remove it: sudo rm "
                    f"{run}/deploy.lock; gpuhost makes it again)")
    assert holder.proc.wait(timeout=10) == 73
    assert not target.exists() and not target.is_symlink()


def test_a_dangling_link_to_an_existing_file_is_not_locked_through(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "passwd"
    target.write_text("root:x:0:0\n")
    (run / "deploy.lock").symlink_to(target)
    holder = Holder(run)
    assert holder.line().startswith(f"error {run}/deploy.lock is a symbolic link (to {target})")
    assert holder.proc.wait(timeout=10) == 73
    assert target.read_text() == "root:x:0:0\n"


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_lock_path_that_is_not_a_plain_file_is_refused(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    lock = run / "deploy.lock"
    lock.mkdir() if kind == "folder" else os.mkfifo(lock)
    holder = Holder(run)
    said = holder.line()
    word = {"folder": "a folder", "fifo": "a FIFO"}[kind]
    assert said.startswith(f"error {lock} is {word}, not a plain file: "), said
    assert holder.proc.wait(timeout=10) == 73


def test_a_record_folder_that_is_a_link_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "deploy-lock.d").symlink_to(elsewhere)
    holder = Holder(run)
    assert holder.line().startswith(f"error {run}/deploy-lock.d is a symbolic link "
                                    f"(to {elsewhere}), not a folder: ")
    assert holder.proc.wait(timeout=10) == 73
    assert list(elsewhere.iterdir()) == []


def test_a_plain_lock_file_left_by_an_earlier_run_is_used(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "deploy.lock").write_text("")
    holder = Holder(run)
    assert holder.line() == "held"
    assert holder.end() == 0


def test_a_bench_holding_the_lock_is_said_to_be_a_bench():
    """A --dry during a bench was told "gpu1 is being deployed: a deploy by ...": it is a
    bench (bench.py takes the lock with job "bench", which the holder's record keeps)."""
    bench = json.dumps([{"mode": "exclusive", "job": "bench", "controller": "ops@laptop",
                         "controller_pid": 4242, "login": "root", "since": "2026-12-03T09:00Z"}])
    assert deploy_lock._describe(bench).startswith("a bench (bench.py) by ops@laptop")
    assert deploy_lock._doing(bench) == "being benched"
    deploy = bench.replace('"bench"', '"deploy"')
    assert deploy_lock._describe(deploy).startswith("a deploy by ops@laptop")
    assert deploy_lock._doing(deploy) == "being deployed"
    try:
        deploy_lock._job = "bench"
        assert json.loads(deploy_lock._holder())["job"] == "bench"
    finally:
        deploy_lock._job = "deploy"
