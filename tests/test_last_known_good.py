"""The last known good record on the host (operations/files/last_known_good.py): what is
recorded, what a rollback puts back, and the entries of other concerns it keeps."""

from __future__ import annotations

import importlib.util
import subprocess
import json
from argparse import Namespace
from pathlib import Path

import pytest

from operations.stages.last_known_good import record_command

SCRIPT = Path(__file__).resolve().parents[1] / "operations/files/last_known_good.py"


@pytest.fixture
def lkg(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("last_known_good_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root = tmp_path / "var-lib-gpuhost"
    monkeypatch.setattr(mod, "ROOT", str(root))
    monkeypatch.setattr(mod, "RECORD", str(root / "last-known-good.json"))
    monkeypatch.setattr(mod, "COPIES", str(root / "last-known-good"))
    monkeypatch.setattr(mod, "MARKER", str(root / "rollback.json"))
    reloads = []
    mod.import_error = None  # what the venv's python says where its stack does not import

    def run(argv, check, **kwargs):
        if argv[0] == "systemctl":
            reloads.append(argv)
            return subprocess.CompletedProcess(argv, 0, "", "")
        if mod.import_error:
            return subprocess.CompletedProcess(argv, 1, "", mod.import_error + "\n")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(mod.subprocess, "run", run)
    mod.reloads = reloads
    return mod


def _files(tmp_path):
    etc = tmp_path / "etc"
    (etc / "sglang.service.d").mkdir(parents=True)
    unit, env = etc / "sglang.service", etc / "server.env"
    unit.write_text("ExecStart=/opt/gpuhost/venvs/aaaa/bin/python\n")
    env.write_text("HF_TOKEN=s3cret\n")
    env.chmod(0o600)
    (etc / "sglang.service.d" / "10-gate.conf").write_text("[Unit]\n")
    return unit, env, etc / "gate.service", etc / "sglang.service.d"


def _record(lkg, unit, env, gate, dropins):
    venv = unit.parent.parent / "venvs" / "aaaa"  # the venv a rollback goes back to exists
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "python").touch()
    return lkg.record(Namespace(venv=str(venv), lock_digest="aaaa", model="m",
                                revision="main", folder=[str(dropins)], keep=1, venvs_dir=None,
                                paths=[str(unit), str(env), str(gate)]))


def test_a_failed_change_is_put_back_as_recorded(lkg, tmp_path, capsys):
    unit, env, gate, dropins = _files(tmp_path)
    assert _record(lkg, unit, env, gate, dropins) == 0
    copies = Path(lkg.COPIES)
    assert oct(copies.stat().st_mode & 0o777) == "0o700"
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in copies.iterdir())
    record = json.loads(Path(lkg.RECORD).read_text())
    assert record["server"]["venv"] == str(tmp_path / "venvs" / "aaaa")
    assert record["server"]["absent"] == [str(gate)]
    assert "s3cret" not in Path(lkg.RECORD).read_text()
    # it holds server.env's sha256: a guess at the secret checks against it, so root's alone
    assert oct(Path(lkg.RECORD).stat().st_mode & 0o777) == "0o600"

    unit.write_text("ExecStart=/opt/gpuhost/venvs/bbbb/bin/python\n")
    env.write_text("HF_TOKEN=s3cret\nSANDBOX_SGLANG_MODE=crash-on-start\n")
    gate.write_text("[Service]\n")
    (dropins / "20-new.conf").write_text("[Service]\n")
    assert lkg.restore(Namespace(why="the unit failed the health gate")) == 0
    assert unit.read_text() == "ExecStart=/opt/gpuhost/venvs/aaaa/bin/python\n"
    assert env.read_text() == "HF_TOKEN=s3cret\n" and oct(env.stat().st_mode & 0o777) == "0o600"
    assert not gate.exists() and not (dropins / "20-new.conf").exists()
    assert (dropins / "10-gate.conf").exists()
    assert lkg.reloads == [["systemctl", "daemon-reload"]]
    assert json.loads(Path(lkg.MARKER).read_text())["why"] == "the unit failed the health gate"
    assert lkg.finish(Namespace()) == 0 and not Path(lkg.MARKER).exists()
    out = capsys.readouterr().out
    assert "s3cret" not in out and f"restored {unit}" in out and f"removed {gate}" in out


def test_nothing_recorded_or_nothing_changed_is_no_rollback(lkg, tmp_path, capsys):
    unit, env, gate, dropins = _files(tmp_path)
    assert lkg.restore(Namespace(why="x")) == 4
    _record(lkg, unit, env, gate, dropins)
    assert lkg.restore(Namespace(why="x")) == 5
    assert not Path(lkg.MARKER).exists() and lkg.reloads == []
    assert "nothing to roll back" in capsys.readouterr().out


def test_another_concerns_entry_is_kept_and_old_copies_go(lkg, tmp_path):
    unit, env, gate, dropins = _files(tmp_path)
    Path(lkg.ROOT).mkdir(parents=True)
    Path(lkg.RECORD).write_text(json.dumps({"format": 1, "driver": {"version": "590.48.01"}}))
    _record(lkg, unit, env, gate, dropins)
    first = set(p.name for p in Path(lkg.COPIES).iterdir())
    unit.write_text("ExecStart=/opt/gpuhost/venvs/cccc/bin/python\n")
    _record(lkg, unit, env, gate, dropins)
    record = json.loads(Path(lkg.RECORD).read_text())
    assert record["driver"] == {"version": "590.48.01"}
    now = set(p.name for p in Path(lkg.COPIES).iterdir())
    assert len(now) == len(first) and now != first  # the old unit's copy removed


def test_the_record_command_quotes_what_it_is_given():
    command = record_command("/opt/gpuhost/venvs/ab", "ab", "org/model", "main",
                             ["/etc/a b"], ["/etc/x.d"], keep=2, venvs_dir="/opt/gpuhost/venvs")
    assert command == ("python3 /opt/gpuhost/lib/last_known_good.py record --venv "
                       "/opt/gpuhost/venvs/ab --lock-digest ab --model org/model --revision main "
                       "--keep 2 --venvs-dir /opt/gpuhost/venvs --folder /etc/x.d '/etc/a b'")


def test_venvs_beyond_the_ones_kept_are_removed_after_the_gate(lkg, tmp_path, capsys):
    venvs = tmp_path / "venvs"
    a, b, c = (venvs / (x * 16) for x in "abc")
    for v in (a, c, venvs / "not-a-digest"):  # c: a lock's venv that never passed the gate
        v.mkdir(parents=True)
    unit = tmp_path / "unit"
    unit.write_text("x")

    def record(venv, keep):
        lkg.record(Namespace(venv=str(venv), lock_digest=venv.name, model="m", revision="r",
                             folder=[], keep=keep, venvs_dir=str(venvs), paths=[str(unit)]))

    record(a, 2)
    assert sorted(p.name for p in venvs.iterdir()) == ["a" * 16, "not-a-digest"]
    assert f"removed the venv {c} (gpuhost_venvs_kept = 2" in capsys.readouterr().out
    b.mkdir()
    record(b, 2)  # a verified before b: both kept
    assert sorted(p.name for p in venvs.iterdir()) == ["a" * 16, "b" * 16, "not-a-digest"]
    c.mkdir()
    record(c, 2)
    assert sorted(p.name for p in venvs.iterdir()) == ["b" * 16, "c" * 16, "not-a-digest"]
    assert json.loads(Path(lkg.RECORD).read_text())["server"]["venvs"] == [str(c), str(b)]
    record(c, 1)
    assert sorted(p.name for p in venvs.iterdir()) == ["c" * 16, "not-a-digest"]
    assert f"removed the venv {b} (gpuhost_venvs_kept = 1" in capsys.readouterr().out


def _venv(tmp_path, name="aaaa"):
    venv = tmp_path / "venvs" / name
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    return venv


def _recorded_with_a_change(lkg, tmp_path):
    """Files recorded with a venv that exists, then the unit changed (a rollback would put it
    back)."""
    unit, env, gate, dropins = _files(tmp_path)
    venv = _venv(tmp_path)
    assert lkg.record(Namespace(venv=str(venv), lock_digest="aaaa", model="m", revision="main",
                                folder=[str(dropins)], keep=1, venvs_dir=None,
                                paths=[str(unit), str(env), str(gate)])) == 0
    unit.write_text("ExecStart=/opt/gpuhost/venvs/bbbb/bin/python\n")
    return unit, venv


@pytest.mark.parametrize("text", ['{"format": 1, "server": {"venv": "/opt/gpu', "", "[1, 2]",
                                  '{"format": 1, "server": {"venv": 3}}'])
def test_a_record_that_does_not_parse_is_no_rollback_and_no_traceback(lkg, tmp_path, capsys,
                                                                       text):
    unit, _ = _recorded_with_a_change(lkg, tmp_path)
    Path(lkg.RECORD).write_text(text)
    capsys.readouterr()
    assert lkg.restore(Namespace(why="x")) == 6
    out = capsys.readouterr().out
    assert f"the last known good record {lkg.RECORD} does not parse" in out, out
    assert "no rollback" in out and "Traceback" not in out
    assert unit.read_text() == "ExecStart=/opt/gpuhost/venvs/bbbb/bin/python\n"
    assert not Path(lkg.MARKER).exists() and lkg.reloads == []


@pytest.mark.parametrize("text", ['{"format": 1, "serv', '{"format": 1, "server": {"venv": '
                                  '"/v", "recorded_at": "t", "files": {}, "venvs": 5}}'])
def test_a_record_that_does_not_parse_is_set_aside_and_written_anew_once_the_gate_passed(
        lkg, tmp_path, capsys, text):
    unit, env, gate, dropins = _files(tmp_path)
    Path(lkg.ROOT).mkdir(parents=True)
    Path(lkg.RECORD).write_text(text)
    assert _record(lkg, unit, env, gate, dropins) == 0
    assert json.loads(Path(lkg.RECORD).read_text())["server"]["files"][str(unit)]
    out = capsys.readouterr().out
    assert f"the last known good record {lkg.RECORD} does not parse" in out, out
    assert "recorded anew" in out and "set aside as" in out, out
    (aside,) = Path(lkg.ROOT).glob("last-known-good.json.bad-*")
    assert aside.read_text() == text


def test_a_full_disk_is_one_line_and_the_record_as_it_was(lkg, tmp_path, capsys, monkeypatch):
    unit, env, gate, dropins = _files(tmp_path)
    assert _record(lkg, unit, env, gate, dropins) == 0
    before = Path(lkg.RECORD).read_text()
    unit.write_text("ExecStart=/opt/gpuhost/venvs/cccc/bin/python\n")
    real = lkg.os.fsync

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lkg.os, "fsync", full)
    monkeypatch.setattr(lkg.sys, "argv", ["last_known_good.py", "record", "--venv", "/v",
                                          "--lock-digest", "d", "--model", "m", "--revision",
                                          "r", str(unit)])
    capsys.readouterr()
    assert lkg.main() == lkg.WRITE_FAILED
    monkeypatch.setattr(lkg.os, "fsync", real)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("could not write the last known good"), out
    assert "No space left on device" in out[0]
    assert Path(lkg.RECORD).read_text() == before
    assert not list(Path(lkg.ROOT).rglob("*.gpuhost-tmp"))


def test_check_says_whether_the_record_agrees_with_what_serves(lkg, tmp_path, capsys,
                                                              monkeypatch):
    unit, env, gate, dropins = _files(tmp_path)
    assert _record(lkg, unit, env, gate, dropins) == 0
    venv = str(unit.parent.parent / "venvs" / "aaaa")
    args = Namespace(venv=venv, folder=[str(dropins)], paths=[str(unit), str(env), str(gate)])
    monkeypatch.setattr(lkg, "_verified", lambda: True)
    capsys.readouterr()
    lkg.check(args)
    assert capsys.readouterr().out == "fresh\n"
    unit.write_text("changed\n")
    lkg.check(args)
    assert capsys.readouterr().out == f"stale: {unit} differ from what it recorded\n"
    lkg.check(Namespace(**{**vars(args), "venv": "/other"}))
    assert "stale: it names the venv" in capsys.readouterr().out
    monkeypatch.setattr(lkg, "_verified", lambda: False)
    lkg.check(args)
    assert capsys.readouterr().out == "unverified\n"


def test_prune_keeps_the_recorded_and_the_named_venvs_only(lkg, tmp_path, capsys):
    unit, env, gate, dropins = _files(tmp_path)
    venvs = tmp_path / "venvs"
    names = ["0123456789abcdef", "0123456789abcdef-b", "1111111111111111", "2222222222222222",
             "not-a-venv"]
    for name in names:
        (venvs / name).mkdir(parents=True)
    assert lkg.record(Namespace(venv=str(venvs / names[0]), lock_digest="d", model="m",
                                revision="r", folder=[], keep=1, venvs_dir=None,
                                paths=[str(unit)])) == 0
    assert lkg.prune(Namespace(venvs_dir=str(venvs), keep=1,
                               venv=[str(venvs / names[2])])) == 0
    assert sorted(p.name for p in venvs.iterdir()) == [names[0], names[2], "not-a-venv"]
    # no record: nothing is known good, nothing removed
    Path(lkg.RECORD).unlink()
    assert lkg.prune(Namespace(venvs_dir=str(venvs), keep=1, venv=[])) == 0
    assert len(list(venvs.iterdir())) == 3


def test_a_rollback_to_a_venv_that_does_not_import_the_stack_is_refused(lkg, tmp_path, capsys):
    unit, venv = _recorded_with_a_change(lkg, tmp_path)
    lkg.import_error = "sglang: ModuleNotFoundError: No module named 'sglang'"
    capsys.readouterr()
    assert lkg.restore(Namespace(why="x")) == 6
    out = capsys.readouterr().out
    assert (f"the last known good's venv {venv} does not import the serving stack (sglang: "
            "ModuleNotFoundError: No module named 'sglang'): no rollback") in out, out
    assert unit.read_text() == "ExecStart=/opt/gpuhost/venvs/bbbb/bin/python\n"
    # nothing to put back: still said, not "nothing to roll back"
    unit.write_text("ExecStart=/opt/gpuhost/venvs/aaaa/bin/python\n")
    assert lkg.restore(Namespace(why="x")) == 6
    assert "does not import the serving stack" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["missing", "changed"])
def test_a_missing_or_changed_copy_leaves_every_file_as_it_is(lkg, tmp_path, capsys, damage):
    unit, _ = _recorded_with_a_change(lkg, tmp_path)
    env = tmp_path / "etc" / "server.env"
    env.write_text("HF_TOKEN=s3cret\nNEW=1\n")  # put back before the unit, were it not refused
    digest = json.loads(Path(lkg.RECORD).read_text())["server"]["files"][str(unit)]["sha256"]
    copy = Path(lkg.COPIES) / digest
    copy.unlink() if damage == "missing" else copy.write_text("ExecStart=/bin/false\n")
    capsys.readouterr()
    assert lkg.restore(Namespace(why="x")) == 6
    out = capsys.readouterr().out
    assert f"the last known good's copy of {unit} ({copy}) is" in out, out
    assert "no rollback" in out and "Traceback" not in out and "s3cret" not in out
    assert unit.read_text() == "ExecStart=/opt/gpuhost/venvs/bbbb/bin/python\n"
    assert env.read_text() == "HF_TOKEN=s3cret\nNEW=1\n"
    assert not Path(lkg.MARKER).exists() and lkg.reloads == []


def test_a_recorded_venv_that_is_gone_is_no_rollback(lkg, tmp_path, capsys):
    unit, venv = _recorded_with_a_change(lkg, tmp_path)
    (venv / "bin" / "python").unlink()
    capsys.readouterr()
    assert lkg.restore(Namespace(why="x")) == 6
    out = capsys.readouterr().out
    assert f"the last known good's venv {venv} is gone (no {venv}/bin/python)" in out, out
    assert unit.read_text() == "ExecStart=/opt/gpuhost/venvs/bbbb/bin/python\n"
    assert not Path(lkg.MARKER).exists() and lkg.reloads == []


def test_a_rollback_left_unfinished_that_cannot_go_on_is_given_up(lkg, tmp_path, capsys):
    unit, venv = _recorded_with_a_change(lkg, tmp_path)
    Path(lkg.MARKER).write_text('{"why": "x"}\n')  # an earlier run began a rollback
    (venv / "bin" / "python").unlink()
    assert lkg.restore(Namespace(why="x")) == 6
    out = capsys.readouterr().out
    assert not Path(lkg.MARKER).exists()
    assert "the next deploy applies host data" in out, out


def test_a_record_left_readable_by_an_earlier_gpuhost_is_made_roots_alone(lkg, tmp_path):
    unit, env, gate, dropins = _files(tmp_path)
    Path(lkg.ROOT).mkdir(parents=True)
    Path(lkg.RECORD).write_text(json.dumps({"format": 1}))
    Path(lkg.RECORD).chmod(0o644)
    assert _record(lkg, unit, env, gate, dropins) == 0
    assert oct(Path(lkg.RECORD).stat().st_mode & 0o777) == "0o600"
