"""Real apt's resolver on lists of our choosing, without root and without touching this
machine's apt: apt-get with a private Dir::Etc, Dir::State and Dir::Cache (apt.conf(5)), its
sandbox user set to the caller and its locks off, so ``update`` fetches the lists into a
temporary folder and ``-s install`` answers from them alone."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

needs_apt = pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt-get")


@dataclass
class Apt:
    root: Path
    repo: Path | None = None  # a local repository's folder, where the test made one

    @classmethod
    def make(cls, root: Path, sources: list[str], installed: dict[str, str] | None = None):
        """A private apt under ``root`` with ``sources`` (sources.list lines) and a dpkg status
        that lists ``installed`` (name -> version) as installed."""
        for sub in ("etc/preferences.d", "etc/apt.conf.d", "state/lists/partial",
                    "cache/archives/partial"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "etc/sources.list").write_text("".join(f"{s}\n" for s in sources))
        (root / "state/status").write_text("".join(
            f"Package: {n}\nStatus: install ok installed\nVersion: {v}\nArchitecture: amd64\n"
            f"Maintainer: tests\nDescription: installed for the resolver\n\n"
            for n, v in (installed or {}).items()))
        return cls(root)

    def options(self) -> list[str]:
        r = self.root
        return ["-o", f"Dir::Etc={r}/etc", "-o", f"Dir::State={r}/state",
                "-o", f"Dir::State::status={r}/state/status", "-o", f"Dir::Cache={r}/cache",
                "-o", f"APT::Sandbox::User={pwd.getpwuid(os.getuid()).pw_name}",
                "-o", "Debug::NoLocking=1", "-o", "Acquire::Languages=none",
                "-o", "APT::Architectures=amd64"]

    def run(self, *args: str, tool: str = "apt-get") -> subprocess.CompletedProcess:
        return subprocess.run([tool, *self.options(), *args], capture_output=True, text=True,
                              env={**os.environ, "LC_ALL": "C"}, timeout=600, check=False)

    def pin(self, text: str, name: str = "gpuhost-nvidia-driver") -> None:
        for old in (self.root / "etc/preferences.d").iterdir():
            old.unlink()
        (self.root / "etc/preferences.d" / name).write_text(text)

    def simulate(self, *packages: str) -> tuple[int, dict[str, str], str]:
        """``apt-get -s install --no-install-recommends``: its exit status, what it would
        install (name -> version) and its output."""
        out = self.run("-s", "install", "--no-install-recommends", *packages)
        text = out.stdout + out.stderr
        inst = {}
        for line in text.splitlines():
            if line.startswith("Inst "):
                fields = line.split()
                inst[fields[1]] = fields[2].lstrip("(") if not fields[2].startswith("[") \
                    else fields[3].lstrip("(")
        return out.returncode, inst, text
