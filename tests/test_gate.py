"""The API gates' nginx configuration (templates/gate-nginx.conf.j2, operations/stages/gate.py) and
the keys' include gate_keys.py writes on the host (operations/files/gate_keys.py).

Patterns are checked with Python's re, whose ``\\xHH`` escapes, character classes and anchors
read as PCRE2's do (nginx's regular expressions)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from operations.plans.settings import from_host_data
from operations.stages import gate

ROOT = Path(__file__).resolve().parent.parent
FILES = ROOT / "operations" / "files"
sys.path.insert(0, str(FILES))  # as it runs on the host, beside secret_file.py
import gate_keys  # noqa: E402


def render(g: gate.Gate) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ROOT / "templates"))
    return env.get_template("gate-nginx.conf.j2").render(**gate.conf_context(g))


def worker(**extra) -> gate.Gate:
    from operations.stages.server_unit import worker_gate

    data = {"gpuhost_server_host": "0.0.0.0", "gpuhost_api_key_file": "/root/key", **extra}
    return worker_gate(from_host_data("gpu1", data))


def nginx_regex(source: str) -> re.Pattern:
    """A map source ``~...`` as the regular expression nginx compiles."""
    assert source.startswith("~")
    return re.compile(source[1:])


@pytest.mark.parametrize("key", ["sk-abc123", 'a"b\\c$d{}x;', "K" * 4096, "x.y_z~+/="])
def test_the_bearer_pattern_admits_the_key_alone(key):
    pattern = nginx_regex(gate_keys.bearer_pattern(key))
    for header in (f"Bearer {key}", f"bearer {key}", f"BEARER  {key}", f"Bearer {key} "):
        assert pattern.search(header), header
    for header in (f"Bearer {key}x", f"Bearer x{key}", f"Basic {key}", key, f"Bearer {key.lower()}"
                   if key.lower() != key else "Bearer", f"Bearer {key}\nBearer other"):
        assert not pattern.search(header), header
    # nothing nginx's quoted string or the pattern would read as syntax
    body = gate_keys.bearer_pattern(key)
    assert not set(body) & set('"\';{}') and "\\\\" not in body


def keys_run(tmp_path, *args) -> tuple[subprocess.CompletedProcess, str]:
    out = tmp_path / "gate.keys"
    run = subprocess.run([sys.executable, str(FILES / "gate_keys.py"), "--out", str(out), *args],
                         capture_output=True, text=True, check=False)
    return run, out.read_text() if out.exists() else ""


def test_gate_keys_writes_a_root_only_include_and_says_why_it_refuses(tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-secret-1\n")
    key.chmod(0o600)
    backend = tmp_path / "backend"
    backend.write_text("sk-backend-2\n")
    run, text = keys_run(tmp_path, "--key-file", str(key), "--backend-key-file", str(backend))
    assert run.returncode == 0 and run.stderr == ""
    assert os.stat(tmp_path / "gate.keys").st_mode & 0o777 == 0o600
    assert "map $http_authorization $gpuhost_key_ok" in text
    assert 'default "Bearer sk-backend-2";' in text
    assert re.search(r"\$gpuhost_keys_read \{\s+default 1;", text)
    # a key file that vanished: no key admitted, 503 (keys_read 0), the reason once
    key.rename(tmp_path / "away")
    run, text = keys_run(tmp_path, "--key-file", str(key), "--backend-key-file", str(backend))
    assert run.returncode == 0
    assert f"the key file {key} cannot be read: No such file or directory" in run.stderr
    assert re.search(r"\$gpuhost_keys_read \{\s+default 0;", text)
    assert "sk-" not in text and "sk-" not in run.stderr
    again, _ = keys_run(tmp_path, "--key-file", str(key), "--backend-key-file", str(backend))
    assert again.stderr == ""  # said once
    (tmp_path / "away").rename(key)
    back, text = keys_run(tmp_path, "--key-file", str(key), "--backend-key-file", str(backend))
    assert f"the key file {key} is readable again" in back.stderr
    assert "default 1;" in text and "sk-secret-1" not in back.stderr


def test_a_workers_gate_sends_the_server_no_key(tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-secret-1\n")
    _, text = keys_run(tmp_path, "--key-file", str(key))
    assert 'default "";' in text  # nginx sends no header of an empty value


def test_the_path_allow_list_matches_the_path_as_sent_only():
    pattern = nginx_regex(gate.path_pattern("/v1/models"))
    assert pattern.search("/v1/models") and pattern.search("/v1/models?x=1")
    for uri in ("/v1/models/", "/v1/modelsx", "/workers/../v1/models", "//v1/models",
                "/v1/models%2F..%2Fworkers", "/v1/models#x"):
        assert not pattern.search(uri), uri
    assert gate.path_pattern("/health_generate") == "~^/health\\x5fgenerate(\\?|$)"


def test_the_router_gate_allows_the_inference_paths_only():
    from operations.stages import router

    s = from_host_data("r", {"gpuhost_router_api_key_file": "/root/router.key",
                             "gpuhost_serving": False})
    conf = render(router.router_gate(s))
    paths = conf.split("map $request_uri $gpuhost_path {")[1].split("}")[0]
    assert "default deny;" in paths
    sources = re.findall(r'"(~[^"]+)" key;', paths)
    allowed = [p for p in ("/v1/chat/completions", "/v1/models", "/generate", "/workers",
                           "/workers/1", "/flush_cache")
               if any(nginx_regex(s).search(p) for s in sources)]
    assert allowed == ["/v1/chat/completions", "/v1/models", "/generate"]


def test_the_workers_gate_logs_no_query_and_no_header():
    conf = render(worker())
    (fmt,) = re.findall(r"log_format gpuhost ([^;]+);", conf)
    assert "$uri" in fmt and "$request " not in fmt and "$request_uri" not in fmt
    assert "$http_" not in fmt and "$args" not in fmt and "$query_string" not in fmt
    # request errors quote the request line: only crit and above inside http
    assert "error_log stderr crit;" in conf.split("http {")[1]
    assert "listen 0.0.0.0:8000;" in conf and "proxy_pass http://127.0.0.1:30000;" in conf
    assert "default key;" in conf  # every path with the key, as sglang serves them


def test_the_verdict_refuses_before_the_body_and_passes_open_paths():
    """The decision is made in the server's rewrite phase (server-level ``if``/``return``,
    before the location's client_max_body_size is looked at), from the path, the trusted
    address, the key and whether the keys could be read."""
    conf = render(worker(gpuhost_api_gate_trusted_peers=["10.0.0.9"]))
    server = conf.split("server {")[1]
    assert server.index("return 401") < server.index("location /")
    verdict = conf.split("$gpuhost_verdict {")[1].split("}")[0]
    entries = re.findall(r'^\s*(\S+)\s+(\S+);$', verdict, re.M)
    exact = {k.strip('"'): v for k, v in entries if not k.startswith('"~')}
    regexes = [(re.compile(k.strip('"')[1:]), v) for k, v in entries if k.startswith('"~')]

    def decide(path: str, trusted: int, key: int, read: int) -> str:
        value = f"{path}:{trusted}{key}:{read}"
        if value in exact:
            return exact[value]
        for pattern, result in regexes:
            if pattern.search(value):
                return result
        return exact["default"]

    assert decide("key", 0, 1, 1) == "pass"
    assert decide("key", 0, 0, 1) == "401"
    assert decide("key", 0, 0, 0) == "503"
    assert decide("key", 1, 0, 1) == "pass"  # a trusted peer
    assert decide("open", 0, 0, 1) == "pass" and decide("open", 0, 0, 0) == "pass"
    assert decide("deny", 0, 1, 1) == "404" and decide("deny", 1, 1, 1) == "404"
    assert "10.0.0.9 1;" in conf


def test_a_dual_stack_bind_listens_on_both():
    assert "listen [::]:8000 ipv6only=off;" in render(worker(gpuhost_server_host="::"))
