"""Host trees set aside by `down` and deleted in the background (sandbox/trash.py): only the
named entries, one deleter at a time, a full `down` waiting for it; `down` defers only when
told (tests/lanes.py's units)."""

from __future__ import annotations

import contextlib
import threading

import pytest

from sandbox import lab, rootfs, trash


@pytest.fixture
def trash_dir(tmp_path, monkeypatch):
    folder = tmp_path / "trash"
    monkeypatch.setattr(trash, "TRASH", folder)
    monkeypatch.setattr(trash, "STATE_DIR", tmp_path)
    monkeypatch.setattr(trash, "LOCK", tmp_path / ".trash.lock")
    return folder


def tree(at):
    (at / "root" / "usr").mkdir(parents=True)
    (at / "root" / "usr" / "f").write_text("x")
    return at


def test_a_deleter_deletes_the_entries_it_was_named_and_no_other(trash_dir, capsys):
    old, gone = tree(trash_dir / "gpu1-1"), trash_dir / "gpu2-2"
    new = tree(trash_dir / "gpu1-3")  # set aside after the deleter was started
    trash.delete([old, gone])
    assert not old.exists() and new.is_dir() and trash_dir.is_dir()
    assert "deleted 2 tree(s)" in capsys.readouterr().out


def test_a_deleter_refuses_a_path_outside_the_trash(trash_dir, tmp_path):
    hosts = tree(tmp_path / "hosts" / "gpu1")
    with pytest.raises(ValueError, match="is not an entry of"):
        trash.delete([hosts])
    assert hosts.is_dir()


def test_a_deleter_deletes_only_while_it_holds_the_lock_a_full_down_takes(trash_dir,
                                                                         monkeypatch):
    """(A lock held by a thread cannot be shown here: pyinfra_cli, imported by other tests,
    patches threading with gevent, and a blocking flock in a greenlet stops the process.)"""
    entry, held = tree(trash_dir / "gpu1-1"), []

    @contextlib.contextmanager
    def recording():
        held.append(entry.exists())
        yield
        held.append(entry.exists())

    monkeypatch.setattr(trash, "held", recording)
    trash.delete([entry])
    assert held == [True, False]  # the lock taken before the first file went, kept to the last


def test_trees_set_aside_are_listed_for_the_next_deleter(trash_dir, tmp_path):
    hosts = tmp_path / "hosts"
    trees = [tree(hosts / "gpu1"), tree(hosts / "gpu2")]
    assert trash.entries() == []
    rootfs.set_aside(trees, trash_dir)
    listed = trash.entries()
    assert [p.name.split("-")[0] for p in listed] == ["gpu1", "gpu2"]
    assert all(p.parent == trash_dir for p in listed) and not any(t.exists() for t in trees)


@pytest.mark.parametrize("value, deferred", [("1", True), (None, False), ("0", False)])
def test_down_sets_the_trees_aside_only_when_told(monkeypatch, value, deferred):
    calls = []
    monkeypatch.setattr(lab, "require_root", lambda action: None)
    monkeypatch.setattr(lab, "_exclusive", lambda: threading.Lock())
    monkeypatch.setattr(lab, "_down", lambda defer_removal=False: calls.append(defer_removal))
    if value is None:
        monkeypatch.delenv(lab.DEFER_REMOVAL_ENV, raising=False)
    else:
        monkeypatch.setenv(lab.DEFER_REMOVAL_ENV, value)
    lab.down()
    assert calls == [deferred]
