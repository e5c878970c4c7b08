"""The roll's state across runs (operations/files/roll_state.py, router_membership.py): an
interrupted roll's drained worker comes back before another leaves, the last serving worker is
never drained, the unavailable budget counts what earlier runs left out; the roll state is
written whole; the router check's words are counted from the router's own list. Against
tests/test_roll.py's fake of smg 1.13.0's worker API."""

from __future__ import annotations

import errno
import json
import os

import pytest

from operations.files import roll_state, router_membership, router_workers
from tests.test_roll import FakeRouter, roll_state_file, router_url  # noqa: F401 (fixtures)

GPU1, GPU2, GPU3 = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def fleet(*urls: str) -> dict[str, str]:
    return {u: f"gpu{u.split('.')[3][0]}" for u in urls}


def listed(url: str, healthy: bool = True) -> dict:
    return {"id": f"w{url[-6]}", "url": url, "is_healthy": healthy, "status": "ready"}


def leave(router_url, url, monkeypatch, fleet_urls, max_unavailable=1):
    monkeypatch.setattr(router_membership.Roll, "fleet", fleet(*fleet_urls))
    monkeypatch.setattr(router_membership.Roll, "host", fleet(url)[url])
    monkeypatch.setattr(router_membership.Roll, "max_unavailable", max_unavailable)
    monkeypatch.setattr(router_membership.Roll, "resume_timeout", 0.3)
    return router_membership.leave(router_url, url, timeout=5, interval=0.01)


def test_an_interrupted_rolls_drained_worker_is_back_before_another_is_drained(
        router_url, roll_state_file, monkeypatch, capsys):
    """Issue 40 finding 1: the deploy killed after gpu1 left the router; the next run's roll
    of gpu2 puts gpu1 back (the router's own health checks pass) before it takes gpu2 out."""
    roll_state.mark(GPU1, "gpu1", "drained", str(roll_state_file))
    FakeRouter.workers = {GPU2: listed(GPU2)}  # gpu1 out, as the interrupted run left it
    assert leave(router_url, GPU2, monkeypatch, [GPU1, GPU2]) == 0
    assert FakeRouter.calls == [("POST", GPU1), ("DELETE", "w2")]
    assert FakeRouter.workers[GPU1]["is_healthy"] and GPU2 not in FakeRouter.workers
    out = capsys.readouterr().out
    assert "gpu1 (http://10.0.0.1:8000) is out of the router (drained by an earlier roll): " \
           "registering it again (202)" in out
    assert "gpu1 (http://10.0.0.1:8000) back in, healthy (the router's own health checks; " \
           "it was drained by an earlier roll)" in out
    assert set(roll_state.read(str(roll_state_file))) == {GPU2}
    assert roll_state.read(str(roll_state_file))[GPU2]["state"] == "drained"


def test_the_last_serving_worker_is_never_drained(router_url, roll_state_file, monkeypatch,
                                                  capsys):
    roll_state.mark(GPU1, "gpu1", "restarting", str(roll_state_file))
    FakeRouter.workers = {GPU2: listed(GPU2)}
    FakeRouter.down = {GPU1}  # its restart broke it: the router's checks never pass
    assert leave(router_url, GPU2, monkeypatch, [GPU1, GPU2]) == router_membership.REFUSED
    assert ("DELETE", "w2") not in FakeRouter.calls and FakeRouter.workers[GPU2]["is_healthy"]
    assert capsys.readouterr().err.strip() == (
        "router: gpu2 not taken out: it is the last worker the router serves through (gpu1 "
        "(restarting by a roll) out of the router): the fleet would serve nothing")
    assert set(roll_state.read(str(roll_state_file))) == {GPU1}  # gpu2 untouched, not in it


def test_the_unavailable_budget_counts_what_an_earlier_run_left_out(
        router_url, roll_state_file, monkeypatch, capsys):
    roll_state.mark(GPU1, "gpu1", "restarting", str(roll_state_file))
    FakeRouter.workers = {GPU2: listed(GPU2), GPU3: listed(GPU3)}
    FakeRouter.down = {GPU1}
    assert leave(router_url, GPU3, monkeypatch, [GPU1, GPU2, GPU3]) == router_membership.REFUSED
    assert capsys.readouterr().err.strip() == (
        "router: gpu3 not taken out: 1 other worker(s) of the fleet already out of the router "
        "(gpu1 (restarting by a roll)), and gpuhost_roll_max_unavailable = 1")
    assert GPU3 in FakeRouter.workers
    # a budget of 2: gpu3 may go, gpu2 still serves
    assert leave(router_url, GPU3, monkeypatch, [GPU1, GPU2, GPU3], max_unavailable=2) == 0
    assert GPU3 not in FakeRouter.workers
    assert {u: e["state"] for u, e in roll_state.read(str(roll_state_file)).items()} == {
        GPU1: "restarting", GPU3: "drained"}


def test_an_unhealthy_worker_the_roll_state_does_not_name_is_not_counted_as_out(
        router_url, monkeypatch, capsys):
    """Only what a roll took out counts against the budget: gpu1, listed unhealthy on its own,
    is the router's health checks' to judge; gpu2 still serves while gpu3 is out."""
    FakeRouter.workers = {GPU1: listed(GPU1, healthy=False), GPU2: listed(GPU2),
                          GPU3: listed(GPU3)}
    assert leave(router_url, GPU3, monkeypatch, [GPU1, GPU2, GPU3]) == 0
    assert FakeRouter.calls == [("DELETE", "w3")] and GPU3 not in FakeRouter.workers


def test_a_first_deploy_from_an_empty_router_waits_for_no_one_and_refuses_no_one(
        router_url, roll_state_file, monkeypatch, capsys):
    """The CI order's first fleet deploy (hosts booted from a converged image, a new router):
    the router lists no worker yet and gpu2, gpu3 do not answer it yet (their gates come with
    their own turns). gpu1 is not out of the router, nor are they: nothing is registered or
    waited for, nothing refused, and no roll state entry is made for a worker the router never
    listed; gpu1's join adds it."""
    FakeRouter.workers = {}
    FakeRouter.down = {GPU2, GPU3}
    assert leave(router_url, GPU1, monkeypatch, [GPU1, GPU2, GPU3]) == 0
    assert FakeRouter.calls == []
    assert capsys.readouterr().out.strip() == (
        "router: http://10.0.0.1:8000 is not listed: nothing to take out (added once its "
        "restart passed the health gate)")
    assert router_membership.restarting(router_url, GPU1, 1, 0.01) == 0
    assert roll_state.read(str(roll_state_file)) == {}
    assert router_membership.join(router_url, GPU1, timeout=5, interval=0.01) == 0
    assert FakeRouter.workers[GPU1]["is_healthy"]
    # the next position: gpu1 serves, gpu2 has never been listed: taken through, not refused
    FakeRouter.calls = []
    assert leave(router_url, GPU2, monkeypatch, [GPU1, GPU2, GPU3]) == 0
    assert FakeRouter.calls == [] and roll_state.read(str(roll_state_file)) == {}


def test_the_roll_state_names_who_is_waited_for_and_counted(router_url, roll_state_file,
                                                            monkeypatch, capsys):
    """gpu1 drained by an earlier roll, gpu3 never listed (just added to the inventory): only
    gpu1 is registered again and waited for; gpu3 is not counted as out, so gpu2 may go."""
    roll_state.mark(GPU1, "gpu1", "drained", str(roll_state_file))
    FakeRouter.workers = {GPU2: listed(GPU2)}
    FakeRouter.down = {GPU3}
    assert leave(router_url, GPU2, monkeypatch, [GPU1, GPU2, GPU3]) == 0
    assert FakeRouter.calls == [("POST", GPU1), ("DELETE", "w2")]
    assert "gpu3" not in capsys.readouterr().out
    assert {u: e["state"] for u, e in roll_state.read(str(roll_state_file)).items()} == {
        GPU2: "drained"}


def test_a_drained_worker_that_does_not_come_back_is_out_and_refuses_the_next(
        router_url, roll_state_file, monkeypatch, capsys):
    roll_state.mark(GPU1, "gpu1", "drained", str(roll_state_file))
    FakeRouter.workers = {GPU2: listed(GPU2), GPU3: listed(GPU3)}
    FakeRouter.down = {GPU1}
    assert leave(router_url, GPU3, monkeypatch, [GPU1, GPU2, GPU3]) == router_membership.REFUSED
    assert ("DELETE", "w3") not in FakeRouter.calls and FakeRouter.calls[0] == ("POST", GPU1)
    assert capsys.readouterr().err.strip() == (
        "router: gpu3 not taken out: 1 other worker(s) of the fleet already out of the router "
        "(gpu1 (drained by a roll)), and gpuhost_roll_max_unavailable = 1")


def test_the_last_serving_worker_is_refused_even_where_the_other_is_not_a_rolls(
        router_url, monkeypatch, capsys):
    """gpu1 listed, unhealthy on its own; gpu2 listed and serving: draining gpu2 would leave the
    router nothing to serve through."""
    FakeRouter.workers = {GPU1: listed(GPU1, healthy=False), GPU2: listed(GPU2)}
    assert leave(router_url, GPU2, monkeypatch, [GPU1, GPU2]) == router_membership.REFUSED
    assert FakeRouter.calls == []
    assert capsys.readouterr().err.strip() == (
        "router: gpu2 not taken out: it is the last worker the router serves through (gpu1 "
        "(listed, unhealthy) out of the router): the fleet would serve nothing")


def test_a_worker_that_serves_nothing_itself_is_not_the_last_serving_one(router_url,
                                                                         monkeypatch):
    """gpu2 listed but unhealthy, gpu1 never listed: draining gpu2 takes nothing away."""
    FakeRouter.workers = {GPU2: listed(GPU2, healthy=False)}
    assert leave(router_url, GPU2, monkeypatch, [GPU1, GPU2]) == 0
    assert FakeRouter.calls == [("DELETE", "w2")]


def test_a_fleet_of_one_worker_is_drained_and_said(router_url, monkeypatch, capsys):
    assert leave(router_url, GPU2, monkeypatch, [GPU2]) == 0
    assert "gpu2 is the fleet's only worker: requests through the router fail until it is " \
           "back" in capsys.readouterr().out


def test_join_takes_the_worker_out_of_the_roll_state(router_url, roll_state_file, monkeypatch):
    assert leave(router_url, GPU2, monkeypatch, [GPU2]) == 0
    assert router_membership.restarting(router_url, GPU2, 1, 0.01) == 0
    assert roll_state.read(str(roll_state_file))[GPU2]["state"] == "restarting"
    assert router_membership.join(router_url, GPU2, timeout=5, interval=0.01) == 0
    assert roll_state.read(str(roll_state_file)) == {}
    # a join that fails keeps the entry: the next run counts it as out
    roll_state.mark(GPU2, "gpu2", "restarting", str(roll_state_file))
    FakeRouter.workers, FakeRouter.down = {}, {GPU2}
    assert router_membership.join(router_url, GPU2, timeout=0.2, interval=0.01) == 1
    assert roll_state.read(str(roll_state_file))[GPU2]["state"] == "restarting"


def test_the_roll_state_is_written_whole_and_a_full_disk_leaves_the_old_one(tmp_path,
                                                                           monkeypatch):
    path = tmp_path / "roll-state.json"
    roll_state.mark(GPU1, "gpu1", "drained", str(path))
    before = path.read_text()
    assert json.loads(before)[GPU1]["host"] == "gpu1" and oct(path.stat().st_mode)[-3:] == "600"
    real_fsync = os.fsync

    def full(fd):
        if os.path.isfile(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(roll_state.os, "fsync", full)
    with pytest.raises(roll_state.StateError) as caught:
        roll_state.mark(GPU2, "gpu2", "draining", str(path))
    assert str(caught.value) == (
        f"the roll state {path} could not be written (no space left on its file system): the "
        "old one is left as it was; nothing more was changed")
    assert path.read_text() == before and sorted(os.listdir(tmp_path)) == ["roll-state.json"]


def test_a_roll_state_that_does_not_parse_is_one_line(tmp_path):
    path = tmp_path / "roll-state.json"
    path.write_text("{not json")
    with pytest.raises(roll_state.StateError, match="cannot be read"):
        roll_state.read(str(path))


def test_a_roll_state_others_may_write_is_not_trusted_and_nothing_is_taken_out(
        router_url, roll_state_file, monkeypatch, capsys, tmp_path):
    """A roll state on the router host that someone else may write (world-writable, another
    owner) or that is a symlink is refused in one line, naming it and what is allowed, before
    any worker leaves. Trusted, a local user's edit drained one worker more than the budget:
    gpu1 out by an interrupted run (down, its entry removed by the stranger), gpu3 left while
    the budget of 1 was spent."""
    import pwd

    roll_state.mark(GPU1, "gpu1", "restarting", str(roll_state_file))
    roll_state_file.chmod(0o666)
    roll_state_file.write_text("{}\n")  # the stranger's edit: gpu1 no longer out
    FakeRouter.workers = {GPU2: listed(GPU2), GPU3: listed(GPU3)}
    FakeRouter.down = {GPU1}
    # the class of the module router_membership imported (a top-level roll_state where another
    # test put operations/files on sys.path, as on the host); main() says it: "router: ..."
    with pytest.raises(router_membership.roll_state.StateError) as caught:
        leave(router_url, GPU3, monkeypatch, [GPU1, GPU2, GPU3])
    assert GPU3 in FakeRouter.workers and ("DELETE", "w3") not in FakeRouter.calls
    assert str(caught.value) == (
        f"the roll state {roll_state_file} is not trusted (a regular file, owned by uid "
        f"{os.geteuid()}, mode 0666): allowed: a regular file owned by the deploy's user (root) "
        "that no one else may write (mode 0600, as the deploy writes it); see who changed it, "
        "then remove it (the next run registers every worker the router does not list)")
    link = tmp_path / "link.json"
    link.symlink_to(roll_state_file)
    with pytest.raises(roll_state.StateError, match=r"is not trusted \(a symlink\)"):
        roll_state.read(str(link))
    if os.geteuid() == 0:
        roll_state_file.chmod(0o600)
        os.chown(roll_state_file, pwd.getpwnam("nobody").pw_uid, -1)
        with pytest.raises(roll_state.StateError, match="owned by uid 65534, mode 0600"):
            roll_state.read(str(roll_state_file))
    # the deploy's own: read as before
    roll_state.mark(GPU1, "gpu1", "drained", str(tmp_path / "own.json"))
    assert set(roll_state.read(str(tmp_path / "own.json"))) == {GPU1}


def test_a_full_disk_stops_leave_with_one_line_before_the_worker_is_taken_out(
        router_url, roll_state_file, monkeypatch, capsys, tmp_path):
    control = tmp_path / "control.key"
    control.write_text("control-key-0123456789\n")
    control.chmod(0o600)

    def full(entries, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    # the module router_membership imported (top-level roll_state where another test put
    # operations/files on sys.path, as on the host)
    monkeypatch.setattr(router_membership.roll_state, "_write", full)
    monkeypatch.setattr("sys.argv", ["x", "leave", "--router", router_url, "--url", GPU2,
                                     "--timeout", "1", "--control-key-file", str(control),
                                     "--state", str(roll_state_file), "--fleet", f"gpu2={GPU2}"])
    assert router_membership.main() == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("router: the roll state ") and "no space left" in err
    assert "\n" not in err and GPU2 in FakeRouter.workers  # never taken out


# --- the router check's words: what the router's own list says after the run -------------------

def check(router_url, monkeypatch, capsys, tmp_path, *args) -> tuple[int, str]:
    control = tmp_path / "control.key"
    control.write_text("control-key-0123456789\n")
    control.chmod(0o600)
    monkeypatch.setattr("sys.argv", ["x", "--router", router_url, "--timeout", "3", "--interval",
                                     "0.01", "--control-key-file", str(control), *args])
    rc = router_workers.main()
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_a_worker_removed_from_the_inventory_is_not_counted_as_configured(
        router_url, monkeypatch, capsys, tmp_path):
    """Issue 40 finding 3: one worker configured, the router listing two: never "all 2
    worker(s) listed and healthy"."""
    FakeRouter.workers = {GPU1: listed(GPU1), GPU2: listed(GPU2)}
    monkeypatch.setattr(FakeRouter, "drain_polls", 10 ** 6)
    rc, said = check(router_url, monkeypatch, capsys, tmp_path, "--remove-others", "--name",
                     f"gpu1={GPU1}", GPU1)
    assert rc == 0
    assert said.splitlines()[-1] == (
        "router: 1 of 1 configured worker(s) listed and healthy (gpu1 (http://10.0.0.1:8000)); "
        "removed, still draining: http://10.0.0.2:8000")


def test_a_drained_worker_whose_host_failed_is_registered_again(router_url, roll_state_file,
                                                                monkeypatch, capsys, tmp_path):
    """Issue 40 finding 2: gpu2's link dropped after its drain, before its restart: its server
    never touched, the router's own health checks pass, and it serves again; the words say
    where it is."""
    roll_state.mark(GPU2, "gpu2", "drained", str(roll_state_file))
    FakeRouter.workers = {GPU1: listed(GPU1)}
    rc, said = check(router_url, monkeypatch, capsys, tmp_path, "--register", "--remove-others",
                     "--roll-state", str(roll_state_file), "--name", f"gpu1={GPU1}", "--name",
                     f"gpu2={GPU2}", "--keep", GPU2, GPU1)
    assert rc == 0 and FakeRouter.workers[GPU2]["is_healthy"]
    assert "gpu2 (http://10.0.0.2:8000) was drained by the roll and its server not touched: " \
           "registering http://10.0.0.2:8000 again (202)" in said
    assert said.splitlines()[-1] == (
        "router: 1 of 1 configured worker(s) listed and healthy (gpu1 (http://10.0.0.1:8000)); "
        "gpu2 (http://10.0.0.2:8000), whose host failed in this run: listed and healthy")
    assert roll_state.read(str(roll_state_file)) == {}  # back: out of the roll state


def test_a_failed_restart_stays_out_and_the_words_say_so(router_url, roll_state_file,
                                                         monkeypatch, capsys, tmp_path):
    roll_state.mark(GPU2, "gpu2", "restarting", str(roll_state_file))
    FakeRouter.workers = {GPU1: listed(GPU1)}
    rc, said = check(router_url, monkeypatch, capsys, tmp_path, "--register", "--remove-others",
                     "--roll-state", str(roll_state_file), "--name", f"gpu2={GPU2}",
                     "--keep", GPU2, GPU1)
    assert rc == 0 and GPU2 not in FakeRouter.workers
    assert ("POST", GPU2) not in FakeRouter.calls
    assert said.splitlines()[-1].endswith(
        "gpu2 (http://10.0.0.2:8000), whose host failed in this run: out of the router, "
        "restarting by a roll")
    assert set(roll_state.read(str(roll_state_file))) == {GPU2}
