from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def fixture_text():
    def read(name: str) -> str:
        return (FIXTURES / name).read_text()

    return read


def command_output(text: str, command: str) -> list[str]:
    """The lines a fixture recorded for one command (between its "$ command" line and the next
    "# rc=" line)."""
    lines = text.splitlines()
    start = lines.index(f"$ {command}") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("# rc="))
    return lines[start:end]
