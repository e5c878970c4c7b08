"""The venvs side by side: a lock's digest names its venv, and what may stand at
gpuhost_venv_path where the link to the serving venv goes (operations/stages/venvs.py)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from operations.plans.lock import read_lock
from operations.stages.venvs import VENVS_DIR, link_problem, lock_digest, stack_venv

ROOT = Path(__file__).resolve().parents[1]
PIN = ("sglang==0.5.9 --hash=sha256:" + "a" * 64 + "\n"
       "torch==2.9.1 --hash=sha256:" + "b" * 64 + "\n")


def _lock(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_venv_is_named_by_the_pins_not_the_comments(tmp_path):
    one = _lock(tmp_path, "one.txt", "# made on monday\n" + PIN)
    two = _lock(tmp_path, "two.txt", "# made again on tuesday\n" + PIN.replace("\n", "  # x\n"))
    assert lock_digest(read_lock(one)) == lock_digest(read_lock(two))
    assert stack_venv(one) == f"{VENVS_DIR}/{lock_digest(read_lock(one))}"
    assert len(stack_venv(one).rsplit("/", 1)[1]) == 16


def test_a_changed_pin_or_hash_is_another_venv(tmp_path):
    base = lock_digest(read_lock(_lock(tmp_path, "a.txt", PIN)))
    newer = PIN.replace("sglang==0.5.9", "sglang==0.5.10")
    rehashed = PIN.replace("b" * 64, "c" * 64)
    assert lock_digest(read_lock(_lock(tmp_path, "b.txt", newer))) != base
    assert lock_digest(read_lock(_lock(tmp_path, "c.txt", rehashed))) != base


def test_the_default_lock_has_its_venv_under_the_venvs_folder():
    assert stack_venv(ROOT / "locks/cuda12.8.txt").startswith("/opt/gpuhost/venvs/")


def _health(**fields):
    base = {"found": "folder", "target": "", "target_found": "", "above": "",
            "above_found": "", "entries": [], "entry_count": 0, "is_venv": False,
            "state": "absent", "why": ""}
    return {**base, **fields}


def test_an_earlier_gpuhost_venv_a_link_or_nothing_may_become_the_link():
    venv = ["bin", "include", "lib", "lib64", "pyvenv.cfg", "gpuhost-flash-attn.json"]
    assert link_problem("/opt/gpuhost/venv", _health(
        entries=venv, entry_count=len(venv), is_venv=True, state="ok")) is None
    assert link_problem("/opt/gpuhost/venv", _health(found="link", target="/x",
                                                     target_found="missing")) is None
    assert link_problem("/opt/gpuhost/venv", _health(found="missing", above="/opt",
                                                     above_found="folder")) is None
    assert link_problem("/opt/gpuhost/venv", _health()) is None  # an empty folder


def test_what_is_not_a_venv_is_never_replaced_by_the_link():
    user = link_problem("/srv/venv", _health(entries=["data.csv"], entry_count=1))
    assert user.startswith("gpuhost_venv_path = '/srv/venv' is not allowed: it is a folder "
                           "holding what a venv does not (data.csv)")
    extra = link_problem("/srv/venv", _health(
        entries=["bin", "lib", "notes.txt", "pyvenv.cfg"], entry_count=4, is_venv=True,
        state="ok"))
    assert "(notes.txt)" in extra
    unlisted = link_problem("/srv/venv", _health(entries=["bin"], entry_count=90, is_venv=True))
    assert "89 entries not listed" in unlisted
    assert "it is a file" in link_problem("/srv/venv", _health(found="file"))


def test_a_new_venv_needs_room_for_one_more_the_serving_ones_size():
    from operations.stages.venvs import room_problem

    gib = 2**20
    assert room_problem({"serving_kib": 9 * gib, "free_kib": 10 * gib, "mount": "/"},
                        "/v/new") is None
    problem = room_problem({"serving_kib": 9 * gib, "free_kib": 9 * gib, "mount": "/opt"},
                           "/opt/gpuhost/venvs/ab")
    assert problem.startswith("no room for the new venv /opt/gpuhost/venvs/ab beside the "
                              "serving one: it needs about 10.0 GiB (the serving venv's 9.0 "
                              "GiB and 1 GiB kept free), and 9.0 GiB are free on /opt (df)")


def test_a_fresh_venv_needs_room_for_the_locks_files_on_each_file_system():
    """No serving venv (a fresh host): the lock's files' sizes (LockSizes) against each
    folder's file system, summed where folders share one, with the headroom on each."""
    from operations.stages.venvs import PIP_CACHE, VENVS_DIR, WHEEL_DIR, room_problem

    mib = 1024
    sizes = {"torch": {"file": "t.whl", "download": 300 * 2**20, "installed": 900 * 2**20},
             "odd": {"error": "HTTPError: HTTP Error 404: Not Found"}}

    def room(opt_free: int, root_free: int) -> dict:
        folders = {VENVS_DIR: {"free_kib": opt_free, "mount": "/opt"},
                   WHEEL_DIR: {"free_kib": opt_free, "mount": "/opt"},
                   PIP_CACHE: {"free_kib": root_free, "mount": "/"}}
        return {"serving_kib": 0, **folders[VENVS_DIR], "folders": folders}

    big = 100 * 1024 * mib
    assert room_problem(room(big, big), "/opt/gpuhost/venvs/ab", sizes) is None
    # /opt: 900 + 300 MiB and 1 GiB kept free = 2224 MiB; 2200 MiB is short of it
    problem = room_problem(room(2200 * mib, big), "/opt/gpuhost/venvs/ab", sizes)
    assert problem == (
        "no room for the new venv /opt/gpuhost/venvs/ab and the lock's downloads: "
        f"{VENVS_DIR}, {WHEEL_DIR} on the file system mounted on /opt (df): 2.2 GiB needed "
        f"({VENVS_DIR} 900.0 MiB, {WHEEL_DIR} 300.0 MiB, 1 GiB kept free), 2.1 GiB free "
        "(the lock's file sizes from the controller's wheel cache and the package index): make "
        "room there, or mount a larger file system")
    assert room_problem(room(2224 * mib, big), "/v/ab", sizes) is None
    both = room_problem(room(64 * mib, 512 * mib), "/v/ab", sizes)
    assert f"; {PIP_CACHE} on the file system mounted on / (df): 1.3 GiB needed" in both
    assert "64.0 MiB free" in both and "512.0 MiB free" in both


@pytest.mark.parametrize("ranges", [False, True], ids=["whole-file", "byte-ranges"])
def test_the_locks_file_sizes_are_read_off_an_index(tmp_path, ranges):
    """wheel_sizes.py against a PEP 503 index served by http.server (which ignores Range, so
    the whole file is read) or by the sandbox's server (which answers one range, so only the
    zip directory is read): the download is the file's size, the install its members'
    uncompressed sizes with each .py's again for its .pyc; a file whose sha256 the lock does
    not name is not counted."""
    import hashlib
    import http.server
    import subprocess
    import threading
    import zipfile
    from functools import partial

    from operations.stages.venvs import LockSizes

    project = tmp_path / "simple" / "demo-pkg"
    project.mkdir(parents=True)
    wheel = project / "demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("demo_pkg/__init__.py", "x = 1\n" * 1000)
        z.writestr("demo_pkg/data.bin", b"\0" * 5000)
    other = project / "demo_pkg-1.0-py2-none-any.whl"
    other.write_bytes(b"\0" * 99999)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (project / "index.html").write_text(
        f'<a href="{wheel.name}#sha256={digest}">{wheel.name}</a>'
        f'<a href="{other.name}#sha256={"0" * 64}">{other.name}</a>')
    from sandbox import httpd

    class Ranged(httpd.Handler):
        counter = httpd.Counter()  # its own: the class's is shared by every test here

    handler = partial(Ranged if ranges else http.server.SimpleHTTPRequestHandler,
                      directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        command = LockSizes().command(f"http://127.0.0.1:{server.server_port}/simple",
                                      (f"demo-pkg==1.0:{digest[:16]}",
                                       f"absent==2.0:{'1' * 16}"))
        out = subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                             check=True).stdout.splitlines()
        if ranges:  # the zip's end and directory only, not the whole file
            with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}"
                                        "/_sandbox/bytes-served") as r:
                sent = json.loads(r.read())["127.0.0.1"]["files"]
            assert 0 < sent[f"/simple/demo-pkg/{wheel.name}"] < wheel.stat().st_size
    finally:
        server.shutdown()
    sizes = LockSizes().process(out)
    assert sizes["demo-pkg"] == {"file": wheel.name, "download": wheel.stat().st_size,
                                 "installed": 6000 * 2 + 5000}
    assert sizes["absent"] == {"error": "HTTPError: HTTP Error 404: File not found"}


def test_an_index_url_with_credentials_is_read_as_pip_reads_it(tmp_path):
    """An index behind HTTP Basic authentication, named with its credentials in the URL as pip
    takes them (gpuhost_pip_index_url): wheel_sizes.py sends them as pip does, to that host
    alone, and neither a size nor an error it prints holds the password (urllib alone took
    ``user:pass@host`` for a host name and quoted it: "nonnumeric port: 'pass@host'")."""
    import base64
    import hashlib
    import http.server
    import subprocess
    import threading
    import zipfile
    from functools import partial

    from operations.stages.venvs import LockSizes

    secret = "s3cr3t-Index-Token"
    project = tmp_path / "simple" / "demo-pkg"
    project.mkdir(parents=True)
    wheel = project / "demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo_pkg/data.bin", b"\0" * 5000)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (project / "index.html").write_text(f'<a href="{wheel.name}#sha256={digest}">x</a>')
    wanted = "Basic " + base64.b64encode(f"ops:{secret}".encode()).decode()

    class Private(http.server.SimpleHTTPRequestHandler):
        def send_head(self):
            if self.headers.get("Authorization") != wanted:
                self.send_error(401)
                return None
            return super().send_head()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), partial(Private, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pins = (f"demo-pkg==1.0:{digest[:16]}",)
    try:
        runs = {how: subprocess.run(
            ["sh", "-c", LockSizes().command(f"http://ops:{word}@127.0.0.1:{server.server_port}"
                                             "/simple", pins)],
            capture_output=True, text=True, timeout=60) for how, word in (
                ("right", secret), ("wrong", secret[::-1]))}
    finally:
        server.shutdown()
    # no port: urllib took "ops:<password>@index.invalid" for host and port
    runs["no port"] = subprocess.run(
        ["sh", "-c", LockSizes().command(f"https://ops:{secret}@index.invalid/simple", pins)],
        capture_output=True, text=True, timeout=60)
    assert LockSizes().process(runs["right"].stdout.splitlines())["demo-pkg"] == {
        "file": wheel.name, "download": wheel.stat().st_size, "installed": 5000}
    assert LockSizes().process(runs["wrong"].stdout.splitlines())["demo-pkg"] == {
        "error": "HTTPError: HTTP Error 401: Unauthorized"}
    assert "error" in LockSizes().process(runs["no port"].stdout.splitlines())["demo-pkg"]
    for run in runs.values():
        assert secret not in run.stdout + run.stderr and secret[::-1] not in run.stdout


def test_an_index_that_does_not_answer_is_asked_once_per_worker_not_once_per_name():
    """An index behind a firewall that drops the packets (here: a socket that listens and
    never answers): once a name's reading found it unreachable, the names not asked yet are not
    asked, each said with that reason; before, each of a lock's 174 names waited TIMEOUT (60 s),
    8 at a time. The count of connections made tells it, not a clock (the module run in a
    python of its own with a TIMEOUT of 0.5 s; the connections wait in the listen backlog)."""
    import socket
    import subprocess
    import sys

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    pins = [f"name{i}==1.0:{'a' * 16}" for i in range(40)]
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import wheel_sizes as w; "
              "w.TIMEOUT = 0.5; sys.exit(w.main(sys.argv[1:]))")
    try:
        run = subprocess.run(
            [sys.executable, "-c", script, str(ROOT / "operations" / "files"),
             f"http://127.0.0.1:{listener.getsockname()[1]}/simple", *pins],
            capture_output=True, text=True, timeout=120)
        listener.setblocking(False)
        made = 0
        while True:
            try:
                listener.accept()[0].close()
            except BlockingIOError:
                break
            made += 1
    finally:
        listener.close()
    sizes = json.loads(run.stdout)
    assert made <= 8, made  # the pool's first round only
    assert len(sizes) == 40 and {s["error"] for s in sizes.values()} == {
        "the index did not answer: timed out"}


def test_the_room_is_read_off_the_host(tmp_path):
    import subprocess

    from operations.stages.venvs import VenvRoom

    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "lib" / "big").write_bytes(b"\0" * 2**20)
    link = tmp_path / "link"
    link.symlink_to(venv)
    out = subprocess.run(["sh", "-c", VenvRoom().command(str(link))], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    room = VenvRoom().process(out)
    assert room["serving_kib"] >= 1024 and room["free_kib"] > 0 and room["mount"].startswith("/")
    folders = (str(tmp_path / "no" / "such"), "/")
    out = subprocess.run(["sh", "-c", VenvRoom().command(str(link), folders)],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    room = VenvRoom().process(out)
    assert list(room["folders"]) == list(folders)
    assert room["folders"]["/"]["mount"] == "/" and room["folders"]["/"]["free_kib"] > 0


def test_the_upgrade_keys_are_checked_before_any_host_is_touched():
    import pytest

    from operations.plans.settings import SettingsError, from_host_data

    data = {"gpuhost_lock": str(ROOT / "locks/cuda12.8.txt")}
    assert from_host_data("gpu1", data).venvs_kept == 1
    assert from_host_data("gpu1", data).rollback is False
    with pytest.raises(SettingsError) as err:
        from_host_data("gpu1", {**data, "gpuhost_venvs_kept": 0, "gpuhost_rollback": "yes"})
    assert "gpuhost_venvs_kept = 0 is not allowed: an integer from 1 to 16" in str(err.value)
    assert "gpuhost_rollback = 'yes' is not allowed: True or False" in str(err.value)


def test_the_distributions_a_new_venv_changes_are_named_from_what_to_what():
    from operations.stages.venvs import stack_changes

    serving = {"torch": "2.9.1+cu128", "sglang": "0.5.9", "old-dep": "1.0", "pip": "24.0"}
    locked = {"torch": "2.9.1", "sglang": "0.5.10", "new-dep": "2.0"}
    assert stack_changes(serving, locked) == [
        "new-dep missing -> 2.0", "old-dep 1.0 -> removed", "sglang 0.5.9 -> 0.5.10"]
    assert stack_changes({"torch": "2.9.1+cu128"}, {"torch": "2.9.1+cu130"}) == [
        "torch 2.9.1+cu128 -> 2.9.1+cu130"]
    assert stack_changes(serving, {"torch": "2.9.1", "sglang": "0.5.9", "old-dep": "1.0"}) == []


def _check(tmp_path, gpus_seen: int, gpu_count: int, missing: str = ""):
    import os
    import subprocess
    import sys

    from operations.stages.venvs import venv_checked

    venv, mods = tmp_path / "venv", tmp_path / "mods"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (mods / "torch" / "cuda").mkdir(parents=True)
    (mods / "torch" / "__init__.py").write_text("from torch import cuda\n")
    (mods / "torch" / "cuda" / "__init__.py").write_text(
        f"def device_count():\n    return {gpus_seen}\n")
    for name in ("sglang", "flashinfer", "flash_attn"):
        if name != missing:
            (mods / f"{name}.py").write_text("")
    (command,) = list(venv_checked._inner(venv=str(venv), gpu_count=gpu_count, flash_attn=True))
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(mods)})


def test_a_new_venv_is_checked_before_the_server_is_pointed_at_it(tmp_path):
    ok = _check(tmp_path, 8, 8)
    assert ok.returncode == 0 and ok.stdout.strip() == "venv ok: imports, 8 GPUs"


def test_a_venv_whose_torch_sees_other_gpus_or_misses_a_module_fails(tmp_path):
    few = _check(tmp_path / "a", 7, 8)
    assert few.returncode == 1
    assert f"torch sees 7 GPUs, host data says 8 (gpuhost_gpu_count)" in few.stderr
    broken = _check(tmp_path / "b", 8, 8, missing="flash_attn")
    assert broken.returncode == 1
    assert "import flash_attn failed: ModuleNotFoundError" in broken.stderr


A = "/opt/gpuhost/venvs/0123456789abcdef"
B = A + "-b"


def test_a_serving_venv_that_does_not_run_gets_a_replacement_beside_it():
    from operations.stages.venvs import choose_venv
    choice = choose_venv(A, A, A, {A: "broken", B: "absent"})
    assert (choice.venv, choice.replaces, choice.problem) == (B, A, None)
    # the last known good alone is protected too (the unit names another lock's venv)
    assert choose_venv(A, "/opt/gpuhost/venvs/x", A, {A: "broken", B: "absent"}).venv == B


def test_a_venv_that_serves_nothing_is_cleared_in_place_and_a_running_one_kept():
    from operations.stages.venvs import choose_venv
    assert choose_venv(A, None, None, {A: "broken", B: "absent"}) == \
        choose_venv(A, None, None, {A: "absent", B: "absent"})
    assert choose_venv(A, None, None, {A: "broken", B: "absent"}).venv == A
    assert choose_venv(A, B, A, {A: "ok", B: "ok"}).venv == B  # the unit's, where it runs
    # the replacement serves and broke: the old folder is the last known good and runs
    assert choose_venv(A, B, None, {A: "ok", B: "broken"}).venv == A
    # a replacement that does not run and serves nothing is cleared and built again
    assert choose_venv(A, A, A, {A: "broken", B: "broken"}).venv == B


def test_both_folders_protected_and_broken_is_refused():
    from operations.stages.venvs import choose_venv
    choice = choose_venv(A, B, A, {A: "broken", B: "broken"})
    assert choice.problem and "both do not run" in choice.problem


def test_the_unit_and_the_record_name_their_venvs():
    from operations.stages.mlenv import SERVER_UNIT_PATH
    from operations.stages.server_unit import UNIT_PATH
    from operations.stages.venvs import digest_of_venv, recorded_venv, unit_venv
    assert SERVER_UNIT_PATH == UNIT_PATH
    assert unit_venv(f"[Service]\nExecStart={B}/bin/python -m sglang.launch_server\n") == B
    assert unit_venv("[Service]\n") is None and unit_venv(None) is None
    assert recorded_venv(json.dumps({"server": {"venv": A}})) == A
    for bad in ("{", "5", '{"server": 5}', None):
        assert recorded_venv(bad) is None
    assert digest_of_venv(B) == digest_of_venv(A) == "0123456789abcdef"


def test_an_empty_venvs_folder_is_no_venv_not_none():
    from operations.stages.venvs import VenvFolders
    assert VenvFolders().default() == []
    assert VenvFolders().process([f"{A}", f"{B}", "/opt/gpuhost/venvs/other"]) == [A, B]


def test_a_serving_venv_that_differs_from_its_lock_or_is_gone_gets_a_replacement():
    from operations.stages.venvs import choose_venv
    # changed by hand while it serves: never installed into, the other folder is built
    assert choose_venv(A, A, A, {A: "drifted", B: "absent"}) == \
        choose_venv(A, A, A, {A: "broken", B: "absent"})
    assert choose_venv(A, A, A, {A: "drifted", B: "absent"}).replaces == A
    # its files deleted under a server that still runs from them: not built again at its path
    assert choose_venv(A, A, A, {A: "absent", B: "absent"}).venv == B
    # the replacement, left half-installed by an earlier run, is the one built again
    assert choose_venv(A, A, A, {A: "absent", B: "ok"}).venv == B
    # a venv nothing names is built where it is
    assert choose_venv(A, None, None, {A: "ok", B: "absent"}).venv == A
    # the last known good that differs while another folder serves: not installed into
    choice = choose_venv(A, B, A, {A: "drifted", B: "broken"})
    assert choice.problem and "do not run and differ from the lock" in choice.problem




def test_kept_drift_names_every_difference_from_the_lock(tmp_path):
    from operations.stages.venvs import kept_drift
    lock = read_lock(_lock(tmp_path, "k.txt", PIN + "flash-attn==2.8.3 --hash=sha256:"
                           + "c" * 64 + "\n"))
    same = {"torch": "2.9.1+cu128", "sglang": "0.5.9", "flash-attn": "2.8.3", "pip": "25.0"}
    assert kept_drift(same, lock) == []
    assert kept_drift({**same, "sglang": "0.5.8", "foo": "1.0"}, lock) == [
        "sglang 0.5.8 -> 0.5.9 (lock)", "foo 1.0 not in the lock"]
    del same["flash-attn"]
    assert kept_drift(same, lock) == ["flash-attn missing -> 2.8.3 (lock)"]
