"""A venv that does not run, and a full disk (ENOSPC) said in one line: the venv check
(venv_facts.VenvRuns) run here on venvs broken as a full disk leaves them, the wrapper the venv's
commands run through (operations/files/no_space.py), and the model download running out of disk
(operations/files/model_fetch.py with a stand-in huggingface_hub)."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from operations.facts.venv_facts import VenvAt, VenvPython, VenvRuns
from operations.files import no_space

FILES = Path(__file__).resolve().parents[1] / "operations" / "files"
PIP_ERROR = ("ERROR: Could not install packages due to an OSError: [Errno 28] No space left on "
             "device: '/opt/gpuhost/venv/lib/python3.11/site-packages/torch/lib/libtorch.so'")


# --- the venv check ------------------------------------------------------------------------------

def _venv(root: Path, name: str, pip: bool = True) -> Path:
    """A venv without pip (fast), and, where ``pip``, a stand-in pip that answers --version."""
    path = root / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    if pip:
        (site,) = path.glob("lib/python3*/site-packages")
        (site / "pip").mkdir()
        (site / "pip" / "__init__.py").write_text("")
        (site / "pip" / "__main__.py").write_text("print('pip 99.0 from stand-in')\n")
    return path


def _check(path: Path, fact_class: type = VenvRuns) -> dict:
    fact = fact_class()
    out = subprocess.run(["sh", "-c", fact.command(str(path))], capture_output=True, text=True,
                         check=True)
    return fact.process(out.stdout.splitlines())


def test_a_venv_whose_python_and_pip_run_is_ok(tmp_path):
    health = _check(_venv(tmp_path, "ok"))
    assert (health["state"], health["why"], health["is_venv"]) == ("ok", "", True)


def test_what_is_at_a_link_is_read_without_starting_its_python(tmp_path):
    """VenvAt, for the link at gpuhost_venv_path: the same answer as VenvRuns but the state,
    and the venv's python is not started (a python that would leave a mark leaves none)."""
    venv = _venv(tmp_path, "target")
    link = tmp_path / "link"
    link.symlink_to(venv)
    mark = tmp_path / "started"
    python = venv / "bin" / "python"
    python.unlink()
    python.write_text(f"#!/bin/sh\ntouch {mark}\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    at = _check(link, VenvAt)
    assert not mark.exists() and at["state"] == "unchecked"
    runs = _check(link)
    assert mark.exists() and runs["state"] == "ok"
    assert {**at, "state": "", "why": ""} == {**runs, "state": "", "why": ""}
    assert (at["found"], at["target"], at["target_found"]) == ("link", str(venv), "folder")


def test_a_whole_pip_is_not_started_and_a_cut_one_says_why(tmp_path):
    """A venv with ensurepip's real pip: where its files match its RECORD, pip is not started
    (a ``__main__`` that fails, recorded with its own sha256, is never run: ok); where one
    does not, or is cut short as a full disk leaves it, ``pip --version`` says what fails."""
    venv = tmp_path / "real"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    (site,) = venv.glob("lib/python3*/site-packages")
    assert _check(venv)["state"] == "ok"
    main = site / "pip" / "__main__.py"
    (record,) = site.glob("pip-*.dist-info/RECORD")
    kept_main, kept_record = main.read_bytes(), record.read_text()
    failing = b"raise SystemExit('pip was started')\n"
    main.write_bytes(failing)
    digest = base64.urlsafe_b64encode(hashlib.sha256(failing).digest()).rstrip(b"=").decode()
    record.write_text("".join(
        f"pip/__main__.py,sha256={digest},{len(failing)}\n" if line.startswith("pip/__main__.py,")
        else line for line in kept_record.splitlines(keepends=True)))
    assert _check(venv)["state"] == "ok"
    record.write_text(kept_record)
    health = _check(venv)
    assert health["state"] == "broken" and "pip was started" in health["why"]
    main.write_bytes(kept_main)
    assert _check(venv)["state"] == "ok"
    cli = site / "pip" / "_internal" / "cli" / "main.py"
    cli.write_bytes(cli.read_bytes()[:200])
    health = _check(venv)
    assert health["state"] == "broken" and health["why"].startswith("pip exited 1: ")


def test_no_venv_is_absent(tmp_path):
    (tmp_path / "empty").mkdir()
    assert _check(tmp_path / "empty")["state"] == "absent"
    health = _check(tmp_path / "missing")
    assert (health["state"], health["why"], health["is_venv"]) == ("absent", "", False)


def test_a_venv_without_its_pip_module_is_broken(tmp_path):
    health = _check(_venv(tmp_path, "nopip", pip=False))
    assert health["state"] == "broken" and health["is_venv"]
    assert health["why"].startswith("pip exited 1: ") and "No module named pip" in health["why"]


def test_a_truncated_python_is_broken_though_it_exits_0(tmp_path):
    """An empty file "runs" as an empty shell script: exit 0, no output."""
    path = _venv(tmp_path, "empty-python")
    (path / "bin" / "python").unlink()
    (path / "bin" / "python").write_bytes(b"")
    (path / "bin" / "python").chmod(0o755)
    health = _check(path)
    assert (health["state"], health["why"], health["is_venv"]) == (
        "broken", "bin/python printed nothing (exit 0)", True)


def test_a_python_gone_from_under_the_venv_is_broken(tmp_path):
    path = _venv(tmp_path, "dangling")
    (path / "bin" / "python").unlink()
    (path / "bin" / "python").symlink_to("/nonexistent/python3.99")
    health = _check(path)
    assert health["state"] == "broken" and health["why"].startswith("bin/python exited 127: ")


def test_a_folder_with_a_python_that_does_not_run_but_no_pyvenv_cfg_is_no_venv(tmp_path):
    (tmp_path / "tools" / "bin").mkdir(parents=True)
    (tmp_path / "tools" / "bin" / "python").write_text("#!/bin/sh\nexit 3\n")
    (tmp_path / "tools" / "bin" / "python").chmod(0o755)
    health = _check(tmp_path / "tools")
    assert (health["state"], health["is_venv"]) == ("broken", False)


def test_the_python_a_broken_venv_is_recreated_with_answers_for_it(tmp_path):
    """The flash-attn stamp is compared with the python the venv will have, not refused."""
    path = _venv(tmp_path, "empty-python-again")
    (path / "bin" / "python").unlink()
    (path / "bin" / "python").write_bytes(b"")
    (path / "bin" / "python").chmod(0o755)
    fact = VenvPython()
    out = subprocess.run(["sh", "-c", fact.command(str(path))], capture_output=True, text=True,
                         check=True)
    version = "import sys; print('%d.%d' % sys.version_info[:2])"
    host_python = subprocess.run(["python3", "-c", version], capture_output=True, text=True,
                                 check=True)
    assert fact.process(out.stdout.splitlines()) == host_python.stdout.strip()


# --- the wrapper ---------------------------------------------------------------------------------

def _wrapped(tmp_path: Path, script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(FILES / "no_space.py"), "--what", "pip install into the venv",
         "--path", str(tmp_path), "--", "sh", "-c", script],
        capture_output=True, text=True, check=False)


def test_a_command_out_of_disk_is_one_line_naming_enospc_the_file_and_the_free_space(tmp_path):
    run = _wrapped(tmp_path, f"echo Collecting torch; echo \"{PIP_ERROR}\" >&2; exit 1")
    assert run.returncode == 28 and run.stdout == ""
    (line,) = run.stderr.splitlines()
    assert line.startswith("pip install into the venv: no space left on the device (ENOSPC) "
                           "writing /opt/gpuhost/venv/lib/python3.11/site-packages/torch/lib/"
                           "libtorch.so: /")  # the nearest folder that exists here
    assert " is on " in line and " free of " in line and line.endswith(" (df)")


def test_a_traceback_out_of_disk_is_one_line_too(tmp_path):
    traceback = ("Traceback (most recent call last):\\n  File \\\"ensurepip\\\", line 1\\n"
                 "OSError: [Errno 28] No space left on device\\n")
    run = _wrapped(tmp_path, f"printf '{traceback}' >&2; exit 1")
    assert run.returncode == 28
    (line,) = run.stderr.splitlines()
    assert f"(ENOSPC) writing {tmp_path}: {tmp_path} is on " in line


def test_other_failures_and_successes_pass_through(tmp_path):
    failed = _wrapped(tmp_path, "echo out; echo 'ERROR: No matching distribution' >&2; exit 1")
    assert (failed.returncode, failed.stdout, failed.stderr) == (
        1, "out\n", "ERROR: No matching distribution\n")
    ok = _wrapped(tmp_path, "echo installed")
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "installed\n", "")


def test_a_silent_failure_on_a_full_file_system_is_named(tmp_path, monkeypatch):
    """venv hides ensurepip's error; a file system with nothing left says it."""
    monkeypatch.setattr(no_space, "is_full", lambda path: True)
    line = no_space.full_disk_line("creating the venv /v", str(tmp_path), "exit status 1")
    assert line.startswith("creating the venv /v: no space left on the device (ENOSPC: its "
                           f"file system is full) writing {tmp_path}: {tmp_path} is on ")
    monkeypatch.setattr(no_space, "is_full", lambda path: False)
    assert no_space.full_disk_line("x", str(tmp_path), "exit status 1") is None


def test_where_names_the_nearest_existing_folder_its_mount_and_the_free_space(tmp_path):
    text = no_space.where(str(tmp_path / "not" / "yet"))
    assert text.startswith(f"{tmp_path} is on ") and " mounted on /" in text
    assert " free of " in text


def test_an_enospc_is_found_behind_what_wraps_it():
    import errno

    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("a worker failed") from exc
    except RuntimeError as wrapped:
        assert no_space.enospc(wrapped) is full
    assert no_space.enospc(OSError(errno.EACCES, "Permission denied")) is None
    assert no_space.human(0) == "0 B" and no_space.human(3 * 2**20 + 2**19) == "3.5 MiB"


# --- the model download --------------------------------------------------------------------------

FAKE_HUB = '''
import errno, os
class _File:
    def __init__(self, name, size):
        self.rfilename, self.size = name, size
class _Info:
    sha = "0123456789abcdef0123456789abcdef01234567"
    siblings = [_File("config.json", 100), _File("model-00001.safetensors", 3 * 2**20)]
class HfApi:
    def __init__(self, endpoint=None, token=None):
        pass
    def model_info(self, repo, revision=None, files_metadata=False):
        return _Info()
def snapshot_download(repo, revision=None, local_dir=None, token=None, endpoint=None):
    path = os.path.join(local_dir, "model-00001.safetensors")
    with open(path, "wb") as f:
        f.write(b"x" * 1000)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if os.environ.get("WRAPPED"):
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("download worker failed") from exc
    raise full
'''


@pytest.mark.parametrize("wrapped", [False, True], ids=["raised", "wrapped"])
def test_a_model_download_out_of_disk_is_one_line(tmp_path, wrapped):
    fake = tmp_path / "fake" / "huggingface_hub"
    (fake / "utils").mkdir(parents=True)
    (fake / "__init__.py").write_text(textwrap.dedent(FAKE_HUB))
    (fake / "utils" / "__init__.py").write_text("class HfHubHTTPError(Exception):\n    pass\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "fake")}
    if wrapped:
        env["WRAPPED"] = "1"
    dest = tmp_path / "models" / "org" / "model"
    result = subprocess.run(
        [sys.executable, str(FILES / "model_fetch.py"), "--repo", "org/model", "--revision",
         "main", "--dest", str(dest), "--endpoint", "http://127.0.0.1:9", "--headroom-gib", "0"],
        env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"model download of org/model@0123456789abcdef0123456789abcdef0123456"
                           f"7 into {dest} failed: no space left on the device (ENOSPC) writing "
                           f"{dest}: {dest} is on ")
    assert " free of " in line
    assert line.endswith("(df); the snapshot needs 3.0 MiB in all, 3.0 MiB of it still to "
                         "download when this run began")
