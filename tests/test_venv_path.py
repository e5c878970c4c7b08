"""Where the ML venv may go: host data that puts it on, in or around what gpuhost manages or a
system folder (operations/plans/settings.py), and what is at the path on the host (the VenvRuns fact
run here on real folders, files and symlinks; operations/venv_path.venv_path_problem; the ML
venv stage's refusal while planning)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from operations.facts.venv_facts import VenvAt, VenvRuns
from operations.facts.venv_path import venv_path_problem
from operations.plans.settings import GPUHOST_DIRS, SettingsError, from_host_data
from operations.stages import mlenv
from operations.stages.venvs import link_problem

ROOT = Path(__file__).resolve().parents[1]
LOCK = "locks/cuda12.8.txt"


def settings(**data):
    return from_host_data("gpu1", {"gpuhost_lock": LOCK, **data})


# --- host data -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "data", "said"), [
    ("/opt/gpuhost", {}, "it contains /opt/gpuhost/lib, gpuhost's shipped scripts"),
    ("/opt/gpuhost/models", {}, "it is /opt/gpuhost/models, the model weights' folder, "
                                "gpuhost_model_dir"),
    ("/data/models/venv", {"gpuhost_model_dir": "/data/models"},
     "it lies inside /data/models, the model weights' folder"),
    ("/data/ml", {"gpuhost_model_dir": "/data/ml/models"}, "it contains /data/ml/models"),
    ("/var/cache/gpuhost/kernels", {}, "it lies inside /var/cache/gpuhost, the server's kernel"),
    ("/var/lib/gpuhost", {}, "it is /var/lib/gpuhost, gpuhost's records"),
    ("/opt/gpuhost/build", {}, "it is /opt/gpuhost/build, flash-attn's build folder"),
    ("/opt/gpuhost/wheels/x", {}, "it lies inside /opt/gpuhost/wheels"),
    ("/opt/gpuhost/lock", {}, "it is /opt/gpuhost/lock"),
    ("/srv/weights", {"gpuhost_model": "/srv/weights/glm"},
     "it contains /srv/weights/glm, the served model's folder, gpuhost_model"),
    ("/root/secrets", {"gpuhost_hf_token_file": "/root/secrets/hf_token"},
     "it contains /root/secrets/hf_token, the file gpuhost_hf_token_file names"),
])
def test_a_venv_on_in_or_around_what_gpuhost_manages_is_refused(value, data, said):
    with pytest.raises(SettingsError) as err:
        settings(gpuhost_venv_path=value, **data)
    message = str(err.value)
    assert f"gpuhost_venv_path = {value!r} is not allowed: a folder of the venv's own" in message
    assert said in message and "the default is /opt/gpuhost/venv" in message


@pytest.mark.parametrize("value", ["/home/x", "/var/lib", "/var/cache", "/var/log", "/var/tmp",
                                   "/var/run/venv", "/srv/a:b", "/opt", "/root", "/"])
def test_a_system_or_shared_folder_is_no_venv_path(value):
    with pytest.raises(SettingsError) as err:
        settings(gpuhost_venv_path=value)
    assert f"gpuhost_venv_path = {value!r} is not allowed: " in str(err.value)
    assert "a folder of the venv's own" in str(err.value)


def test_every_problem_is_listed():
    with pytest.raises(SettingsError) as err:
        settings(gpuhost_venv_path="/opt/gpuhost", gpuhost_server_port=0)
    keys = [p.split(" = ")[0] for p in err.value.problems]
    assert keys == ["host gpu1: gpuhost_server_port"]  # value checks first, then together
    with pytest.raises(SettingsError) as err:
        settings(gpuhost_venv_path="/opt/gpuhost", gpuhost_tensor_parallel_size=3)
    assert len(err.value.problems) == 2


@pytest.mark.parametrize("value", ["/opt/gpuhost/venv", "/opt/gpuhost/venv-2", "/home/x/venv",
                                   "/srv/ml/venv", "/root/venv", "/var/lib/ml-venv"])
def test_a_dedicated_folder_is_allowed(value):
    assert settings(gpuhost_venv_path=value).venv_path == value


def test_every_gpuhost_folder_in_operations_is_known():
    """A path gpuhost writes under /opt/gpuhost, /var/lib/gpuhost, /etc/gpuhost,
    /var/cache/gpuhost or /run/gpuhost lies in one of settings.GPUHOST_DIRS (or is the venv's
    or the model dir's default, which are settings of their own)."""
    found = set()
    for path in [*ROOT.glob("operations/*/*.py"), *ROOT.glob("operations/files/*.py")]:
        for match in re.finditer(r"[\"'](/(?:opt|var/lib|etc|var/cache|run)/gpuhost[^\"'\s]*)",
                                 path.read_text()):
            found.add(match.group(1))
    assert "/opt/gpuhost/lib" in found and "/var/cache/gpuhost/kernels" in found
    # /opt/gpuhost: the folder above them, made 0755 first (operations/stages/folders.py)
    unknown = {p for p in found - {"/opt/gpuhost/venv", "/opt/gpuhost/models", "/opt/gpuhost"}
               if not any(p == d or p.startswith(d + "/") for d in GPUHOST_DIRS)}
    assert unknown == set()


# --- what is at the path -------------------------------------------------------------------------

def _health(path: Path) -> dict:
    fact = VenvRuns()
    out = subprocess.run(["sh", "-c", fact.command(str(path))], capture_output=True, text=True,
                         check=True)
    return fact.process(out.stdout.splitlines())


def _problem(path: Path) -> str | None:
    return venv_path_problem(str(path), _health(path))


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path


def test_a_folder_of_user_files_without_pyvenv_cfg_is_refused(tmp_path):
    folder = tmp_path / "notvenv"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "x").write_text("x")
    (folder / "important.txt").write_text("keep me")
    health = _health(folder)
    assert (health["found"], health["entries"], health["is_venv"]) == (
        "folder", ["important.txt", "sub"], False)
    problem = _problem(folder)
    assert problem.startswith(f"gpuhost_venv_path = '{folder}' is not allowed: it is a folder "
                              "that is not empty and has no pyvenv.cfg")
    assert "(it holds important.txt, sub)" in problem
    assert "allowed: a missing or empty folder, or a venv" in problem


def test_a_folder_with_a_python_but_no_pyvenv_cfg_is_refused_though_it_runs(tmp_path):
    (tmp_path / "py" / "bin").mkdir(parents=True)
    (tmp_path / "py" / "bin" / "python").symlink_to(sys.executable)
    assert "has no pyvenv.cfg" in _problem(tmp_path / "py")


def test_many_entries_are_counted_and_some_named(tmp_path):
    for n in range(60):
        (tmp_path / f"f{n:02d}").write_text("")
    health = _health(tmp_path)
    assert health["entry_count"] == 60 and len(health["entries"]) == 50
    assert "f00, f01, f02, f03, f04, f05, f06, f07 and 52 more" in _problem(tmp_path)


def test_a_missing_or_empty_folder_is_made_into_a_venv(tmp_path):
    (tmp_path / "empty").mkdir()
    assert _problem(tmp_path / "empty") is None
    assert _health(tmp_path / "a" / "b")["above"] == str(tmp_path)
    assert _problem(tmp_path / "a" / "b") is None


def test_a_file_a_dangling_symlink_or_a_file_above_is_refused(tmp_path):
    (tmp_path / "afile").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert _problem(tmp_path / "afile") == (
        f"gpuhost_venv_path = '{tmp_path}/afile' is not allowed: it is a file; allowed: a "
        "missing or empty folder, or a venv (with its pyvenv.cfg)")
    assert _problem(tmp_path / "dangling") == (
        f"gpuhost_venv_path = '{tmp_path}/dangling' is not allowed: it is a symlink to "
        f"{tmp_path}/nowhere, which does not exist; allowed: a missing or empty folder, or a "
        "venv (with its pyvenv.cfg)")
    assert _problem(tmp_path / "afile" / "venv").startswith(
        f"gpuhost_venv_path = '{tmp_path}/afile/venv' is not allowed: {tmp_path}/afile, above "
        "it, is a file, not a folder")


def test_a_symlink_to_a_folder_is_refused_unless_its_venv_runs(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert "python3 -m venv makes no venv through a symlink" in _problem(tmp_path / "link")
    health = {**_health(tmp_path / "link"), "state": "ok", "is_venv": True,
              "entries": ["bin", "lib", "pyvenv.cfg"], "entry_count": 3}
    assert venv_path_problem(str(tmp_path / "link"), health) is None


def test_a_venv_to_clear_is_cleared_only_when_it_holds_only_what_a_venv_has(tmp_path):
    path = _venv(tmp_path / "venv")
    (path / "bin" / "python").unlink()
    (path / "bin" / "python").write_bytes(b"")
    (path / "bin" / "python").chmod(0o755)
    (path / "gpuhost-flash-attn.json").write_text("{}")
    (path / "share").mkdir()
    assert _health(path)["state"] == "broken"
    assert _problem(path) is None
    (path / "precious.txt").write_text("keep me")
    (path / "notes").mkdir()
    problem = _problem(path)
    assert problem.startswith(f"gpuhost_venv_path = '{path}' is not allowed: the venv there "
                              "does not run (bin/python printed nothing (exit 0)) and would be "
                              "cleared")
    assert "it holds what a venv does not: notes, precious.txt;" in problem


def test_a_pyvenv_cfg_beside_user_files_is_not_cleared(tmp_path):
    (tmp_path / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (tmp_path / "precious.txt").write_text("keep me")
    assert _health(tmp_path)["why"] == "it has no bin/python"
    assert "it holds what a venv does not: precious.txt;" in _problem(tmp_path)


def test_a_venv_that_runs_is_kept_whatever_else_it_holds(tmp_path):
    health = {**_health(_venv(tmp_path / "v")), "state": "ok"}
    health["entries"] = [*health["entries"], "notes.txt"]
    assert venv_path_problem(str(tmp_path / "v"), health) is None


# --- the stage's planning ------------------------------------------------------------------------

def test_the_stage_refuses_and_plans_nothing_for_a_path_it_may_not_use(tmp_path, monkeypatch):
    (tmp_path / "important.txt").write_text("keep me")
    health = _health(tmp_path)
    refused, planned = [], []

    class Resources:
        cores, mem_available_gib = 2, 22.5

    def fact(cls, **kwargs):
        if cls in (VenvRuns, VenvAt):  # no lock venv yet; the link's path holds files
            return health if kwargs["venv"] == str(tmp_path) else _health(tmp_path / "none")
        if cls.__name__ == "HostResources":
            return Resources()
        if cls.__name__ == "FileText" and kwargs["path"] in (mlenv.SERVER_UNIT_PATH,
                                                             mlenv.LAST_GOOD_RECORD):
            return None  # no unit, no record: which of the lock's folders is read first
        raise AssertionError(f"read after the refusal: {cls.__name__}")

    monkeypatch.setattr(mlenv, "fact", fact)
    monkeypatch.setattr(mlenv, "refuse", lambda stage, why: refused.append((stage, why)))
    monkeypatch.setattr(mlenv, "venv_that_runs", lambda **kw: planned.append(kw))
    monkeypatch.setattr(mlenv.apt, "packages", lambda **kw: planned.append(kw))
    s = settings(gpuhost_venv_path=str(tmp_path))
    assert mlenv.mlenv._inner(s) == []
    assert planned == []
    ((stage, why),) = refused
    assert stage == "ML venv" and why == link_problem(str(tmp_path), health)
    assert "gpuhost replaces it with a link to the serving venv" in why
    assert (tmp_path / "important.txt").read_text() == "keep me"


def _plan_stage(monkeypatch, packages: dict, states: dict) -> tuple[list, list, list]:
    """Plan the ML venv stage (no host) where the unit and the record name the lock's first
    folder: ``packages`` what each folder holds (VenvPackages), ``states`` each folder's
    VenvRuns state; returns (venvs made, venvs installed into, refusals)."""
    from operations.plans.lock import read_lock
    from operations.stages.venvs import slots, stack_venv

    s = settings()
    first, second = slots(stack_venv(s.lock_path))
    made, filled, refused = [], [], []

    class Resources:
        cores, mem_available_gib = 2, 22.5

    def health(state):
        return {"found": "folder" if state != "absent" else "missing", "target": "",
                "target_found": "", "above": "/opt/gpuhost/venvs", "above_found": "folder",
                "entries": ["bin", "lib", "pyvenv.cfg"], "entry_count": 3, "is_venv": True,
                "state": state, "why": "pip exited 1" if state == "broken" else ""}

    def fact(cls, **kwargs):
        name = cls.__name__
        if name == "VenvRuns":  # the link at gpuhost_venv_path: the first folder's
            return health(states.get(kwargs["venv"], states[first]))
        if name == "VenvAt":
            return {**health("unchecked"), "found": "link", "target": first}
        if name == "HostResources":
            return Resources()
        if name == "FileText":
            if kwargs["path"] == mlenv.SERVER_UNIT_PATH:
                return f"ExecStart={first}/bin/python -m sglang.launch_server\n"
            if kwargs["path"] == mlenv.LAST_GOOD_RECORD:
                return '{"server": {"venv": "%s", "venvs": ["%s"]}}' % (first, first)
            return None
        if name == "VenvPackages":
            return dict(packages.get(kwargs["venv"], {}))
        if name == "VenvRoom":
            return {"serving_kib": 1024, "free_kib": 50 * 2**20, "mount": "/"}
        if name in ("VenvTorchCuda", "VenvPython"):
            return None
        if name == "ModelSnapshot":  # the room check's: the model's download to come
            return {}
        if name == "ModelRoom":
            return {"error": "not read here"}
        if name == "NvidiaDriver":
            raise AssertionError("no CUDA to compare")
        raise AssertionError(f"unexpected fact {name}")

    class Op:
        def did_change(self):
            return True

    monkeypatch.setattr(mlenv, "fact", fact)
    monkeypatch.setattr(mlenv, "refuse", lambda stage, why: refused.append(why))
    monkeypatch.setattr(mlenv, "check_driver_for_venv", lambda *a: None)
    monkeypatch.setattr(mlenv, "top_folders", lambda: None)
    monkeypatch.setattr(mlenv.apt, "packages", lambda **kw: None)
    monkeypatch.setattr(mlenv.files, "directory", lambda **kw: None)
    monkeypatch.setattr(mlenv.files, "put", lambda **kw: None)
    monkeypatch.setattr(mlenv, "venv_that_runs", lambda **kw: made.append(
        (kw["path"], kw.get("clear", False))))
    monkeypatch.setattr(mlenv, "locked_packages", lambda **kw: filled.append(
        (kw["venv"], kw["recreated"])) or Op())
    monkeypatch.setattr(mlenv, "built_wheel", lambda **kw: filled.append(
        (kw["plan"].venv, "flash-attn")) or Op())
    monkeypatch.setattr(mlenv, "venv_checked", lambda **kw: None)
    monkeypatch.setattr(mlenv, "read_stamp", lambda text: None)
    mlenv.mlenv._inner(s)
    assert read_lock(s.lock_path)  # the lock the stage read
    return made, filled, refused


def test_a_serving_venv_changed_by_hand_is_never_installed_into(monkeypatch):
    """Issue 30: sglang changed by hand in the venv the server runs from: the stage builds the
    lock's other folder beside it (the unit then names it), and plans nothing into the serving
    one."""
    from operations.plans.lock import read_lock
    from operations.stages.venvs import slots, stack_venv

    s = settings()
    first, second = slots(stack_venv(s.lock_path))
    locked = read_lock(s.lock_path).versions()
    drifted = {**locked, "sglang": "0.0.1", "pip": "25.0"}
    made, filled, refused = _plan_stage(monkeypatch, {first: drifted},
                                        {first: "ok", second: "absent"})
    assert refused == []
    assert made == [(second, False)]
    assert {venv for venv, _ in filled} == {second}
    # as it was locked, nothing is replaced and the serving venv is the one converged
    made, filled, refused = _plan_stage(monkeypatch, {first: {**locked, "pip": "25.0"}},
                                        {first: "ok", second: "absent"})
    assert made == [(first, False)] and {venv for venv, _ in filled} == {first}


def test_a_half_installed_venv_that_serves_nothing_is_cleared_and_built_again(monkeypatch):
    """A run cut off in pip left the replacement half-installed (pip's temporary files in
    it): the next run clears it and installs from empty, never repairs it."""
    from operations.plans.lock import read_lock
    from operations.stages.venvs import slots, stack_venv

    s = settings()
    first, second = slots(stack_venv(s.lock_path))
    locked = read_lock(s.lock_path).versions()
    half = dict(list(locked.items())[:3], pip="25.0")
    made, filled, refused = _plan_stage(monkeypatch, {first: {}, second: half},
                                        {first: "absent", second: "ok"})
    assert refused == []
    assert made == [(second, True)]
    assert (second, True) in filled
