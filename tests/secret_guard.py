"""The test suite's own check that no secret reaches its output.

Every secret the suite makes or reads (the hub stand-in's token on each sandbox host, API keys
made by tests) is registered here; everything the suite would show is observed: each test's
report (captured stdout, stderr and log, the failure text) and the whole output of every deploy
and sandbox command the end-to-end helpers run (tests/e2e/lab.py), shown or not. At the end of
the session tests/conftest.py fails the run if a registered value appears in anything observed,
naming where and which kind of secret, never the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Shorter values are not secrets worth the name, and would match by chance.
MIN_LENGTH = 16


@dataclass
class Guard:
    secrets: dict[str, str] = field(default_factory=dict)  # value -> kind
    observed: list[tuple[str, str]] = field(default_factory=list)  # (where, text)

    def register(self, value: str, kind: str) -> str:
        """Remember ``value`` (a token, a key) as a secret of ``kind``; returns it. Raises
        ValueError for a value shorter than MIN_LENGTH characters."""
        value = value.strip()
        if len(value) < MIN_LENGTH:
            raise ValueError(f"a {kind} of {len(value)} characters: too short to guard "
                             f"(at least {MIN_LENGTH})")
        self.secrets[value] = kind
        return value

    def observe(self, where: str, text: str) -> None:
        """Remember ``text``, which the suite produced at ``where`` (a test id, a command)."""
        if text:
            self.observed.append((where, text))

    def leaks(self) -> list[str]:
        """One line per (place, kind of secret) where a registered value appears."""
        found = []
        for where, text in self.observed:
            for value, kind in self.secrets.items():
                if value in text:
                    found.append(f"{where}: the {kind}")
        return sorted(set(found))


GUARD = Guard()
