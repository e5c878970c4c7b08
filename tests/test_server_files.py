"""The scripts the server stage runs on the host (operations/files/), and the hub stand-in, run
here against local servers."""

import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = ROOT / "operations" / "files"


def load(name):
    # As on the host, where the scripts import secret_file.py from their own folder.
    if str(FILES) not in sys.path:
        sys.path.insert(0, str(FILES))
    spec = importlib.util.spec_from_file_location(name, FILES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


health = load("health_check")


@pytest.mark.parametrize(("text", "why"), [
    ("Paris", None),
    ("The capital of France is Paris.", None),
    ("!!!!!!!!!!!!!!!!", "one character repeated"),
    ("the the the the", "one token repeated"),
    ("NaN", "it contains NaN"),
    ("value: nan nan", "it contains NaN"),
    ("Nanjing is not the capital of France.", None),
])
def test_degenerate(text, why):
    got = health.degenerate(text)
    assert (got is None) if why is None else (why in got)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Backend(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen_auth: ClassVar[list] = []

    def log_message(self, *a):
        pass

    def do_GET(self):
        Backend.seen_auth.append(self.headers.get("Authorization"))
        body = json.dumps({"api_key": None, "model_path": "/m", "port": 1}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def get(url, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_hub_stand_in_gates_and_serves(tmp_path):
    from sandbox import hub

    token = hub.ensure_token(tmp_path / "token")
    port = free_port()
    hub.Handler.hub = hub.Hub(token)
    server = hub.Server(("127.0.0.1", port), hub.Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    try:
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(f"{base}/api/models/{hub.REPO_ID}/revision/main")
        assert exc.value.code == 401 and exc.value.headers["X-Error-Code"] == "GatedRepo"
        status, body = get(f"{base}/api/models/{hub.REPO_ID}/revision/main?blobs=True", token)
        info = json.loads(body)
        assert status == 200 and info["id"] == hub.REPO_ID and len(info["sha"]) == 40
        sizes = {s["rfilename"]: s["size"] for s in info["siblings"]}
        assert sizes["config.json"] > 0 and "model-00001-of-00002.safetensors" in sizes
        request = urllib.request.Request(
            f"{base}/{hub.REPO_ID}/resolve/main/config.json", method="HEAD",
            headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request) as r:
            assert r.headers["X-Repo-Commit"] == info["sha"]
            assert int(r.headers["Content-Length"]) == sizes["config.json"]
        status, _ = get(f"{base}/api/models/{hub.REPO_ID}/revision/nope", token)
        assert status == 404
    finally:
        server.shutdown()


FAKE_HUB = '''
import os, types
class _Sibling:
    def __init__(self, name, size):
        self.rfilename, self.size = name, size
class HfApi:
    def __init__(self, endpoint=None, token=None):
        pass
    def model_info(self, repo, revision=None, files_metadata=False):
        size = int(os.environ["FAKE_SIZE"])
        return types.SimpleNamespace(sha="a" * 40, siblings=[_Sibling("model.safetensors", size)])
def snapshot_download(*a, **k):
    raise AssertionError("must not download")
'''


def test_model_fetch_refuses_a_download_that_cannot_fit(tmp_path):
    """The disk preflight runs before any download (huggingface_hub replaced by a fake that
    announces a 1 PiB file and fails if asked to download)."""
    fake = tmp_path / "fake" / "huggingface_hub"
    (fake / "utils").mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_HUB)
    (fake / "utils" / "__init__.py").write_text("class HfHubHTTPError(Exception):\n    pass\n")
    result = subprocess.run(
        [sys.executable, str(FILES / "model_fetch.py"), "--repo", "org/big", "--revision",
         "main", "--dest", str(tmp_path / "models" / "org" / "big"), "--endpoint",
         "http://127.0.0.1:9"],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "fake"),
             "FAKE_SIZE": str(1024**5)},
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "not enough disk for org/big@" + "a" * 40 in result.stderr
    assert "1048576.00 GiB to download + 1 GiB headroom" in result.stderr


def test_health_only_sees_the_server_within_a_second_of_its_start():
    """The unit's ExecStartPost (--health-only): a server that starts answering 1.1 s into the
    wait is seen within WATCH_EVERY_S and a request, not at the next whole second."""
    port = free_port()
    started = []

    def serve_later():
        time.sleep(1.1)
        server = ThreadingHTTPServer(("127.0.0.1", port), Backend)
        started.append((time.monotonic(), server))
        server.serve_forever()

    threading.Thread(target=serve_later, daemon=True).start()
    assert health.health_only(f"http://127.0.0.1:{port}", timeout=10, main_pid=None) == 0
    seen = time.monotonic()
    at, server = started[0]
    server.shutdown()
    assert seen - at < 0.6
