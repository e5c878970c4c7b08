"""Ask each sandbox host's SGLang server what it serves, and one chat question, from inside the
host (the server binds the host's 127.0.0.1), and print the answers."""

from __future__ import annotations

import json
import subprocess

from sandbox.lab import LabError, ssh_command, status
from sandbox.layout import host_from_name

_CLIENT = r"""
import json, sys, urllib.request
base = "http://127.0.0.1:%d"
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
    """For each running host: its /v1/models and the answer to one chat question. Raises
    LabError when no lab is up or a host's server does not answer."""
    hosts = status()
    if not hosts:
        raise LabError("no sandbox lab is up (python -m sandbox up)")
    results = []
    for h in hosts:
        spec = host_from_name(h["name"])
        result = subprocess.run(ssh_command(spec, "python3", "-c", _quote(_CLIENT % port)),
                                capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise LabError(f"{spec.name}: the server on port {port} did not answer: "
                           f"{(result.stderr or result.stdout).strip()[-800:]}")
        results.append({"host": spec.name, **json.loads(result.stdout)})
    return results


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
