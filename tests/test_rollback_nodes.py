"""A rollback on a node of a server across hosts (operations/stages/rollback.py): one an earlier run
began while the host served alone is refused, not finished by restarting one rank alone."""

from types import SimpleNamespace

from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from operations.stages import rollback


def _plan(monkeypatch, nodes):
    said, planned = [], []
    monkeypatch.setattr(rollback, "refuse", lambda stage, reason: said.append((stage, reason)))
    monkeypatch.setattr(rollback, "rolled_back", lambda **kw: planned.append(kw))
    monkeypatch.setattr(rollback, "settings_gate_argv", lambda s: ["gate"])

    def shipped(**kw):
        planned.append({"shipped": kw.get("dest") or kw["path"]})

    monkeypatch.setattr(rollback, "files", SimpleNamespace(directory=shipped, put=shipped))
    monkeypatch.setattr(rollback, "top_folders", lambda: planned.append({"shipped": "top"}))
    settings = SimpleNamespace(nodes=nodes, rollback=False, server_is_public=False)
    state = FakeState()
    with ctx_state.use(state), ctx_host.use(create_host(state, name="gpu2")):
        rollback.rollback._inner(settings, {"started_at": "2026-12-01T10:00:00Z",
                                            "why": "the health gate failed"})
    return said, planned


def test_an_unfinished_rollback_on_a_node_is_refused_naming_the_group(monkeypatch):
    said, planned = _plan(monkeypatch, ("gpu1", "gpu2"))
    assert planned == []
    assert said == [("Rollback", "a rollback began at 2026-12-01T10:00:00Z (the health gate "
                                 "failed) and did not finish, and gpu2 is now a node of gpu1, "
                                 "gpu2: a rank is never restarted alone; finish the rollback "
                                 "with gpu2 out of the group (leave it out of gpuhost_nodes and "
                                 "run with --limit gpu2), then put it back")]


def test_an_unfinished_rollback_on_a_host_of_its_own_is_finished(monkeypatch):
    said, planned = _plan(monkeypatch, ())
    assert said == [] and planned[-1]["interrupted"] is True
    assert {"shipped": "/opt/gpuhost/lib/last_known_good.py"} in planned
