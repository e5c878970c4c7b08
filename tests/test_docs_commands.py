"""Every command the manual and README show, checked against what it names: a newcomer copies
them as written (issue #42: "Every command in docs/ is run by a test as written ... or checked
for the flags and keys they name").

A command is a line of a code block (four spaces in, as every page writes them; a trailing
``\\`` joins the next line), split as the shell would (``shlex``, comments dropped). Checked:

- ``pyinfra`` / ``.venv/bin/pyinfra``: every option is one of pyinfra's CLI
  (``pyinfra_cli/cli.py``'s click command, read from the installed pyinfra), the inventory and
  the deploy file exist, and each ``--data key=value`` is a key gpuhost knows whose value, as
  pyinfra parses it (``pyinfra_cli/util.py`` ``parse_cli_arg``), is allowed
  (``operations/plans/settings.py``: the same check a deploy makes before any host is touched);
- ``.venv/bin/python -m sandbox SUB ...`` and ``.venv/bin/python FILE.py ...``: the subcommand
  or file exists and every option is in its own ``--help`` (a file that parses no arguments is
  never run: given ``--help`` it would do its work; it may be given no option);
- ``bin/NAME``: an executable file of the repository.

Only what targets this repository: ``curl``, ``openssl``, ``ssh``, ``export`` and the like are
the operator's tools, not ours. The sandbox runs of the README's commands are
tests/e2e/test_deploy.py's and bin/quickstart's own.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from operations.plans import settings

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYINFRA = {"pyinfra", ".venv/bin/pyinfra"}
PYTHON = {"python", "python3", ".venv/bin/python"}


def commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each shell command in a page's indented code blocks."""
    found: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("    ") and not line.startswith("     "):
            start, command = i + 1, line[4:]
            while command.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command.rstrip()[:-1] + " " + lines[i].strip()
            first = command.split(maxsplit=1)[0] if command.strip() else ""
            if first in PYINFRA | PYTHON or first.startswith("bin/"):
                found.append((start, command))
        i += 1
    return found


def every_command() -> list[tuple[str, str]]:
    return [(f"{page.relative_to(ROOT)}:{number}", command)
            for page in PAGES for number, command in commands(page.read_text(encoding="utf-8"))]


@functools.cache
def pyinfra_options() -> set[str]:
    from pyinfra_cli.cli import cli

    return {opt for param in cli.params for opt in (*param.opts, *param.secondary_opts)
            if opt.startswith("-")}


@functools.cache
def help_of(*argv: str) -> str:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, text=True,
                          capture_output=True, timeout=60, env=env, check=False)
    assert proc.returncode == 0, (argv, proc.stdout, proc.stderr)
    return proc.stdout


def options(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("-") and a != "-"]


def check_pyinfra(argv: list[str]) -> list[str]:
    problems = [f"pyinfra has no option {o}" for o in options(argv)
                if o not in pyinfra_options()]
    files = [a for a in argv if a.endswith(".py") and not a.startswith("-")]
    problems += [f"{f} is no file of the repository" for f in files if not (ROOT / f).is_file()]
    if len(files) < 2:
        problems.append("an inventory and a deploy file are both named")
    for i, arg in enumerate(argv):
        if arg == "--data":
            problems += check_data(argv[i + 1] if i + 1 < len(argv) else "")
    return problems


def check_data(item: str) -> list[str]:
    from pyinfra_cli.util import parse_cli_arg

    key, sep, raw = item.partition("=")
    if not sep:
        return [f"--data {item!r} is not key=value"]
    try:
        settings.from_host_data("docs", {key: parse_cli_arg(raw)})
    except settings.SettingsError as exc:
        return [str(exc)]
    return []


def check_python(argv: list[str]) -> list[str]:
    if argv[:2] == ["-m", "sandbox"]:
        if len(argv) < 3 or argv[2].startswith("-"):
            return ["python -m sandbox without a subcommand"]
        listed = help_of("-m", "sandbox")
        if argv[2] not in listed:
            return [f"sandbox has no subcommand {argv[2]!r}"]
        text = help_of("-m", "sandbox", argv[2])
        return [f"sandbox {argv[2]} has no option {o}" for o in options(argv[3:])
                if o not in text]
    if argv and argv[0].endswith(".py"):
        script = ROOT / argv[0]
        if not script.is_file():
            return [f"{argv[0]} is no file of the repository"]
        given = options(argv[1:])
        if "argparse" not in script.read_text(encoding="utf-8"):
            # no parser: --help would run it (bench/rebuild.py boots three hosts)
            return [f"{argv[0]} takes no options, the page gives {o}" for o in given]
        text = help_of(argv[0])
        return [f"{argv[0]} has no option {o}" for o in given if o not in text]
    return []  # python -c/-m of other modules: not ours


def problems_of(command: str) -> list[str]:
    argv = shlex.split(command, comments=True)
    if not argv:
        return []
    if argv[0] in PYINFRA:
        return check_pyinfra(argv[1:])
    if argv[0] in PYTHON:
        return check_python(argv[1:])
    target = ROOT / argv[0]
    if not (target.is_file() and os.access(target, os.X_OK)):
        return [f"{argv[0]} is no executable of the repository"]
    return []


@pytest.mark.parametrize(("where", "command"), every_command(),
                         ids=[w for w, _ in every_command()])
def test_a_documented_command_names_what_exists(where, command):
    assert problems_of(command) == [], f"{where}: {command}"


def test_the_pages_show_commands_at_all():
    """Not blind: README's two commands and the pages' deploys are found."""
    found = [c for _, c in every_command()]
    assert any(c.startswith("bin/quickstart") for c in found)
    assert sum("deploy.py" in c for c in found) >= 20, found


def test_a_wrong_key_a_wrong_value_and_a_wrong_option_are_named():
    assert problems_of(".venv/bin/pyinfra inventory/lab.py deploy.py --data gpuhost_drvier=590")
    (value,) = problems_of(".venv/bin/pyinfra inventory/lab.py deploy.py "
                           "--data gpuhost_driver_branch=banana")
    assert "gpuhost_driver_branch" in value and "banana" in value
    assert problems_of(".venv/bin/pyinfra inventory/lab.py deploy.py --dryrun") == [
        "pyinfra has no option --dryrun"]
    assert problems_of(".venv/bin/pyinfra inventory/nowhere.py deploy.py") == [
        "inventory/nowhere.py is no file of the repository"]
    assert problems_of(".venv/bin/python -m sandbox up --hostz 2") == [
        "sandbox up has no option --hostz"]
    assert problems_of("bin/nothing") == ["bin/nothing is no executable of the repository"]
    assert re.search("no option --rounds", " ".join(
        problems_of(".venv/bin/python bench/noop_deploy.py --rounds 3")))
