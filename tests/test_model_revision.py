"""One model commit per fleet (issue 40, finding 6): operations/plans/model_revision.py's decision,
from what the fleet's hosts hold and what the Hub names now; the stand-in hub's moving main;
model_room.py's commit-only answer; the weights' copy being current only at the fleet's
commit."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer

from operations import REPO_ROOT
from operations.facts.model_facts import is_current
from operations.plans.model_revision import decide, pinned
from sandbox import hub

REPO = "org/model"
OLD, NEW, OTHER = "a" * 40, "b" * 40, "c" * 40


def test_a_pinned_commit_is_the_fleets_with_nothing_asked():
    assert pinned(OLD) and not pinned("main") and not pinned("A" * 40) and not pinned("abc123")
    assert decide(REPO, OLD, {"gpu1": NEW}, [], {}).commit == OLD


def test_a_host_added_after_main_moved_gets_the_commit_the_fleet_holds():
    d = decide(REPO, "main", {"gpu1": OLD, "gpu2": OLD}, ["gpu3"], {"sha": NEW})
    assert d.commit == OLD and d.warn and d.refused is None
    assert d.line == (
        f"model revision: main of org/model moved on the Hub from {OLD[:12]} to {NEW[:12]}: "
        f"the fleet stays at {OLD[:12]}, the commit gpu1, gpu2 hold; gpu3, without it, gets "
        f"{OLD[:12]} too, not {NEW[:12]}; to serve {NEW[:12]}, set gpuhost_model_revision = "
        f"'{NEW}' (every host downloads it and restarts, behind a router one at a time)")


def test_main_where_it_was_is_said_plainly():
    d = decide(REPO, "main", {"gpu1": OLD}, ["gpu2"], {"sha": OLD})
    assert (d.commit, d.warn) == (OLD, False)
    assert d.line == (f"model revision: main of org/model is commit {OLD[:12]}, the commit gpu1 "
                      "holds; gpu2, without it, gets it too")


def test_a_fresh_fleet_takes_the_hubs_commit_once():
    d = decide(REPO, "main", {}, ["gpu1", "gpu2"], {"sha": NEW})
    assert (d.commit, d.warn) == (NEW, False)
    assert "every host of the fleet gets that commit (gpu1, gpu2)" in d.line


def test_the_hub_unreachable_is_said_never_guessed():
    held = decide(REPO, "main", {"gpu1": OLD}, [], {"error": "URLError timed out"}, "from gpu1")
    assert (held.commit, held.warn) == (OLD, True)
    assert "whether main of org/model moved on the Hub is unknown (the Hub did not answer " \
           "from gpu1: URLError timed out): the fleet stays at" in held.line
    none = decide(REPO, "main", {}, ["gpu1"], {"error": "URLError timed out"}, "from gpu1")
    assert (none.commit, none.warn) == (None, True)
    assert none.line.startswith("model revision: the commit of main of org/model is unknown")


def test_two_commits_under_one_name_are_refused_naming_each():
    d = decide(REPO, "main", {"gpu1": OLD, "gpu2": OLD, "gpu3": OTHER}, [], {"sha": NEW})
    assert d.commit is None and d.line is None
    assert d.refused == (
        f"the fleet's hosts hold 2 commits of main of org/model: {OLD} (gpu1, gpu2); {OTHER} "
        f"(gpu3); the Hub names {NEW} now: one served name, 2 models. Set "
        "gpuhost_model_revision to the commit every host is to serve (its hosts keep their "
        "copies; the others download it and restart)")


def test_a_host_whose_copy_was_not_read_is_said_and_not_counted():
    d = decide(REPO, "main", {"gpu1": OLD}, [], {"sha": OLD}, unread={"gpu2": "ConnectError"})
    assert d.commit == OLD and d.warn
    assert d.line.endswith("; gpu2's copy was not read (ConnectError): not counted")


def test_a_copy_is_current_only_at_the_fleets_commit():
    stamp = {"repo": REPO, "revision": "main", "sha": OLD, "complete": True}
    assert is_current(stamp, REPO, "main")  # without a fleet commit: the branch's name
    assert is_current(stamp, REPO, "main", OLD)
    assert not is_current(stamp, REPO, "main", NEW)
    assert not is_current({**stamp, "complete": False}, REPO, "main", OLD)


def _serve():
    hub.Handler.hub = hub.Hub("hf_test")
    server = ThreadingHTTPServer(("127.0.0.1", 0), hub.Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _commit(endpoint: str, revision: str, token_file: str) -> dict:
    script = (REPO_ROOT / "operations/files/model_room.py").read_text()
    done = subprocess.run([sys.executable, "-c", script, endpoint, hub.REPO_ID, revision, "",
                           token_file], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_the_stand_in_hubs_main_moves_and_the_old_commit_stays(tmp_path):
    import urllib.request

    token = tmp_path / "token"
    token.write_text("hf_test\n")
    server, endpoint = _serve()
    try:
        old = _commit(endpoint, "main", str(token))["sha"]
        with urllib.request.urlopen(urllib.request.Request(
                f"{endpoint}/_sandbox/move-main?repo={hub.REPO_ID}", data=b"",
                method="POST")) as answer:
            moved = json.loads(answer.read())
        assert moved["from"] == old and moved["to"] != old
        assert _commit(endpoint, "main", str(token)) == {"sha": moved["to"]}
        assert _commit(endpoint, old, str(token)) == {"sha": old}  # still served by its sha
        assert "error" in _commit(endpoint, "d" * 40, str(token))  # 404 RevisionNotFound
        readme = urllib.request.Request(f"{endpoint}/{hub.REPO_ID}/resolve/{old}/README.md",
                                        headers={"Authorization": "Bearer hf_test"})
        with urllib.request.urlopen(readme) as answer:
            assert answer.headers["X-Repo-Commit"] == old
            assert b"Commit 2" not in answer.read()
        assert "hf_test" not in json.dumps(_commit(endpoint, "main", str(token)))
    finally:
        server.shutdown()


def test_the_fleets_commit_is_decided_once_a_run_and_a_refusal_reaches_every_host(monkeypatch):
    from types import SimpleNamespace

    from operations.plans import model_revision as mr
    from operations.plans.settings import Settings

    run = SimpleNamespace(failed_hosts=set())
    current = SimpleNamespace(name="gpu1", print_prefix="[gpu1] ")
    asked, said, refused = [], [], []
    stamps = {"gpu1": {"repo": REPO, "revision": "main", "sha": OLD, "complete": True},
              "gpu2": {"repo": REPO, "revision": "main", "sha": OLD, "complete": True},
              "gpu3": {}}
    monkeypatch.setattr(mr, "state", run)
    monkeypatch.setattr(mr, "host", current)
    monkeypatch.setattr(mr, "fact_of", lambda name, cls, **kw: stamps[name])
    monkeypatch.setattr(mr, "fact", lambda cls, **kw: asked.append(kw) or {"sha": NEW})
    monkeypatch.setattr(mr, "refuse", lambda stage, reason: refused.append((current.name, reason)))
    monkeypatch.setattr(mr.logger, "warning", said.append)
    every = {n: Settings(model=REPO) for n in stamps}
    mr.configure(every)
    assert mr.fleet_commit(every["gpu1"]) == OLD
    current.name = "gpu3"
    assert mr.fleet_commit(every["gpu3"]) == OLD  # the added host: the fleet's, not main's now
    assert len(asked) == 1 and len(said) == 1 and "moved on the Hub" in said[0]
    assert refused == []
    # copies of two commits: every host of the fleet is refused, once each
    run2 = SimpleNamespace(failed_hosts=set())
    monkeypatch.setattr(mr, "state", run2)
    stamps["gpu3"] = {"repo": REPO, "revision": "main", "sha": NEW, "complete": True}
    mr.configure(every)
    for name in ("gpu1", "gpu2", "gpu3", "gpu3"):
        current.name = name
        assert mr.fleet_commit(every[name]) is None
    assert [n for n, _ in refused] == ["gpu1", "gpu2", "gpu3"]


def test_hosts_that_reach_the_hub_at_other_endpoints_are_one_fleet(monkeypatch):
    """The sandbox gives each host the Hub stand-in on its own link's address; a lab may give
    hosts different mirrors: one repository and revision is one fleet all the same."""
    from types import SimpleNamespace

    from operations.plans import model_revision as mr
    from operations.plans.settings import Settings

    current = SimpleNamespace(name="gpu3", print_prefix="[gpu3] ")
    stamps = {"gpu1": {"repo": REPO, "revision": "main", "sha": OLD, "complete": True},
              "gpu3": {}}
    monkeypatch.setattr(mr, "state", SimpleNamespace(failed_hosts=set()))
    monkeypatch.setattr(mr, "host", current)
    monkeypatch.setattr(mr, "fact_of", lambda name, cls, **kw: stamps[name])
    monkeypatch.setattr(mr, "fact", lambda cls, **kw: {"sha": NEW})
    monkeypatch.setattr(mr.logger, "warning", lambda line: None)
    mr.configure({"gpu1": Settings(model=REPO, hf_endpoint="http://10.0.1.1:8090"),
                  "gpu3": Settings(model=REPO, hf_endpoint="http://10.0.3.1:8090")})
    assert mr.fleet_commit(Settings(model=REPO, hf_endpoint="http://10.0.3.1:8090")) == OLD
