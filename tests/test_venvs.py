"""The venvs side by side: a lock's digest names its venv, and what may stand at
gpuhost_venv_path where the link to the serving venv goes (operations/venvs.py)."""

from __future__ import annotations

from pathlib import Path

from operations.lock import read_lock
from operations.venvs import VENVS_DIR, link_problem, lock_digest, stack_venv

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
