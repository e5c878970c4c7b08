"""A fleet grows and shrinks under client traffic (issue 30, "Done when"): three hosts from the
suite run's image of a converged host (lab.up_from_image), the router on gpu1 (which
serves too) in front of gpu1 and gpu2; gpu3 joins the fleet and leaves it again while a client
on gpu2 sends at least 1000 requests through the router, over the lab switch: none fails, and
the router's process is the same throughout (workers join and leave through its control plane,
operations/files/router_membership.py). In the same window, two rolls are killed (SIGKILL, the
deploy's whole process group) and run again (issue 40 finding 1): one right after gpu1 was
drained, one after gpu1's server restarted, before its health gate passed (its next run has
nothing to restart there: only the roll state brings gpu1 back before gpu2 is drained); none
fails either, and each ends converged. Checked through ssh (the router's own /workers with
the control key on gpu1, the roll state there, the client's counts), not through pyinfra.
Then (issue 40 finding 6) the Hub stand-in's main moves and gpu3, its copy removed, joins
again: --dry says the move, and gpu3 serves the commit gpu1 and gpu2 hold (their stamps)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e import lab
from tests.e2e.test_interrupted import Deploy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROUTER_HOST = "gpu1"
ROUTER = "sglang-router.service"
REQUESTS = 1000
CLIENT_KEY = "/root/client.key"

#: Sends chat completions through the router until it has sent at least ``minimum`` and the
#: stop file is there (or ``limit`` seconds passed); prints its counts and seconds.
CLIENT = r"""
import json, os, sys, time, urllib.request
url, key_file, minimum, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
key = open(key_file).read().strip()
ok = failed = 0; errors = []; start = time.monotonic()
while time.monotonic() - start < limit:
    if ok + failed >= minimum and os.path.exists("/tmp/client.stop"):
        break
    body = json.dumps({"model": "glm-5", "messages": [{"role": "user", "content":
                       f"q{ok + failed} {time.time()}"}], "max_tokens": 4}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body,
                                 {"content-type": "application/json",
                                  "Authorization": "Bearer " + key})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            json.loads(r.read())["choices"][0]; ok += 1
    except Exception as exc:
        failed += 1; errors.append(type(exc).__name__ + ": " + str(getattr(exc, "code", exc)))
    time.sleep(0.05)
print(json.dumps({"requests": ok + failed, "ok": ok, "failed": failed, "errors": errors[:5],
                  "seconds": round(time.monotonic() - start, 1)}))
"""

#: The router's worker URLs, read on its loopback with the control key (root only).
WORKERS = r"""
import json, urllib.request as u
key = open("/etc/gpuhost/router-control.key").read().strip()
r = u.Request("http://127.0.0.1:30100/workers", headers={"Authorization": "Bearer " + key})
print(json.dumps(sorted(w["url"] for w in json.load(u.urlopen(r, timeout=10))["workers"])))
"""


ROLL_STATE = "/etc/gpuhost/roll-state.json"


def write_inventory(path: Path, members: tuple[str, ...], **extra) -> str:
    """The fleet of ``members`` (host names), the router on :data:`ROUTER_HOST`."""
    entries = [(h["name"], lab.fleet_data(h, router=h["name"] == ROUTER_HOST))
               for h in json.loads(lab.sandbox("status", "--json").stdout)
               if h["name"] in members]
    for _, data in entries:
        data["gpuhost_router_health_check_interval_secs"] = 2
        data.update(extra)
    path.write_text("import json\nsandbox = [tuple(e) for e in json.loads("
                    f"{json.dumps(json.dumps(entries))})]\ngpuhost_router = [{ROUTER_HOST!r}]\n")
    return str(path)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    hosts = {h.name: h for h in lab.up_from_image(hosts=3)}
    keys = lab.fleet_keys(hosts.values(), routers=[ROUTER_HOST], serving=hosts)
    # the client's copy of the router's client key, on the host it sends from
    hosts["gpu2"].ssh(f"umask 077; printf '%s\\n' {keys['router API key']} > {CLIENT_KEY}")
    for h in hosts.values():
        h.ssh(f"cat > /root/workers.py <<'EOF'\n{WORKERS}\nEOF\n"
              f"cat > /root/client.py <<'EOF'\n{CLIENT}\nEOF")
    work = tmp_path_factory.mktemp("membership")
    two = write_inventory(work / "two.py", ("gpu1", "gpu2"))
    first = lab.deploy(inventory=two)
    assert first.returncode == 0, first.output[-8000:]
    # gpu3: converged on its own (the image's), serving, not yet in the fleet
    yield hosts, work
    lab.sandbox("down", check=False)


def switch() -> dict[str, str]:
    return {h["name"]: h["switch_address"]
            for h in json.loads(lab.sandbox("status", "--json").stdout)}


def router_workers(router: lab.Host) -> list[str]:
    return json.loads(router.ssh("python3 /root/workers.py"))


def expected(names: tuple[str, ...]) -> list[str]:
    """The router's worker URLs for ``names``: its own host's server on the loopback, behind
    the gate (operations/stages/fleet.py worker_url), the others at their switch address."""
    addresses = switch()
    return sorted("http://127.0.0.1:30000" if n == ROUTER_HOST
                  else f"http://{addresses[n]}:8000" for n in names)


def test_the_fleet_grows_to_three_and_shrinks_back_without_a_failed_request(fleet):
    hosts, work = fleet
    router, client = hosts[ROUTER_HOST], hosts["gpu2"]
    assert router_workers(router) == expected(("gpu1", "gpu2"))
    pid = router.main_pid(ROUTER)
    url = f"http://{switch()[ROUTER_HOST]}:8100"
    client.ssh(f"rm -f /tmp/client.stop /tmp/client.out; nohup python3 /root/client.py {url} "
               f"{CLIENT_KEY} {REQUESTS} 1500 > /tmp/client.out 2>&1 < /dev/null &")
    try:
        time.sleep(3)
        grown = lab.deploy(inventory=write_inventory(work / "three.py", ("gpu1", "gpu2", "gpu3")))
        assert grown.returncode == 0, grown.output[-6000:]
        assert router_workers(router) == expected(("gpu1", "gpu2", "gpu3"))
        shrunk = lab.deploy(inventory=write_inventory(work / "two-again.py", ("gpu1", "gpu2")))
        assert shrunk.returncode == 0, shrunk.output[-6000:]
        gpu3 = f"http://{switch()['gpu3']}:8000"
        assert f"removed {gpu3}, which gpuhost did not configure" in shrunk.output, \
            shrunk.output[-6000:]
        deadline = time.monotonic() + 60  # drained, then gone
        while gpu3 in router_workers(router):
            assert time.monotonic() < deadline, router_workers(router)
            time.sleep(1)
        assert router_workers(router) == expected(("gpu1", "gpu2"))
        # the words counted from the router's list: one worker gone, two configured
        assert "2 of 2 configured worker(s) listed and healthy" in shrunk.output, \
            shrunk.output[-6000:]
        assert "all 3 worker(s)" not in shrunk.output
        killed_rolls(hosts, work)
    finally:
        client.ssh("touch /tmp/client.stop")
        deadline = time.monotonic() + 900  # the client sends its 1000 before it stops
        while not client.ssh("cat /tmp/client.out", check=False).strip():
            assert time.monotonic() < deadline
            time.sleep(2)
    result = json.loads(client.ssh("cat /tmp/client.out").strip().splitlines()[-1])
    print(f"\nthrough the router while the fleet grew to 3 and shrank to 2: "
          f"{result['requests']} requests, {result['failed']} failed, {result['seconds']} s")
    assert result["failed"] == 0 and result["requests"] >= REQUESTS, result
    assert router.main_pid(ROUTER) == pid


def killed_roll(hosts: dict, work: Path, requests: int, name: str, killed_when) -> lab.Run:
    """A roll of gpu1 and gpu2 (a new ``gpuhost_max_running_requests``) killed (SIGKILL) once
    ``killed_when(output)`` holds, then run again: gpu1 was out of the router when it died,
    and the roll state on the router host says so; the run again converges, the roll state
    empty, both servers on the new flag."""
    router = hosts[ROUTER_HOST]
    inventory = write_inventory(work / f"roll-{requests}.py", ("gpu1", "gpu2"),
                                gpuhost_max_running_requests=requests)
    run = Deploy(Path(inventory), work / f"{name}.log")
    deadline = time.monotonic() + 900
    while not killed_when(run.output()):
        assert run.proc.poll() is None and time.monotonic() < deadline, run.output()[-6000:]
        time.sleep(0.1)
    run.kill()
    gpu1 = expected(("gpu1",))[0]
    assert gpu1 not in router_workers(router), run.output()[-4000:]
    state = json.loads(router.ssh(f"cat {ROLL_STATE}"))
    assert state[gpu1]["host"] == "gpu1", state
    print(f"\n{name}: the roll state after the kill: {state}")
    again = lab.deploy(inventory=inventory)
    assert again.returncode == 0, again.output[-8000:]
    assert router_workers(router) == expected(("gpu1", "gpu2"))
    assert json.loads(router.ssh(f"cat {ROLL_STATE}")) == {}
    for h in (hosts["gpu1"], hosts["gpu2"]):
        args = h.process_args(h.main_pid())
        assert args[args.index("--max-running-requests") + 1] == str(requests)
    return again


def killed_rolls(hosts: dict, work: Path) -> None:
    """Issue 40 finding 1's kills (module docstring), while the client sends."""
    drained = f"[gpu1] Roll: on {ROUTER_HOST}: router: http://127.0.0.1:30000 drained and out"
    killed_roll(hosts, work, 48, "killed-after-the-drain", lambda out: drained in out)
    pid = hosts["gpu1"].main_pid()
    again = killed_roll(hosts, work, 40, "killed-after-the-restart",
                        lambda out: drained in out and hosts["gpu1"].main_pid() not in (pid, 0))
    # gpu1 had nothing left to restart: the roll state brought it back before gpu2 left
    back = re.search(r"http://127\.0\.0\.1:30000\)? back in, healthy", again.output)
    gpu2_out = again.output.find(f"http://{switch()['gpu2']}:8000 taken out")
    assert back and -1 < back.start() < gpu2_out, again.output[-8000:]


#: The stamp model_fetch.py writes in the model folder (operations/facts/model_facts.py STAMP).
STAMP = "/opt/gpuhost/models/gpuhost-sandbox/tiny-glm-5/.gpuhost-model.json"


def move_main() -> dict:
    """A new commit on the hub stand-in's main (sandbox/hub.py, POST /_sandbox/move-main):
    {"from": the old sha, "to": the new}."""
    gateway = json.loads(lab.sandbox("status", "--json").stdout)[0]["gateway"]
    request = urllib.request.Request(
        f"http://{gateway}:8090/_sandbox/move-main?repo=gpuhost-sandbox/tiny-glm-5",
        data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def test_a_host_added_after_main_moved_serves_the_fleets_commit(fleet):
    """Issue 40 finding 6: main moves on the Hub after gpu1 and gpu2 fetched it; gpu3 (its
    copy removed, as a fresh host) joins: --dry says the move, and gpu3 serves the fleet's
    commit, not main's new one (each stamp's sha, read over ssh)."""
    hosts, work = fleet
    held = json.loads(hosts["gpu1"].ssh(f"cat {STAMP}"))["sha"]
    moved = move_main()
    assert moved["from"] == held, moved
    hosts["gpu3"].ssh(f"rm -rf {STAMP.rsplit('/', 1)[0]}")
    # gpuhost_max_running_requests as gpu1 serves now (the killed rolls above change it): no roll
    args = hosts["gpu1"].process_args(hosts["gpu1"].main_pid())
    same = ({"gpuhost_max_running_requests": int(args[args.index("--max-running-requests") + 1])}
            if "--max-running-requests" in args else {})
    three = write_inventory(work / "three-moved.py", ("gpu1", "gpu2", "gpu3"), **same)
    dry = lab.deploy("--dry", inventory=three)
    said = f"main of gpuhost-sandbox/tiny-glm-5 moved on the Hub from {held[:12]} to " \
           f"{moved['to'][:12]}"
    assert said in dry.output, dry.output[-6000:]
    print("\n--dry said: " + next(line.strip() for line in dry.output.splitlines() if said in line))
    grown = lab.deploy(inventory=three)
    assert grown.returncode == 0, grown.output[-8000:]
    assert said in grown.output, grown.output[-6000:]
    for name in ("gpu1", "gpu2", "gpu3"):
        stamp = json.loads(hosts[name].ssh(f"cat {STAMP}"))
        assert (name, stamp["sha"], stamp["revision"]) == (name, held, "main"), stamp
    assert router_workers(hosts[ROUTER_HOST]) == expected(("gpu1", "gpu2", "gpu3"))
