"""The locked wheels' cache on the controller: keyed by sha256, sent to a fresh host and filled
from it (the host's side run here: its SSH login replaced by a local shell), and the commands of
a fresh install (pip still checks every hash)."""

from __future__ import annotations

import hashlib
import shlex
import subprocess
import types
from pathlib import Path

import pytest
from pyinfra.api import FunctionCommand

from operations.stages import locked_wheels
from operations.stages.model import model_room_problem

A = b"A" * 1000
B = b"B" * 2000


def _hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _Host:
    name = "gpu2"
    print_prefix = "[gpu2] "

    def log_styled(self, text, **kwargs):
        raise AssertionError(text)


@pytest.fixture
def on_host(monkeypatch, tmp_path):
    """The host's WHEEL_DIR in tmp_path/host, its commands run by a local shell."""
    folder = tmp_path / "host" / "wheels"
    monkeypatch.setattr(locked_wheels, "WHEEL_DIR", str(folder))
    monkeypatch.setattr(locked_wheels, "_ssh", lambda host: ["sh", "-c"])

    def shell(host, command, **kwargs):
        done = subprocess.run(["sh", "-c", str(command.get_raw_value())], capture_output=True,
                              text=True, check=False)
        return done.returncode == 0, types.SimpleNamespace(
            stdout_lines=done.stdout.splitlines(), stderr_lines=done.stderr.splitlines())

    monkeypatch.setattr(locked_wheels.remote, "shell", shell)
    monkeypatch.setattr(locked_wheels.remote, "put",
                        lambda host, src, dest: Path(dest).write_text(src.read()))
    monkeypatch.setattr(locked_wheels.logger, "info", lambda line: None)
    return folder


def test_the_lock_hashes_key_the_cache():
    text = ("torch==2.9.1 \\\n    --hash=sha256:aa --hash=sha256:bb\n"
            "sglang==0.5.9 --hash=sha256:cc\n")
    assert locked_wheels.lock_hashes(text) == {"aa", "bb", "cc"}


def test_a_host_fills_the_cache_with_the_locked_files_only(tmp_path, on_host):
    on_host.mkdir(parents=True)
    (on_host / "a-1.0-py3-none-any.whl").write_bytes(A)
    (on_host / "b-1.0-py3-none-any.whl").write_bytes(B)  # not of the lock: not cached
    cache = str(tmp_path / "controller")
    assert locked_wheels.harvest(None, _Host(), cache, {_hex(A), "f" * 64})
    assert locked_wheels.cached(cache, {_hex(A), _hex(B)}) == {
        _hex(A): tmp_path / "controller" / "locked" / _hex(A) / "a-1.0-py3-none-any.whl"}
    assert not on_host.exists()  # removed from the host once cached


def test_the_cache_sends_a_fresh_host_the_files_of_its_lock(tmp_path, on_host):
    cache = tmp_path / "controller" / "locked"
    for data, name in ((A, "a-1.0-py3-none-any.whl"), (B, "b-1.0-py3-none-any.whl")):
        (cache / _hex(data)).mkdir(parents=True)
        (cache / _hex(data) / name).write_bytes(data)
    text = f"a==1.0 --hash=sha256:{_hex(A)}\nc==2.0 --hash=sha256:{'c' * 64}\n"
    assert locked_wheels.send(None, _Host(), str(tmp_path / "controller"), text)
    assert sorted(p.name for p in on_host.iterdir()) == ["a-1.0-py3-none-any.whl",
                                                         "missing.txt"]
    assert (on_host / "a-1.0-py3-none-any.whl").read_bytes() == A
    # what the index must still give: the lines the cache holds no file of
    assert (on_host / "missing.txt").read_text() == f"c==2.0 --hash=sha256:{'c' * 64}\n"


def test_a_fresh_install_downloads_what_is_missing_and_installs_with_every_hash_checked():
    commands = list(locked_wheels.fresh_install(
        "/opt/v", "/etc/gpuhost/lock/stack.txt", "x==1 --hash=sha256:aa\n",
        "http://10.213.2.1:8080/simple/", "~/.cache/gpuhost/wheels", []))
    assert [type(c) for c in commands] == [FunctionCommand, type(commands[1]),
                                           type(commands[2]), FunctionCommand]
    download, install = (str(c.get_raw_value()) for c in commands[1:3])
    assert "--require-hashes" in download and "--require-hashes" in install
    assert " download " in download and "--dest /opt/gpuhost/wheels/locked" in download
    assert "-r /opt/gpuhost/wheels/locked/missing.txt" in download
    # the folder alone: with the index too pip would take the index's files (hashed links)
    assert "--no-index --find-links /opt/gpuhost/wheels/locked" in install
    assert "--index-url" not in install and "-r /etc/gpuhost/lock/stack.txt" in install


def test_a_fresh_venvs_room_counts_the_cached_files_here_and_asks_the_index_for_the_rest(
        tmp_path):
    """The controller's cache gives a cached file's size and what its members unpack to; only
    the lock's other names go to LockSizes (the index, read from the host)."""
    import zipfile

    from operations.plans.lock import Pin
    from operations.stages.venvs import PIP_CACHE, VENVS_DIR, WHEEL_DIR

    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("demo/__init__.py", "x" * 3000)
        z.writestr("demo/lib.so", b"\0" * 7000)
    digest = _hex(wheel.read_bytes())
    cached = tmp_path / "cache" / locked_wheels.SUBDIR / digest
    cached.mkdir(parents=True)
    (cached / wheel.name).write_bytes(wheel.read_bytes())
    lock = types.SimpleNamespace(pins=(
        Pin("demo", "1.0", (f"sha256:{digest}",), "demo==1.0"),
        Pin("other", "2.0", ("sha256:" + "f" * 64,), "other==2.0")))
    settings = types.SimpleNamespace(venv_path="/opt/gpuhost/venv", pip_index_url="http://i/s",
                                     wheel_cache=str(tmp_path / "cache"), model_is_local=True)
    asked = []
    folders = {f: {"free_kib": 5 * 2**20, "mount": "/"} for f in (VENVS_DIR, WHEEL_DIR,
                                                                   PIP_CACHE)}

    def fact(cls, **kwargs):
        if cls.__name__ == "VenvRoom":
            return {"serving_kib": 0, "free_kib": 5 * 2**20, "mount": "/", "folders": folders}
        asked.append(kwargs["pins"])
        return {"other": {"file": "other.whl", "download": 2**30, "installed": 2 * 2**30}}

    problem = locked_wheels.room_problem(fact, settings, lock, "/opt/gpuhost/venvs/ab")
    assert asked == [("other==2.0:" + "f" * 16,)]
    # 2 GiB + the cached wheel's 13000 bytes in the venv, 2 x (1 GiB + its size) downloaded,
    # 1 GiB kept free: 5.0 GiB and some 40 KiB on one file system with 5.0 GiB free
    assert problem.startswith("no room for the new venv /opt/gpuhost/venvs/ab and the lock's "
                              f"downloads: {VENVS_DIR}, {WHEEL_DIR}, {PIP_CACHE} on the file "
                              "system mounted on / (df): 5.0 GiB needed"), problem
    folders[VENVS_DIR]["free_kib"] = 6 * 2**20  # the first folder's figure counts per mount
    assert locked_wheels.room_problem(fact, settings, lock, "/v") is None


def test_a_failed_download_names_the_index_and_its_route(tmp_path):
    """The download's failure line, run by sh as the host runs it: the index, the route (no
    proxy outside a run) and pip's exit status, which the command keeps."""
    commands = list(locked_wheels.fresh_install(
        "/opt/v", "/etc/gpuhost/lock/stack.txt", "x==1 --hash=sha256:aa\n",
        "http://10.213.2.1:8080/simple/", "~/.cache/gpuhost/wheels", []))
    script = str(commands[1].get_raw_value()).split(" ", 2)[2]
    script = shlex.split(script)[0].replace(locked_wheels.WHEEL_DIR, str(tmp_path))
    (tmp_path / locked_wheels.MISSING).write_text("x==1\n")
    head, _, rest = script.partition(" || ")
    run = subprocess.run(["sh", "-c", "if true; then (exit 4) || " + rest], text=True,
                         capture_output=True, check=False)
    assert run.returncode == 4
    assert run.stderr.strip() == ("the download of the lock's wheels from "
                                  "http://10.213.2.1:8080/simple/ directly, through no proxy "
                                  "failed (pip's exit status 4)")


def test_the_venv_and_the_models_download_on_one_file_system_are_counted_together(tmp_path):
    """The default folders (/opt/gpuhost/venvs, /opt/gpuhost/models) share a file system: a
    fresh venv (or one beside a serving venv) and the model's download to come in the same run
    each fit alone and not together; the venv's room check counts both, naming each. Before,
    each check passed, and the download failed at run time, after the driver and the venv."""
    from operations.plans.lock import Pin
    from operations.plans.settings import Settings
    from operations.stages.venvs import PIP_CACHE, VENVS_DIR, WHEEL_DIR

    gib = 2**20  # KiB
    lock = types.SimpleNamespace(pins=(Pin("torch", "2.9.1", ("sha256:" + "e" * 64,), "t"),))
    settings = Settings(model="org/m", wheel_cache=str(tmp_path / "cache"))
    room = {"serving_kib": 0, "free_kib": 20 * gib, "mount": "/opt",
            "folders": {f: {"free_kib": 20 * gib, "mount": "/opt"} for f in
                        (VENVS_DIR, WHEEL_DIR, PIP_CACHE)}}
    model = {"need": 12 * 2**30, "free": 20 * 2**30, "mount": "/opt", "folder": "/opt"}

    def fact(cls, **kwargs):
        return {"VenvRoom": room, "ModelSnapshot": {}, "ModelRoom": model,
                "LockSizes": {"torch": {"file": "t.whl", "download": 2 * 2**30,
                                        "installed": 4 * 2**30}}}[cls.__name__]

    # alone: the model 12 + 1 GiB of 20, the venv 4 + 2 + 2 + 1 GiB of 20; together 21 GiB
    assert model_room_problem(fact, settings) is None
    problem = locked_wheels.room_problem(fact, settings, lock, "/opt/gpuhost/venvs/ab")
    assert problem == (
        "no room for the new venv /opt/gpuhost/venvs/ab and the lock's downloads: "
        f"{VENVS_DIR}, {WHEEL_DIR}, {PIP_CACHE} on the file system mounted on /opt (df): "
        f"21.0 GiB needed ({VENVS_DIR} 4.0 GiB, {WHEEL_DIR} 2.0 GiB, {PIP_CACHE} 2.0 GiB, the "
        "model's download into /opt/gpuhost/models/org/m 12.0 GiB, 1 GiB kept free), 20.0 GiB "
        "free (the lock's file sizes from the controller's wheel cache and the package index, "
        "the model's from the Hub's file listing): make room there, or mount a larger file "
        "system")
    model["mount"] = "/srv"  # the model elsewhere: the venv alone on /opt
    assert locked_wheels.room_problem(fact, settings, lock, "/v") is None
    model["mount"] = "/opt"
    room.update(serving_kib=8 * gib)  # beside a serving venv of 8 GiB: 8 + 12 + 1 of 20
    assert "(the serving venv's 8.0 GiB, the model's download into /opt/gpuhost/models/org/m " \
           "12.0 GiB and 1 GiB kept free)" in locked_wheels.room_problem(fact, settings, lock,
                                                                         "/v")
    model["need"] = 10 * 2**30
    assert locked_wheels.room_problem(fact, settings, lock, "/v") is None


def test_names_without_a_size_are_said_by_their_error_in_one_short_line(tmp_path, monkeypatch):
    """An unreachable index gives every name of the lock the same error: said once, with the
    first five names and how many more, not the lock's 174 names each with its error."""
    from operations.plans.lock import Pin
    from operations.stages.venvs import PIP_CACHE, VENVS_DIR, WHEEL_DIR

    pins = tuple(Pin(f"n{i}", "1.0", ("sha256:" + f"{i:064x}",), f"n{i}") for i in range(8))
    settings = types.SimpleNamespace(venv_path="/v", pip_index_url="http://i/s",
                                     wheel_cache=str(tmp_path), model_is_local=True)
    folders = {f: {"free_kib": 50 * 2**20, "mount": "/"} for f in (VENVS_DIR, WHEEL_DIR,
                                                                    PIP_CACHE)}
    down = "the index did not answer: timed out"

    def fact(cls, **kwargs):
        if cls.__name__ == "VenvRoom":
            return {"serving_kib": 0, "free_kib": 50 * 2**20, "mount": "/", "folders": folders}
        return {**{f"n{i}": {"error": down} for i in range(7)},
                "n7": {"error": "HTTPError: HTTP Error 404: Not Found"}}

    said: list[str] = []
    monkeypatch.setattr(locked_wheels.logger, "warning", said.append)
    assert locked_wheels.room_problem(fact, settings, types.SimpleNamespace(pins=pins), "/v/a") \
        is None
    assert said == [f"{locked_wheels.host.print_prefix}ML venv: the room check counts nothing "
                    f"for n0, n1, n2, n3, n4 and 2 more ({down}); n7 (HTTPError: HTTP Error 404: "
                    "Not Found): no size found"]
