"""Room for the model's download, read while planning (operations/facts/model_facts.py ModelRoom,
operations/files/model_room.py): the revision's files not there yet, from the Hub's file
listing as huggingface_hub's model_info asks for it, against the free room of the model
folder's file system."""

from __future__ import annotations

import http.server
import json
import subprocess
import threading

from operations.facts.model_facts import ROOM_HEADROOM_GIB, ModelRoom
from operations.plans.settings import Settings
from operations.stages.model import model_room_problem

GIB = 2**30


def _hub(seen: list, siblings: list | None = None) -> http.server.ThreadingHTTPServer:
    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            if self.path != "/api/models/org/m/revision/v%2F1?blobs=True":
                self.send_error(404)
                return
            body = json.dumps({"sha": "abc", "siblings": siblings or [
                {"rfilename": "config.json", "size": 10},
                {"rfilename": "w/model.safetensors", "size": 5000}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_room_is_the_files_not_there_yet_against_the_free_room(tmp_path):
    seen: list = []
    server = _hub(seen)
    dest = tmp_path / "models" / "org" / "m"
    (dest / "w").mkdir(parents=True)
    (dest / "config.json").write_text("0123456789")  # its size: there already
    (dest / "w" / "model.safetensors").write_bytes(b"x" * 10)  # wrong size: fetched again
    token = tmp_path / "token"
    token.write_text("hf_secret\n")
    try:
        command = ModelRoom().command(f"http://127.0.0.1:{server.server_port}", "org/m", "v/1",
                                      str(dest), str(token))
        out = subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                             check=True).stdout.splitlines()
        missing = subprocess.run(["sh", "-c", ModelRoom().command(
            f"http://127.0.0.1:{server.server_port}", "org/none", "main",
            str(tmp_path / "absent" / "x"), None)], capture_output=True, text=True,
            check=True).stdout.splitlines()
    finally:
        server.shutdown()
    room = ModelRoom().process(out)
    assert room["need"] == 5000 and room["folder"] == str(dest) and room["free"] > 0
    # every weight file the listing names, there or not (the GPU memory check's figure)
    assert room["weights"] == 5000 and room["weights_unsized"] == 0
    assert room["mount"].startswith("/")
    assert seen[0] == ("/api/models/org/m/revision/v%2F1?blobs=True", "Bearer hf_secret")
    assert ModelRoom().process(missing) == {"error": "HTTPError HTTP 404 Not Found"}
    assert "hf_secret" not in " ".join(out + missing)


def test_a_model_that_does_not_fit_is_refused_naming_folder_mount_need_and_free():
    settings = Settings(model="org/m", model_dir="/opt/gpuhost/models")
    facts = {"ModelSnapshot": {}, "ModelRoom": {"need": 3 * GIB, "free": 2 * GIB,
                                                 "mount": "/opt", "folder": "/opt/gpuhost"}}

    def fact(cls, **kwargs):
        return facts[cls.__name__]

    assert model_room_problem(fact, settings) == (
        "no room for the model org/m@main in /opt/gpuhost/models/org/m: /opt/gpuhost on the "
        f"file system mounted on /opt (df): {3 + ROOM_HEADROOM_GIB:.1f} GiB needed (3.0 GiB "
        "of the revision's files not there yet, from the Hub's file listing, and 1 GiB kept "
        "free), 2.0 GiB free: make room there, mount a larger file system, or set "
        "gpuhost_model_dir elsewhere")
    facts["ModelRoom"]["free"] = 5 * GIB
    assert model_room_problem(fact, settings) is None
    facts["ModelRoom"] = {"error": "URLError timed out"}
    assert model_room_problem(fact, settings) is None  # said; the download's own check stands
    # a complete copy is not asked about at all
    facts["ModelSnapshot"] = {"repo": "org/m", "revision": "main", "complete": True}
    del facts["ModelRoom"]
    assert model_room_problem(fact, settings) is None


def test_a_token_file_of_two_lines_is_never_sent_nor_printed(tmp_path):
    """http.client refuses a header with a newline by a ValueError that quotes the header
    whole: the token. The fact sends no such token and prints only that it holds none (the
    secret-file check refuses the file, naming the key; e2e test_bad_input's token-two-lines)."""
    seen: list = []
    server = _hub(seen)
    token = tmp_path / "token"
    token.write_text("SECRETPART1-aaaa\nSECRETPART2-bbbb\n")
    try:
        run = subprocess.run(["sh", "-c", ModelRoom().command(
            f"http://127.0.0.1:{server.server_port}", "org/m", "main", str(tmp_path / "m"),
            str(token))], capture_output=True, text=True, check=True)
    finally:
        server.shutdown()
    assert ModelRoom().process(run.stdout.splitlines()) == {
        "error": "the token file holds no single token"}
    assert "SECRETPART" not in run.stdout + run.stderr and seen == []


def test_a_token_file_that_is_no_regular_file_is_neither_followed_nor_waited_on(tmp_path):
    """A symlink (to the token, or to /dev/zero), a FIFO and a huge sparse file: the fact reads
    the token as secret_file.py reads a secret (never followed, never waited on, capped), so
    planning neither hangs nor reads without end, and nothing is sent (the secret-file check
    refuses each, naming the key)."""
    import os

    seen: list = []
    server = _hub(seen)
    real = tmp_path / "real"
    real.write_text("hf_SECRETTOKEN\n")
    (tmp_path / "link-token").symlink_to(real)
    (tmp_path / "link-zero").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    with open(tmp_path / "huge", "wb") as f:
        f.truncate(8 * GIB)
    said = {}
    try:
        for name in ("link-token", "link-zero", "fifo", "huge"):
            path = tmp_path / name
            command = ModelRoom().command(f"http://127.0.0.1:{server.server_port}", "org/m",
                                          "main", str(tmp_path / "m"), str(path))
            # bounded, should a regression read /dev/zero again: 2 GiB of memory, 30 s
            run = subprocess.run(["sh", "-c", f"ulimit -v 2097152; exec {command}"],
                                 capture_output=True, text=True, check=True, timeout=30)
            said[name] = ModelRoom().process(run.stdout.splitlines())
            assert "SECRETTOKEN" not in run.stdout + run.stderr
    finally:
        server.shutdown()
    assert said == {"link-token": {"error": "the token file is not a regular file"},
                    "link-zero": {"error": "the token file is not a regular file"},
                    "fifo": {"error": "the token file is not a regular file"},
                    "huge": {"error": "the token file holds no single token"}}
    assert seen == []


def test_a_listing_with_files_of_no_size_or_no_name_is_said_not_a_traceback(tmp_path,
                                                                            monkeypatch):
    """Siblings the Hub lists without a size (or with one that is no byte count) count nothing
    and are counted apart, for the plan to say; one without ``rfilename`` is an error line, not
    the last lines of a traceback."""
    runs = {}
    for name, siblings in {"unsized": [{"rfilename": "a", "size": 7}, {"rfilename": "b"},
                                       {"rfilename": "e.safetensors"},
                                       {"rfilename": "c", "size": "9"},
                                       {"rfilename": "d", "size": -1}],
                           "nameless": [{"rfilename": "a", "size": 7}, {"size": 9}]}.items():
        server = _hub([], siblings)
        try:
            run = subprocess.run(["sh", "-c", ModelRoom().command(
                f"http://127.0.0.1:{server.server_port}", "org/m", "v/1", str(tmp_path / "m"),
                None)], capture_output=True, text=True, check=True, timeout=30)
        finally:
            server.shutdown()
        assert run.stderr == ""
        runs[name] = ModelRoom().process(run.stdout.splitlines())
    assert runs["unsized"]["need"] == 7 and runs["unsized"]["unsized"] == 4
    assert runs["unsized"]["weights_unsized"] == 1
    assert runs["nameless"] == {"error": "the Hub's file listing has a sibling without rfilename"}
    said = []
    facts = {"ModelSnapshot": {}, "ModelRoom": {**runs["unsized"], "free": 5 * GIB}}
    monkeypatch.setattr("operations.stages.model.logger.warning", said.append)
    assert model_room_problem(lambda cls, **kw: facts[cls.__name__], Settings(model="org/m")) \
        is None
    assert said and said[0].endswith("the model's room check counts nothing for 4 file(s) the "
                                     "Hub's file listing gives no size of")
