"""Secret files (the API key file, the Hub token file): checked on the host while planning, the
check's own command run here on real files, and read by the host's programs
(operations/files/secret_file.py) without any error path showing the content."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from pyinfra.api import StringCommand

from operations.plans import plan
from operations.stages import server_refusals
from operations.files import secret_file
from tests.secret_guard import GUARD

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "operations" / "files" / "secret_file.py"

PART1 = GUARD.register("SECRETPART1-" + "a1" * 10, "API key (test)")
PART2 = GUARD.register("SECRETPART2-" + "b2" * 10, "API key (test)")
GOOD = GUARD.register("sk-good-" + "c3" * 12, "API key (test)")


def run_locally(cls, **kwargs):
    """A fact as pyinfra gathers it, with its own command run here (as root, like sudo on a
    host) instead of on a host."""
    fact = cls()
    command = fact.command(**kwargs)
    if isinstance(command, StringCommand):
        command = command.get_raw_value()
    result = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=False)
    lines = [line for line in result.stdout.splitlines() if line]
    GUARD.observe(f"fact {cls.__name__}", result.stdout + result.stderr)
    return fact.process(lines) if lines else fact.default() if hasattr(fact, "default") else None


def refusals_for(key: str, path: Path) -> list[str]:
    """The server stage's secret-file check on a host whose facts run here."""
    from pyinfra.context import ctx_host, ctx_state
    from pyinfra_testing.util import FakeState, create_host

    state = FakeState()
    host = create_host(state, name="gpu1")
    host.get_fact = run_locally
    plan._refusals.clear()
    try:
        with ctx_state.use(state), ctx_host.use(host):
            ok = server_refusals._check_secret_file(key, str(path))
        refusals = [r for rs in plan._refusals.values() for r in rs]
    finally:
        plan._refusals.clear()
    assert ok == (not refusals)
    for refusal in refusals:
        GUARD.observe("refusal", refusal)
    return refusals


def secret(tmp_path: Path, content: bytes, name: str = "api.key", mode: int = 0o600) -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    path.chmod(mode)
    return path


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the file must be owned by root")

BAD_CONTENT = [
    ("two-lines", PART1.encode() + b"\n" + PART2.encode() + b"\n", "it has 2 lines"),
    ("two-lines-crlf", PART1.encode() + b"\r\n" + PART2.encode() + b"\r\n", "it has 2 lines"),
    ("empty", b"", "it is empty"),
    ("only-newline", b"\n", "it is empty"),
    ("not-utf8", b"\xff\xfe" + PART1.encode(), "it is not UTF-8 text"),
    ("latin1", PART1.encode() + b"\xe9", "it is not UTF-8 text"),
    ("non-ascii", PART1.encode() + "é".encode(), "it holds a character outside ASCII"),
    ("bom", "\ufeff".encode() + PART1.encode(), "it holds a character outside ASCII"),
    ("space", PART1.encode() + b" " + PART2.encode(), "it holds a space"),
    ("trailing-space", PART1.encode() + b" \n", "it holds a space"),
    ("tab", PART1.encode() + b"\t", "it holds a tab"),
    ("bare-cr", PART1.encode() + b"\r" + PART2.encode(), "it holds a carriage return"),
    ("control", PART1.encode() + b"\x1b[0m", "it holds a control character"),
    ("nul", PART1.encode() + b"\x00", "it holds a control character"),
    ("too-long", b"k" * 4097, "it is longer than 4096 characters"),
]


@needs_root
@pytest.mark.parametrize(("case", "content", "why"), BAD_CONTENT, ids=[c[0] for c in BAD_CONTENT])
@pytest.mark.parametrize(("key", "what"), [("api_key_file", "key file"),
                                           ("hf_token_file", "token file")])
def test_bad_content_refused_while_planning(tmp_path, key, what, case, content, why):
    path = secret(tmp_path, content)
    (refusal,) = refusals_for(key, path)
    assert refusal.startswith(f"SGLang server: gpuhost_{key} = '{path}' is not allowed: "
                              "a file holding one line of 1 to 4096 visible ASCII characters")
    assert f"(the {what} {path} is not one line of header-safe text: {why})" in refusal
    for part in (PART1, PART2, "SECRETPART"):
        assert part not in refusal


@needs_root
@pytest.mark.parametrize("content", [GOOD.encode(), GOOD.encode() + b"\n",
                                     GOOD.encode() + b"\r\n", b"k" * 4096 + b"\r\n"])
def test_one_line_of_header_safe_text_passes(tmp_path, content):
    assert refusals_for("api_key_file", secret(tmp_path, content)) == []
    assert refusals_for("api_key_file", secret(tmp_path, content, mode=0o400)) == []


@needs_root
def test_the_file_itself(tmp_path):
    good = secret(tmp_path, GOOD.encode() + b"\n")
    link = tmp_path / "link.key"
    link.symlink_to(good)
    (refusal,) = refusals_for("api_key_file", link)
    assert (f"gpuhost_api_key_file = '{link}' is not allowed: a file on the host owned by root "
            f"with mode 0600 or 0400 (it is a symlink (to {good}): name the file itself)"
            ) in refusal
    (refusal,) = refusals_for("hf_token_file", tmp_path / "missing")
    assert refusal.endswith("a file on the host owned by root with mode 0600 or 0400 "
                            "(it does not exist)")
    (refusal,) = refusals_for("api_key_file", tmp_path)
    assert refusal.endswith("(it is a directory, not a regular file)")
    good.chmod(0o640)
    (refusal,) = refusals_for("api_key_file", good)
    assert refusal.endswith("(it is owned by root with mode 640)")


def test_the_check_prints_a_verdict_never_the_content(tmp_path):
    """What crosses from the host to the controller while planning: the command's whole
    output, for a bad and a good file."""
    for content in (PART1.encode() + b"\n" + PART2.encode(), GOOD.encode()):
        path = secret(tmp_path, content)
        result = subprocess.run([sys.executable, "-c", SCRIPT.read_text(), "--check", str(path)],
                                capture_output=True, text=True, check=True)
        assert result.stderr == ""
        for value in (PART1, PART2, GOOD):
            assert value not in result.stdout


@pytest.mark.parametrize(("case", "content", "why"), BAD_CONTENT, ids=[c[0] for c in BAD_CONTENT])
def test_read_secret_names_the_file_not_the_content(tmp_path, case, content, why):
    path = secret(tmp_path, content)
    with pytest.raises(secret_file.SecretFileError) as exc:
        secret_file.read_secret(str(path), "key file")
    message = str(exc.value)
    assert message.startswith(f"the key file {path} is not one line of header-safe text: {why}")
    assert exc.value.__cause__ is None and exc.value.__context__ is None
    for part in (PART1, PART2, "SECRETPART"):
        assert part not in message


def test_read_secret(tmp_path):
    assert secret_file.read_secret(str(secret(tmp_path, GOOD.encode() + b"\r\n"))) == GOOD
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "api.key")
    with pytest.raises(secret_file.SecretFileError, match="is a symlink: name the file itself"):
        secret_file.read_secret(str(link))
    with pytest.raises(secret_file.SecretFileError,
                       match="the token file /nonexistent cannot be read: No such file"):
        secret_file.read_secret("/nonexistent", "token file")


def test_describe_withholds_an_exceptions_text_once_a_secret_is_loaded():
    header = ValueError(f"Invalid header value b'Bearer {PART1}\\n{PART2}'")
    assert secret_file.describe(header, True) == \
        "ValueError (its text is withheld: it may quote a secret)"
    assert secret_file.describe(OSError(28, "No space left on device", "/m/x"), True) == \
        "OSError: No space left on device: /m/x"
    assert secret_file.describe(KeyError("x"), False) == "KeyError: 'x'"


# --- the host's programs: no error path shows a secret -----------------------------------------

FAKE_SYSTEMCTL = r"""#!/usr/bin/env python3
import json, os, sys
states = json.load(open(os.environ["FAKE_UNITS"]))
if sys.argv[1] == "show":
    unit = sys.argv[-1]
    active, sub = states.get(unit, ["active", "running"])
    print(f"ActiveState={active}\nSubState={sub}\nMainPID=4242")
"""
FAKE_JOURNALCTL = "#!/bin/sh\necho \"journal of $3\"\n"


class Served(BaseHTTPRequestHandler):
    """The server on the loopback: /health, /v1/models, a chat completion."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            return self._send(200, {"data": [{"id": "glm-5"}]})
        return self._send(200 if self.path == "/health" else 404, {})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return self._send(200, {"choices": [{"message": {"content": "Paris"}}]})


class FakeGate(Served):
    """The API key gate: 401 without a Bearer header; /get_server_info answers
    ``info_status``."""

    info_status = 200

    def do_GET(self):
        if not (self.headers.get("Authorization") or "").startswith("Bearer "):
            return self._send(401, {})
        if self.path == "/get_server_info":
            return self._send(FakeGate.info_status, {"model_path": "/m"})
        return super().do_GET()


@pytest.fixture
def health_env(tmp_path):
    """health_check.py against a local server and gate, with a fake systemctl and journalctl
    on PATH: run(key file content, unit states) -> CompletedProcess."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("systemctl", FAKE_SYSTEMCTL), ("journalctl", FAKE_JOURNALCTL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    units = tmp_path / "units.json"
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for handler in (Served, FakeGate)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    url, gate_url = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)

    def run(key: bytes, states: dict | None = None) -> subprocess.CompletedProcess:
        units.write_text(json.dumps(states or {}))
        key_file = secret(tmp_path, key)
        result = subprocess.run(
            [sys.executable, str(SCRIPT.parent / "health_check.py"), "--url", url,
             "--model", "glm-5", "--unit", "sglang.service", "--timeout", "20",
             "--public-url", gate_url, "--api-key-file", str(key_file),
             "--gate-unit", "sglang-gate.service"],
            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_UNITS": str(units)},
            capture_output=True, text=True, check=False, timeout=60)
        GUARD.observe("health_check.py", result.stdout + result.stderr)
        return result

    yield run
    for server in servers:
        server.shutdown()


def test_health_check_passes_with_a_good_key(health_env):
    result = health_env(GOOD.encode() + b"\n")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ready after" in result.stdout


@pytest.mark.parametrize(("content", "why"), [
    (PART1.encode() + b"\n" + PART2.encode() + b"\n", "it has 2 lines"),
    (b"", "it is empty"),
    (b"\xff" + PART1.encode(), "it is not UTF-8 text"),
], ids=["two-lines", "empty", "not-utf8"])
def test_health_check_refuses_a_bad_key_file_without_showing_it(health_env, content, why):
    result = health_env(content)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "server not ready: cannot check the API key gate: the key file " in output
    assert f"is not one line of header-safe text: {why}" in output
    assert "Traceback" not in output and "ready after" not in output
    for part in (PART1, PART2, "SECRETPART"):
        assert part not in output


def test_health_check_names_a_gate_that_cannot_read_its_key(health_env):
    FakeGate.info_status = 503
    try:
        result = health_env(GOOD.encode())
    finally:
        FakeGate.info_status = 200
    assert result.returncode == 1
    assert "the gate cannot read its key file" in result.stdout
    assert "last 50 lines of the journal of sglang-gate.service" in result.stdout


def test_health_check_fails_at_once_when_the_gate_crash_loops(health_env):
    result = health_env(GOOD.encode(), {"sglang-gate.service": ["activating", "auto-restart"]})
    assert result.returncode == 1
    assert "sglang-gate.service is activating (auto-restart): the API key gate exited" \
        in result.stdout
    assert "journal of sglang-gate.service" in result.stdout


FAKE_HUB = """
class HfApi:
    def __init__(self, endpoint=None, token=None):
        self.token = token
    def model_info(self, repo, revision=None, files_metadata=False):
        # as requests does with a header it cannot send
        raise ValueError(f"Invalid leading whitespace, reserved character(s), or return "
                         f"character(s) in header value: 'Bearer {self.token}'")
def snapshot_download(*a, **k):
    raise AssertionError("must not download")
"""


@pytest.mark.parametrize(("content", "expected"), [
    (PART1.encode() + b"\n" + PART2.encode(), "is not one line of header-safe text: it has 2 lines"),
    (b"\n", "is not one line of header-safe text: it is empty"),
    (GOOD.encode() + b"\n", "model download failed: ValueError (its text is withheld"),
], ids=["two-lines", "empty", "an-error-quoting-the-header"])
def test_model_fetch_never_shows_the_token(tmp_path, content, expected):
    fake = tmp_path / "fake" / "huggingface_hub"
    (fake / "utils").mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_HUB)
    (fake / "utils" / "__init__.py").write_text("class HfHubHTTPError(Exception):\n    pass\n")
    token = secret(tmp_path, content, name="hf_token")
    result = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "model_fetch.py"), "--repo", "org/gated",
         "--revision", "main", "--dest", str(tmp_path / "models"), "--endpoint",
         "http://127.0.0.1:9", "--token-file", str(token)],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "fake")},
        capture_output=True, text=True, check=False)
    output = result.stdout + result.stderr
    GUARD.observe("model_fetch.py", output)
    assert result.returncode == 1
    assert expected in output
    assert "Traceback" not in output
    for value in (PART1, PART2, GOOD, "SECRETPART", "Bearer"):
        assert value not in output
