"""Bench the fleet: sglang's bench_serving through the router's endpoint, for the fleet's
throughput (``gpuhost_bench_target = "router"``).

The load comes from a router host (its ML venv's bench_serving, its model folder as the
tokenizer), the router refusing before any load unless it lists every worker of the fleet
healthy (its own ``GET /workers``, operations/files/router_workers.py). Where a router host of
the run benches the fleet (its own ``gpuhost_bench_target``, from its host data, a group's or
``--data``), its workers in the run send no load of their own.

Which bench_serving backend: ``sglang`` (its native one: POST /generate, ``{"text": ...,
"sampling_params": {"max_new_tokens", "ignore_eos", "temperature": 0.0}, "stream": true, ...}``,
as sglang 0.5.9's bench_serving.py async_request_sglang_generate sends it), not ``sglang-oai``.
Seen with the locked router, smg 1.13.0, in front of a worker that logs what it gets: the
``sglang-oai`` payload on /v1/completions is answered 400 before any worker sees it, a text
prompt with "best_of is not supported when stream is enabled" (the tool always sends
``"best_of": 1`` with ``"stream": true``), a token-ID prompt (``--tokenize-prompt``) with
"data did not match any variant of untagged enum StringOrArray"; the ``sglang`` payload on
/generate, with text or ``input_ids``, is forwarded (re-serialised by the router) and its stream
comes back as the worker sent it. smg's source says the same (smg-project/smg:
model_gateway/src/server.rs routes ``/generate``; crates/protocols/src/generate.rs
GenerateRequest takes ``text`` or ``input_ids``; completion.rs's prompt is a StringOrArray).
``random-ids`` without ``--tokenize-prompt`` sends each prompt as text (sample_random_requests'
``return_text``), so the lengths are the tool's as for a host's own bench.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Final

from pyinfra import host, state
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.files import File

from operations.runtime import remote
from operations.runtime.run_exit import end_run
from operations.plans.plan import fact, refuse
from operations.plans.settings import PREFIX, Settings
from operations.stages import fleet
from operations.stages.bench import _run_argv, report, run_levels, say
from operations.stages.fleet import ROUTER_GROUP, Fleet
from operations.stages.router import CHECK_SCRIPT, CONTROL_KEY_FILE, UNIT_PATH, own_url
from operations.stages.server_unit import _url
from operations.stages.tls import needs_tls

#: bench_serving's backend through the router (module docstring).
BACKEND: Final = "sglang"


def plan(inventory, settings: Mapping[str, Settings]) -> Fleet | None:
    """The fleet where a host asks for the router's endpoint (``gpuhost_bench_target =
    "router"``), else None; the run ends, before any host is touched, where the inventory
    has no router host or no working fleet (operations/stages/fleet.py)."""
    asking = [name for name, s in settings.items() if s.bench_target == "router"]
    if not asking:
        return None
    the_fleet, _ = fleet.for_run(inventory, settings)
    if not the_fleet.routers:
        end_run("gpuhost: host data refused, no host was touched:\n  - " + "\n  - ".join(
            f"host {name}: {PREFIX}bench_target = 'router' is not allowed: 'host', or "
            f"'router' with a router in the inventory (the {ROUTER_GROUP} group is empty)"
            for name in asking))
    return the_fleet


def benching_routers(the_fleet: Fleet, settings: Mapping[str, Settings],
                     active: set[str]) -> list[str]:
    """The router hosts of this run that bench the fleet (their own bench_target "router")."""
    return [r for r in the_fleet.routers if r in active and settings[r].bench_target == "router"]


def endpoint(settings: Settings) -> tuple[str, str | None]:
    """(URL, API key file or None) of the router's endpoint as its clients reach it: through its
    API key gate where it binds wider than the loopback."""
    scheme = "https" if needs_tls(settings) else "http"
    return (_url(settings.router_host, settings.router_port, scheme),
            settings.router_api_key_file)


def part(the_fleet: Fleet, settings: Mapping[str, Settings], name: str,
         active: set[str]) -> tuple[str, str] | None:
    """Host ``name``'s part in a fleet bench of the hosts ``active`` in this run: ("router",
    "") on a router host that benches the fleet; ("worker", its router) on a worker of such a
    router (it sends no load of its own); ("refused", why) on a host asking for the router's
    endpoint where no router host of the run benches the fleet (``--limit``, or
    ``gpuhost_bench_target = "host"`` on the router host); None where the host benches its own
    server as usual. A router host that serves no model (``gpuhost_serving = False``) is
    refused: the load comes from the router host's ML venv and model folder, which it has
    not."""
    routers = [r for r in benching_routers(the_fleet, settings, active) if settings[r].serving]
    if name in routers:
        return "router", ""
    through = [r for r in routers if name in (w.name for w in the_fleet.workers_of(r))]
    if through:
        return "worker", through[0]
    if settings[name].bench_target == "router" and not settings[name].serving:
        return "refused", (
            f"{PREFIX}bench_target = 'router' on {name}, which serves no model "
            f"({PREFIX}serving = False): the fleet's load comes from a router host's ML venv "
            "(bench_serving) and model folder (the tokenizer); bench the fleet from a router "
            "host that serves, or each worker with 'host'")
    if settings[name].bench_target == "router":
        return "refused", (
            f"{PREFIX}bench_target = 'router': no router host of this run benches the fleet "
            f"(router hosts: {', '.join(the_fleet.routers)}; not in this run (--limit), "
            f"{PREFIX}bench_target = 'host' there, or serving no model): bench with a router "
            f"host that serves in the run and {PREFIX}bench_target = 'router' on it")
    return None


def prepare(the_fleet: Fleet, settings: Mapping[str, Settings]) -> bool | None:
    """Plan this host's :func:`part`: True on the router host that benches the fleet, its
    router deployed (then :func:`fleet_bench_run`); False on a worker (the run says which
    router host loads it) and where refused; None where it benches its own server."""
    role = part(the_fleet, settings, host.name, {h.name for h in state.active_hosts})
    if role is None:
        return None
    what, detail = role
    if what == "worker":
        say(f"Bench: a worker of the fleet, loaded through the router on {detail}")
        return False
    if what == "refused":
        refuse("Bench", detail)
        return False
    if not fact(File, path=UNIT_PATH):
        refuse("Bench", f"no router is deployed ({UNIT_PATH} is missing): run deploy.py first")
        return False
    return True


def _look(host, router: str, urls: list[str]) -> dict:
    ok, out = remote.shell(host, StringCommand("python3", CHECK_SCRIPT, "--timeout", "0",
                                               "--control-key-file", CONTROL_KEY_FILE,
                                               "--router", router, *urls),
                           timeout=remote.POLL_TIMEOUT_S)
    try:
        return json.loads("\n".join(out.stdout_lines)) if ok else {"error": "no answer"}
    except ValueError:
        return {"error": f"cannot read {out.stdout_lines[:2]!r}"}


@remote.callback("the fleet bench", "the bench goes on on the host")
def _fleet_bench(state, host, settings: Settings, workers: tuple[tuple[str, str], ...],
                 dest_root: str) -> bool:
    urls = [url for _, url in workers]
    seen = _look(host, own_url(settings), urls)
    problem = seen.get("error") or "; ".join(
        f"{what}: {', '.join(seen[what])}" for what in ("missing", "unhealthy") if seen.get(what))
    if problem:
        raise OperationError(f"refused: the router does not list every worker healthy "
                             f"({problem}): no load was sent; run deploy.py to put it right")
    url, key_file = endpoint(settings)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ")
    dest = Path(dest_root) / f"fleet-{host.name}" / started
    about = {"kind": "router", "url": url, "router": host.name,
             "policy": settings.router_policy, "backend": BACKEND,
             "workers": [name for name, _ in workers], "worker_urls": urls}
    say(f"bench: the fleet endpoint {url}, {len(urls)} workers listed healthy")
    results, text, complete = run_levels(host, settings, dest,
                                         argv=_run_argv(settings, (url, key_file, BACKEND)),
                                         endpoint=about)
    report(text, complete, dest, results)
    return True


@operation(is_idempotent=False)
def fleet_bench_run(settings: Settings, workers: tuple[tuple[str, str], ...], dest_root: str):
    """Bench the fleet through the router on this host: refused before any load unless the
    router lists every worker healthy; then bench_serving (``--backend sglang``) against the
    router's endpoint at each of gpuhost_bench_levels, results under
    ``<dest_root>/fleet-<router host>/<UTC time>/`` (results.json's ``endpoint``: the URL, the
    router, its policy and workers; summary.md says so).

    + settings: the router host's validated settings
    + workers: (host name, URL as the router lists it) of each worker
    + dest_root: the controller's folder for results (bench-results/)
    """
    yield FunctionCommand(_fleet_bench, (settings, workers, dest_root), {})
