"""Ask each sandbox host's SGLang server what it serves, and one chat question, from inside the
host (the server binds the host's 127.0.0.1), and print the answers."""

from __future__ import annotations

import json
import subprocess

from sandbox.lab import LabError, ssh_command, status
from sandbox.layout import host_from_name

#: Where a node of a group keeps its rank (operations/node_group.py env_file: its first line,
#: "# Written by gpuhost: node rank 1 of 2 (gpu1, gpu2), rendezvous ...").
NODES_ENV = "/etc/gpuhost/nodes.env"

_CLIENT = r"""
import json, re, sys, urllib.request
base = "http://127.0.0.1:%d"
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
models = json.load(urllib.request.urlopen(base + "/v1/models", timeout=10))
name = models["data"][0]["id"]
request = urllib.request.Request(
    base + "/v1/chat/completions",
    data=json.dumps({"model": name, "temperature": 0, "max_tokens": 32,
                     "messages": [{"role": "user", "content": "Say hello in five words."}]}).encode(),
    headers={"Content-Type": "application/json"},
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
        result = subprocess.run(ssh_command(spec, "python3", "-c", _quote(client(port))),
                                capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise LabError(f"{spec.name}: the server on port {port} did not answer: "
                           f"{(result.stderr or result.stdout).strip()[-800:]}")
        results.append({"host": spec.name, **json.loads(result.stdout)})
    return results


def client(port: int, nodes_env: str = NODES_ENV) -> str:
    """The script run on a host: its rank when it is a rank >= 1 of a node group, else its
    server's /v1/models and one chat answer, as JSON."""
    return _CLIENT % (port, nodes_env)


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
