"""The shared apt cache of the sandbox's NVIDIA repository (sandbox/nvidia_repo.py): copies
that differ from the repository's packages are dropped, also when another lab booting beside
this one drops the same copy first."""

from pathlib import Path

from sandbox import nvidia_repo


def _repo_and_cache(tmp_path: Path) -> tuple[Path, Path]:
    repo, cache = tmp_path / "repo", tmp_path / "apt-archives"
    repo.mkdir()
    cache.mkdir()
    (repo / "nvidia-smi_590.44.01-1_amd64.deb").write_bytes(b"new")
    (repo / "nvidia-open_590.44.01-1_amd64.deb").write_bytes(b"same")
    (cache / "nvidia-smi_590.44.01-1_amd64.deb").write_bytes(b"old")
    (cache / "nvidia-open_590.44.01-1_amd64.deb").write_bytes(b"same")
    return repo, cache


def test_a_stale_copy_is_dropped_and_a_current_one_kept(tmp_path):
    repo, cache = _repo_and_cache(tmp_path)
    nvidia_repo._drop_stale(cache, repo)
    assert sorted(p.name for p in cache.iterdir()) == ["nvidia-open_590.44.01-1_amd64.deb"]


def test_a_copy_another_lab_dropped_first_is_no_error(tmp_path, monkeypatch):
    repo, cache = _repo_and_cache(tmp_path)
    read = Path.read_bytes

    def read_then_dropped(path):
        data = read(path)
        if path.parent == cache:
            path.unlink()  # the other lab's _drop_stale, between this one's read and unlink
        return data

    monkeypatch.setattr(Path, "read_bytes", read_then_dropped)
    nvidia_repo._drop_stale(cache, repo)
    assert list(cache.iterdir()) == []
