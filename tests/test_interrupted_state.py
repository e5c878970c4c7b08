"""What lets the next deploy finish an interrupted one: the digest a unit records at start
(operations/files/unit_inputs.py) against the files now, the unit's state as the deploy reads it,
and dpkg's interrupted runs."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api.util import get_template

from operations.facts import host as host_ops
from operations.facts.model_facts import STAMP as MODEL_STAMP
from operations.plans.settings import from_host_data
from operations.stages import package_runs
from operations.stages import server_state, server_unit
from operations.stages.flash_attn import STAMP_NAME
from operations.files import unit_inputs

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "operations" / "files" / "unit_inputs.py"


@pytest.fixture
def venv(tmp_path):
    site = tmp_path / "venv" / "lib" / "python3.12" / "site-packages"
    (site / "torch-2.9.1.dist-info").mkdir(parents=True)
    (site / "sglang-0.5.9.dist-info").mkdir()
    return tmp_path / "venv"


def test_digest_follows_contents_absence_and_the_venv(tmp_path, venv):
    unit, env = tmp_path / "unit", tmp_path / "env"
    unit.write_text("ExecStart=a\n")
    env.write_text("")
    paths = [str(unit), str(env)]
    first = unit_inputs.inputs_digest(paths, str(venv))
    assert len(first) == 64 and first == unit_inputs.inputs_digest(paths, str(venv))
    unit.write_text("ExecStart=b\n")
    second = unit_inputs.inputs_digest(paths, str(venv))
    assert second != first
    env.unlink()  # absent is not empty
    third = unit_inputs.inputs_digest(paths, str(venv))
    assert third != second
    env.write_text("")
    assert unit_inputs.inputs_digest(paths, str(venv)) == second
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "torch-2.9.1.dist-info").rename(site / "torch-2.9.0.dist-info")
    assert unit_inputs.inputs_digest(paths, str(venv)) != second
    before = unit_inputs.inputs_digest(paths, str(venv))
    (venv / STAMP_NAME).write_text('{"flash_attn": "2.8.3"}')
    assert unit_inputs.inputs_digest(paths, str(venv)) != before


def test_digest_follows_a_drop_in_folders_conf_files(tmp_path):
    unit, folder = tmp_path / "unit", tmp_path / "sglang.service.d"
    unit.write_text("ExecStart=a\n")
    paths = [str(unit), str(folder)]
    absent = unit_inputs.inputs_digest(paths)
    folder.mkdir()
    (folder / "10-gpuhost-driver-gate.conf").write_text("[Service]\nExecStartPre=x\n")
    ours = unit_inputs.inputs_digest(paths)
    assert ours != absent
    (folder / "README").write_text("systemd reads only *.conf")
    assert unit_inputs.inputs_digest(paths) == ours
    (folder / "50-theirs.conf").write_text("[Service]\nRestart=no\n")
    theirs = unit_inputs.inputs_digest(paths)
    assert theirs != ours
    (folder / "50-theirs.conf").write_text("[Service]\nRestart=always\n")
    assert unit_inputs.inputs_digest(paths) not in (ours, theirs)
    (folder / "50-theirs.conf").unlink()
    assert unit_inputs.inputs_digest(paths) == ours


def test_flash_attn_stamp_name_is_the_builds():
    assert unit_inputs.FLASH_ATTN_STAMP == STAMP_NAME


def test_write_is_what_it_prints(tmp_path):
    target = tmp_path / "run" / "gpuhost-sglang" / "inputs"
    out = subprocess.run([sys.executable, str(SCRIPT), "--write", str(target), str(SCRIPT)],
                         capture_output=True, text=True, check=True)
    assert target.read_text() == out.stdout
    assert not list(target.parent.glob("*.tmp"))


@pytest.fixture
def settings(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n")
    return lambda **data: from_host_data("gpu1", {"gpuhost_lock": str(lock), **data})


def exec_start_pre(template: str, context: dict) -> list[str]:
    text = get_template(str(ROOT / "templates" / template)).render(**context)
    line = [x for x in text.splitlines() if x.startswith("ExecStartPre=")][0]
    assert "RuntimeDirectoryMode=0700" in text  # the digest covers server.env: the unit's user
    return shlex.split(line.removeprefix("ExecStartPre="))


def test_the_unit_records_what_the_deploy_compares(settings):
    s = settings()
    words = exec_start_pre("sglang.service.j2", server_unit.unit_context(s))
    # as root ("+"): the environment file it digests is root's alone; the server is not root
    assert words[:4] == ["+/usr/bin/python3", f"{server_unit.LIB_DIR}/unit_inputs.py", "--write",
                         "%t/gpuhost-sglang/inputs"]
    flag, venv, *paths = server_unit.server_inputs(s)
    assert flag == "--venv"
    assert words[4:] == ["--venv", venv, *paths]
    assert paths == [server_unit.UNIT_PATH, server_unit.DROPIN_DIR, server_unit.SERVER_ENV_FILE,
                     server_unit.P2P_ENV_FILE,
                     f"{s.model_path}/{MODEL_STAMP}"]
    command = server_state.ServiceState().command(server_unit.UNIT, "gpuhost-sglang",
                                                  ["--venv", venv, *paths])
    assert "cat /run/gpuhost-sglang/inputs" in command
    assert f"unit_inputs.py --venv {venv} {' '.join(paths)}" in command


def test_a_local_model_has_no_stamp_to_follow(settings, tmp_path):
    s = settings(gpuhost_model=str(tmp_path))
    paths = server_unit.server_inputs(s)
    assert not any(p.endswith(MODEL_STAMP) for p in paths)


def test_the_gate_records_its_unit_and_program_not_the_key(settings, tmp_path):
    key = tmp_path / "key"
    s = settings(gpuhost_server_host="0.0.0.0", gpuhost_api_key_file=str(key))
    words = exec_start_pre("gate.service.j2", server_unit.gate_context(s))
    assert words[3] == "%t/gpuhost-sglang-gate/inputs"
    assert words[4:] == [server_unit.GATE_UNIT_PATH, "/etc/gpuhost/nginx/sglang-gate.conf",
                         f"{server_unit.LIB_DIR}/gate_keys.py",
                         f"{server_unit.LIB_DIR}/secret_file.py"]
    assert str(key) not in words


SHOW = ["ActiveState=active", "InvocationID=0f4e6a1b2c3d4e5f60718293a4b5c6d7", "NeedDaemonReload=no"]


@pytest.mark.parametrize(
    ("lines", "running", "stale", "reload"),
    [
        ([*SHOW, "started_with=aa", "now=aa"], True, False, False),
        ([*SHOW, "started_with=aa", "now=bb"], True, True, False),
        # started by a unit without the ExecStartPre (an older gpuhost), or /run lost
        ([*SHOW, "started_with=", "now=bb"], True, True, False),
        # unit_inputs.py not on the host yet: nothing to compare
        ([*SHOW, "started_with=", "now="], True, False, False),
        (["ActiveState=inactive", "InvocationID=", "NeedDaemonReload=no", "started_with=",
          "now=bb"], False, False, False),
        (["ActiveState=activating", "InvocationID=1", "NeedDaemonReload=yes", "started_with=aa",
          "now=bb"], True, True, True),
        ([], False, False, False),
    ],
)
def test_unit_state(lines, running, stale, reload):
    state = server_state.ServiceState().process(lines)
    assert (state.running, state.stale, state.need_reload) == (running, stale, reload)


def test_dpkg_interrupted_reads_the_journal_and_the_audit():
    fact = host_ops.DpkgInterrupted()
    assert fact.process([]) == []
    lines = ["journal entry 0001", "The following packages have been unpacked but not yet "
             "configured.", " nvidia-open       NVIDIA open kernel module"]
    assert fact.process(["", *lines]) == lines
    assert "/var/lib/dpkg/updates" in fact.command() and "dpkg --audit" in fact.command()


def test_dpkg_is_finished_under_its_lock():
    (command,) = package_runs.dpkg_finished._inner(lock_timeout=30)  # pyinfra's undecorated op
    text = str(command)
    assert text.endswith("30 --force-confdef --force-confold --configure -a")
    assert "DPKG_FRONTEND_LOCKED" in text and "lock-frontend" in text
