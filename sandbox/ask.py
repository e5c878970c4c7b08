"""Ask each sandbox host's SGLang server what it serves, and one chat question, from inside the
host (the server binds the host's 127.0.0.1), and print the answers. In a fleet lab
(sandbox/fleet_keys.py) each serving host's server is asked through its gate on the switch with
its client key, and the router host's router through its gate with the router's."""

from __future__ import annotations

import json
import subprocess

from sandbox.lab import LabError, ssh_command, status
from sandbox.layout import host_from_name

#: Where a node of a group keeps its rank (operations/plans/node_group.py env_file: its first line,
#: "# Written by gpuhost: node rank 1 of 2 (gpu1, gpu2), rendezvous ...").
NODES_ENV = "/etc/gpuhost/nodes.env"

_CLIENT = r"""
import json, re, sys, urllib.request
base, key_file = %r, %r
headers = {"Content-Type": "application/json"}
if key_file:
    headers["Authorization"] = "Bearer " + open(key_file).read().strip()
try:
    first = open(%r).readline()
except OSError:
    first = ""
node = re.search(r"node rank (\d+) of \d+ \(([^)]*)\)", first)
if node and int(node.group(1)) > 0:
    # a rank >= 1 serves no model of its own (sglang answers 404 to /v1/models there): the
    # group answers through its rank 0
    print(json.dumps({"node_rank": int(node.group(1)), "nodes": node.group(2).split(", ")}))
    sys.exit(0)
models = json.load(urllib.request.urlopen(urllib.request.Request(base + "/v1/models",
                                                                 headers=headers), timeout=10))
name = models["data"][0]["id"]
request = urllib.request.Request(
    base + "/v1/chat/completions",
    data=json.dumps({"model": name, "temperature": 0, "max_tokens": 32,
                     "messages": [{"role": "user", "content": "Say hello in five words."}]}).encode(),
    headers=headers,
)
answer = json.load(urllib.request.urlopen(request, timeout=60))
print(json.dumps({"models": models, "answer": answer["choices"][0]["message"]["content"]}))
"""


def ask(port: int = 8000) -> list[dict]:
    """For each running host: its /v1/models and the answer to one chat question (for a rank
    >= 1 of a node group: its rank and group, the group being asked through its rank 0).
    Raises LabError when no lab is up or a host's server does not answer."""
    hosts = status()
    if not hosts:
        raise LabError("no sandbox lab is up (python -m sandbox up)")
    results = []
    for h in hosts:
        spec = host_from_name(h["name"])
        base, key_file = endpoint(h, port)
        result = subprocess.run(ssh_command(spec, "python3", "-c",
                                            _quote(client(port, base=base, key_file=key_file))),
                                capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise LabError(f"{spec.name}: {base} did not answer: "
                           f"{(result.stderr or result.stdout).strip()[-800:]}")
        results.append({"host": spec.name, **json.loads(result.stdout)})
    return results


def endpoint(host: dict, port: int) -> tuple[str, str | None]:
    """Where ``ask`` asks a host of ``sandbox status --json`` from inside it, and the file of
    the key it sends (None: no key): the server on the loopback; in a fleet lab the server's
    gate on the switch, or on the router host the router's gate (docs/fleet.md's default port,
    8100)."""
    data = host.get("fleet_data", {})
    if "gpuhost_router_api_key_file" in data:
        return f"http://{data['gpuhost_router_host']}:8100", data["gpuhost_router_api_key_file"]
    if "gpuhost_api_key_file" in data:
        return f"http://{data['gpuhost_server_host']}:{port}", data["gpuhost_api_key_file"]
    return f"http://127.0.0.1:{port}", None


def client(port: int, nodes_env: str = NODES_ENV, base: str | None = None,
           key_file: str | None = None) -> str:
    """The script run on a host: its rank when it is a rank >= 1 of a node group, else the
    /v1/models and one chat answer of ``base`` (default the loopback's ``port``), sending the
    key in ``key_file`` where one is named, as JSON."""
    return _CLIENT % (base or f"http://127.0.0.1:{port}", key_file, nodes_env)


def said(result: dict) -> list[str]:
    """What ``sandbox ask`` prints of one host's result."""
    if "node_rank" in result:
        nodes = result["nodes"]
        return [f"{result['host']}: node rank {result['node_rank']} of {', '.join(nodes)}: the "
                f"group's model is asked through its rank 0, {nodes[0]}"]
    models = [m["id"] for m in result["models"]["data"]]
    return [f"{result['host']}: /v1/models lists {', '.join(models)}",
            f"{result['host']}: {models[0]} says: {result['answer']}"]


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
