"""Rolling restarts (operations/stages/roll.py): who restarts at which position, in what words; the
router's worker API as router_membership.py uses it, against a fake of smg 1.13.0's answers (as
the real router gave them: operations/files/router_membership.py's docstring)."""

from __future__ import annotations

import dataclasses
import json
import threading
from types import SimpleNamespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from operations.plans.settings import from_host_data
from operations.stages import fleet, roll
from operations.files import router_membership


def settings(name: str, **data):
    """A host's settings; every host holds the fleet key and a client key file unless told
    (a fleet needs both: operations/stages/fleet.py)."""
    data = {"fleet_key_file": "/root/fleet.key", "router_api_key_file": "/root/router.key",
            **data}
    return from_host_data(name, {f"gpuhost_{k}": v for k, v in data.items()})


def gated(address: str, **extra):
    return settings("h", server_host=address, fleet_address=address, api_key_file="/root/key",
                    **extra)


HOSTS = [("gpu1", ["gpuhost_router"]), ("gpu2", []), ("gpu3", []), ("gpu4", [])]


def configured(monkeypatch, restarting: set[str], **first):
    s = {"gpu1": gated("10.0.0.1", **first), "gpu2": gated("10.0.0.2"),
         "gpu3": gated("10.0.0.3"), "gpu4": gated("10.0.0.4")}
    planned = fleet.plan(HOSTS, s)
    roll.configure(fleet.Fleet((), {}), {}, s)  # a fresh roll
    roll.configure(planned, {"gpu1": "http://127.0.0.1:30100"}, s)
    monkeypatch.setattr(roll, "_active", lambda: {"gpu1", "gpu2", "gpu3", "gpu4"})
    for name in s:
        roll.ROLL.restarts[name] = lambda name=name: name in restarting
    return roll.ROLL


def test_hosts_with_nothing_to_restart_are_in_no_position(monkeypatch):
    r = configured(monkeypatch, {"gpu1", "gpu3", "gpu4"})
    assert r.hosts == ("gpu1", "gpu2", "gpu3", "gpu4")
    assert roll._positions() == [["gpu1"], ["gpu3"], ["gpu4"]]
    assert roll._at(1) == ["gpu3"] and roll._at(3) == []
    assert roll.describe(roll._positions()).endswith("1. gpu1; 2. gpu3; 3. gpu4")


def test_roll_size_puts_n_hosts_in_a_position(monkeypatch):
    configured(monkeypatch, {"gpu2", "gpu3", "gpu4"}, roll_size=2, roll_drain_timeout=30,
               roll_max_unavailable=2)
    assert roll._positions() == [["gpu2", "gpu3"], ["gpu4"]]
    assert roll.ROLL.drain_timeout == 30
    assert roll.describe(roll._positions()).startswith(
        "servers restart 2 at a time, each out of the router on gpu1")


def test_no_router_no_roll():
    s = {"gpu1": gated("10.0.0.1"), "gpu2": gated("10.0.0.2")}
    roll.configure(fleet.plan([("gpu1", []), ("gpu2", [])], s), {}, s)
    assert not roll.rolls("gpu1") and not roll.rolls("gpu2")


def cpu_only_router() -> None:
    """A fresh roll of gpu1 and gpu2 behind a router host that serves no model."""
    s = {"gpu1": gated("10.0.0.1"), "gpu2": gated("10.0.0.2"),
         "router": settings("router", serving=False, fleet_address="10.0.0.9")}
    planned = fleet.plan([("gpu1", []), ("gpu2", []), ("router", ["gpuhost_router"])], s)
    roll.configure(fleet.Fleet((), {}), {}, s)
    roll.configure(planned, {"router": "http://127.0.0.1:8100"}, s)


def test_a_cpu_only_router_host_is_in_no_position_and_its_workers_roll(monkeypatch):
    cpu_only_router()
    assert roll.ROLL.hosts == ("gpu1", "gpu2") and not roll.rolls("router")
    assert roll.ROLL.routers == {"router": "http://127.0.0.1:8100"}
    assert roll.ROLL.urls == {"router": {"gpu1": "http://10.0.0.1:8000",
                                         "gpu2": "http://10.0.0.2:8000"}}
    assert roll.ROLL.size == 1  # the router host's roll keys, as on a serving router


def test_a_router_host_out_of_the_run_stops_the_roll_when_it_serves_no_model(monkeypatch):
    cpu_only_router()
    monkeypatch.setattr(roll, "_active", lambda: {"gpu1", "gpu2"})  # --limit gpu1,gpu2
    roll.ROLL.restarts.update(gpu1=lambda: True, gpu2=lambda: True)
    errors = []
    monkeypatch.setattr(roll.logger, "error", errors.append)

    class Host:
        name, print_prefix = "gpu1", "[gpu1] "

    class State:
        failed_hosts: set = set()

    assert roll._turn(State(), Host(), 0) is False
    assert errors == ["[gpu1] Roll: stopped (the router host router is out of this run): gpu1 "
                      "not restarted, its server left as it is, serving"]


def test_a_serving_router_host_in_a_node_group_still_means_no_roll():
    group = ("gpu1", "gpu2")
    s = {n: dataclasses.replace(gated(f"10.0.0.{i}"), nodes=group)
         for i, n in enumerate(group, 1)}
    s["gpu3"] = gated("10.0.0.3")
    planned = fleet.plan([("gpu1", ["gpuhost_router"]), ("gpu2", []), ("gpu3", [])], s)
    roll.configure(planned, {"gpu1": "http://127.0.0.1:8100"}, s)
    assert roll.ROLL.hosts == () and not roll.rolls("gpu3")


def test_roll_keys_are_checked():
    with pytest.raises(Exception, match="roll_size"):
        settings("h", roll_size=0)
    with pytest.raises(Exception, match="roll_max_unavailable"):
        settings("h", roll_max_unavailable=0)
    with pytest.raises(Exception, match="roll_max_unavailable"):
        settings("h", roll_max_unavailable="one")
    assert settings("h").roll_max_unavailable == 1


def test_a_roll_size_over_the_unavailable_budget_is_refused_naming_both_keys():
    s = {"gpu1": gated("10.0.0.1", roll_size=2), "gpu2": gated("10.0.0.2")}
    with pytest.raises(fleet.FleetError) as caught:
        fleet.plan([("gpu1", ["gpuhost_router"]), ("gpu2", [])], s)
    assert caught.value.problems == [
        "host gpu1: gpuhost_roll_size = 2 is not allowed: at most gpuhost_roll_max_unavailable "
        "(1), the workers a roll may have out of the router at once"]


class FakeRouter(BaseHTTPRequestHandler):
    """smg 1.13.0's worker API as seen: DELETE leaves the worker listed as draining for a
    while, POST adds it (409 when listed)."""

    workers: dict[str, dict] = {}
    drain_polls = 2
    #: Authorization headers seen, and the bodies of the workers added
    auth: set = set()
    added: list = []
    #: URLs whose server does not answer: a POST is accepted (202) and the worker never listed
    #: (smg registers a worker once its own health checks pass)
    down: set = set()
    #: every call, in order: (method, path or URL)
    calls: list = []

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        FakeRouter.auth.add(self.headers.get("Authorization"))
        for url, w in list(self.workers.items()):
            if w["status"] == "draining":
                w["polls"] -= 1
                if w["polls"] < 0:
                    del self.workers[url]
        self._send(200, {"workers": [{k: v for k, v in w.items() if k != "polls"}
                                     for w in self.workers.values()]})

    def do_DELETE(self):  # noqa: N802
        FakeRouter.auth.add(self.headers.get("Authorization"))
        wid = self.path.rsplit("/", 1)[-1]
        FakeRouter.calls.append(("DELETE", wid))
        for w in self.workers.values():
            if w["id"] == wid:
                w.update(status="draining", is_healthy=False, polls=self.drain_polls)
                return self._send(202, {"status": "accepted", "worker_id": wid})
        self._send(400, {"error": f"Invalid worker_id '{wid}'"})

    def do_POST(self):  # noqa: N802
        FakeRouter.auth.add(self.headers.get("Authorization"))
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        FakeRouter.added.append(body)
        url = body["url"]
        FakeRouter.calls.append(("POST", url))
        if url in self.down:
            return self._send(202, {"status": "accepted"})
        if url in self.workers:
            return self._send(409, {"code": "WORKER_ALREADY_EXISTS"})
        self.workers[url] = {"id": f"id-{len(FakeRouter.added)}", "url": url, "is_healthy": True,
                             "status": "ready"}
        self._send(202, {"status": "accepted"})

    def log_message(self, *args):
        pass


@pytest.fixture(autouse=True)
def roll_state_file(tmp_path, monkeypatch):
    """router_membership's roll state in a file of the test's own (not /etc/gpuhost)."""
    path = tmp_path / "roll-state.json"
    monkeypatch.setattr(router_membership.Roll, "state", str(path))
    monkeypatch.setattr(router_membership.Roll, "fleet", {})
    monkeypatch.setattr(router_membership.Roll, "host", "")
    monkeypatch.setattr(router_membership.Roll, "max_unavailable", 1)
    return path


@pytest.fixture
def router_url():
    FakeRouter.workers = {"http://10.0.0.2:8000": {"id": "w2", "url": "http://10.0.0.2:8000",
                                                   "is_healthy": True, "status": "ready"}}
    FakeRouter.down, FakeRouter.calls = set(), []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeRouter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_leave_waits_until_drained_then_join_waits_until_healthy(router_url, capsys):
    url = "http://10.0.0.2:8000"
    assert router_membership.leave(router_url, url, timeout=10, interval=0.01) == 0
    assert url not in FakeRouter.workers
    assert "drained and out" in capsys.readouterr().out
    assert router_membership.join(router_url, url, timeout=10, interval=0.01) == 0
    assert FakeRouter.workers[url]["is_healthy"]
    # again: listed already (409), kept
    assert router_membership.join(router_url, url, timeout=10, interval=0.01) == 0


def test_a_drain_past_its_timeout_goes_on(router_url, capsys, monkeypatch):
    monkeypatch.setattr(FakeRouter, "drain_polls", 10 ** 6)
    assert router_membership.leave(router_url, "http://10.0.0.2:8000", timeout=0.2,
                                   interval=0.05) == 0
    assert "still draining after 0 s: going on" in capsys.readouterr().err


def test_a_router_not_running_routes_nothing(capsys, monkeypatch, tmp_path):
    control = tmp_path / "control.key"
    control.write_text("control-key-0123456789\n")
    control.chmod(0o600)
    monkeypatch.setattr("sys.argv", ["x", "leave", "--router", "http://127.0.0.1:9",
                                     "--url", "http://10.0.0.2:8000", "--timeout", "1",
                                     "--control-key-file", str(control)])
    assert router_membership.main() == 0
    assert "not running" in capsys.readouterr().out


def test_a_router_not_set_up_yet_routes_nothing(capsys, monkeypatch, tmp_path):
    """A fleet's first run on a router host that serves too: its server rolls before the
    router stage makes the control-plane key and starts the router."""
    argv = ["x", "leave", "--router", "http://127.0.0.1:9", "--url", "http://10.0.0.2:8000",
            "--timeout", "1", "--control-key-file", str(tmp_path / "none.key")]
    monkeypatch.setattr("sys.argv", argv)
    assert router_membership.main() == 0
    assert "not set up on this host yet" in capsys.readouterr().out


def test_a_missing_control_key_where_a_router_answers_fails(capsys, monkeypatch, tmp_path,
                                                             router_url):
    monkeypatch.setattr("sys.argv", ["x", "leave", "--router", router_url, "--url",
                                     "http://10.0.0.2:8000", "--timeout", "1",
                                     "--control-key-file", str(tmp_path / "none.key")])
    assert router_membership.main() == 1
    assert "control-plane key file" in capsys.readouterr().err


# --- what earlier stages leave to a host's turn (roll.in_turn) -------------------------------

def _on(name: str):
    from pyinfra.context import ctx_host, ctx_state
    from pyinfra_testing.util import FakeState, create_host
    state = FakeState()
    return ctx_state.use(state), ctx_host.use(create_host(state, name=name))


def test_a_change_waits_for_the_turn_only_on_a_rolling_host_whose_server_runs(monkeypatch):
    configured(monkeypatch, set())
    state_ctx, host_ctx = _on("gpu2")
    with state_ctx, host_ctx:
        assert not roll.in_turn("the driver change", lambda when: None, running=False)
        assert not roll.has_turn()
        assert roll.in_turn("the driver change", lambda when: None, running=True)
        assert roll.has_turn()
    s = {"gpu1": gated("10.0.0.1"), "gpu2": gated("10.0.0.2")}
    roll.configure(fleet.plan([("gpu1", []), ("gpu2", [])], s), {}, s)  # no router
    state_ctx, host_ctx = _on("gpu2")
    with state_ctx, host_ctx:
        assert not roll.in_turn("the driver change", lambda when: None, running=True)


def test_a_reboot_in_the_router_hosts_turn_is_warned_of(monkeypatch, caplog):
    configured(monkeypatch, set())
    state_ctx, host_ctx = _on("gpu1")
    with state_ctx, host_ctx:
        assert roll.in_turn("the driver change", lambda when: None, running=True, reboots=True)
    assert "the router runs here: requests through it fail until it is back" in caplog.text


def _planned_roll(monkeypatch, name: str, must_restart: bool, turns: list):
    """rolled_restart on host ``name`` with the operations recorded, not planned: returns the
    names planned, in order, and the ``_if`` each turn's plan got."""
    planned, whens = [], []

    def record(**kw):
        planned.append(kw["name"])
        return SimpleOp()

    monkeypatch.setattr(roll, "turn", record)
    monkeypatch.setattr(roll, "membership", record)
    state_ctx, host_ctx = _on(name)
    with state_ctx, host_ctx:
        for label in turns:
            roll.in_turn(label, lambda when, label=label: (whens.append(when),
                                                           planned.append(label)),
                         running=True)
        roll.rolled_restart("sglang.service", lambda: must_restart, must_restart,
                            gate=lambda **kw: record(name="gate", **kw), restart=record)
    return planned, whens


class SimpleOp:
    def did_change(self):
        return False


def test_a_host_with_a_change_in_its_turn_restarts_in_the_roll_and_plans_it_each_position(
        monkeypatch):
    configured(monkeypatch, set())
    planned, whens = _planned_roll(monkeypatch, "gpu2", False, ["the driver change"])
    assert roll.ROLL.restarts["gpu2"]() is True and roll.ROLL.expected["gpu2"] is True
    # one position per rolling host; the change after leaving the router, before the restart
    assert planned.count("the driver change") == 4 and len(whens) == 4
    first = planned.index("the driver change")
    assert planned[first - 2:first] == ["Roll position 1: out of the router, drained",
                                        "Roll position 1: restarting (the roll state)"]
    assert planned[first + 1] == "Roll position 1: restart sglang.service"
    # each position's _if: only the position gpu2 is in
    monkeypatch.setattr(roll, "_positions", lambda: [["gpu2"]])
    assert [w() for w in whens] == [True, False, False, False]


def test_without_a_change_in_its_turn_the_restart_decides(monkeypatch):
    configured(monkeypatch, set())
    _planned_roll(monkeypatch, "gpu3", False, [])
    assert roll.ROLL.restarts["gpu3"]() is False and roll.ROLL.expected["gpu3"] is False


def test_a_rolled_back_driver_stops_the_roll_after_its_host(monkeypatch, caplog):
    configured(monkeypatch, {"gpu2", "gpu3"})
    said = {}
    state_ctx, host_ctx = _on("gpu2")
    with state_ctx, host_ctx:
        roll.in_turn("the driver change", lambda when: None, running=True,
                     stops=lambda: said.get("gpu2"))
    fake_state = SimpleNamespace(failed_hosts=set())
    assert roll._turn.__wrapped__(fake_state, SimpleNamespace(name="gpu2", print_prefix=""),
                                  0) is True
    said["gpu2"] = "driver 580.105.08 failed its checks after the reboot; rolled back"
    assert roll._turn.__wrapped__(fake_state, SimpleNamespace(name="gpu3", print_prefix=""),
                                  1) is False
    assert ("Roll: stopped (gpu2: driver 580.105.08 failed its checks after the reboot; "
            "rolled back): gpu3 not restarted") in caplog.text


class Out:
    def __init__(self, stdout=(), stderr=()):
        self.stdout_lines, self.stderr_lines = list(stdout), list(stderr)


def _membership_on(monkeypatch, answer):
    """_membership for gpu3 with the router host's connection faked: what was sent there."""
    configured(monkeypatch, set())
    sent = []
    router_host = SimpleNamespace(name="gpu1")
    monkeypatch.setattr(roll.remote, "put", lambda h, src, dest: sent.append(("put", h, dest)))

    def shell(h, command, timeout):
        sent.append(("shell", h, str(command)))
        sent.append(("timeout", timeout))
        return answer()

    monkeypatch.setattr(roll.remote, "shell", shell)
    state = SimpleNamespace(inventory=SimpleNamespace(get_host=lambda n: router_host),
                            failed_hosts=[SimpleNamespace(name="gpu4")])
    me = SimpleNamespace(name="gpu3", print_prefix="[gpu3] ")
    return roll._membership.__wrapped__, state, me, sent, router_host


def test_leave_runs_on_the_router_host_over_its_own_connection(monkeypatch, caplog):
    caplog.set_level("INFO")
    run, state, me, sent, router_host = _membership_on(
        monkeypatch, lambda: (True, Out(["router: http://10.0.0.3:8000 drained and out"])))
    assert run(state, me, "leave", 30) is True
    assert sent[:2] == [("put", router_host, roll.SCRIPT),
                        ("put", router_host, roll.STATE_SCRIPT)]
    # the fleet as this run knows it: gpu4 failed in this run, so it is not counted on
    assert sent[2] == ("shell", router_host, "python3 /opt/gpuhost/lib/router_membership.py "
                       "leave --router http://127.0.0.1:30100 --url http://10.0.0.3:8000 "
                       "--timeout 30 --control-key-file /etc/gpuhost/router-control.key "
                       "--worker-key-file /root/fleet.key --host gpu3 "
                       "--fleet gpu1=http://127.0.0.1:30000 --fleet gpu2=http://10.0.0.2:8000 "
                       "--fleet gpu3=http://10.0.0.3:8000 --max-unavailable 1 "
                       "--resume-timeout 300")
    # the resume's wait, the drain's and the last poll: a leave that waits on an earlier
    # roll's worker is not cut short by the command's own limit
    assert sent[3] == ("timeout", 300 + 30 + roll.remote.POLL_TIMEOUT_S)
    assert "[gpu3] Roll: on gpu1: router: http://10.0.0.3:8000 drained and out" in caplog.text
    sent.clear()
    assert run(state, me, "join", 30) is True
    assert sent[3] == ("timeout", 30 + roll.remote.POLL_TIMEOUT_S)


def test_a_failed_leave_fails_this_host_saying_the_routers_words(monkeypatch):
    run, state, me, _, _ = _membership_on(
        monkeypatch, lambda: (False, Out([], ["router answered 503"])))
    with pytest.raises(roll.OperationError, match="the router on gpu1: join of "
                       "http://10.0.0.3:8000 failed: router answered 503"):
        run(state, me, "join", 30)


def test_the_router_hosts_lost_link_fails_this_host_not_its_connection(monkeypatch):
    def lost():
        raise roll.remote.ConnectionLost("no answer for 90 s")

    run, state, me, _, _ = _membership_on(monkeypatch, lost)
    with pytest.raises(roll.OperationError, match="connection to the router host gpu1 lost") \
            as caught:
        run(state, me, "leave", 30)
    assert not isinstance(caught.value, roll.remote.ConnectionLost)
