"""Write a file that holds secrets (root's alone) from a template, with ``--diff`` showing each
line's key, never its value.

pyinfra's ``files.template`` (pyinfra 3.10, ``operations/files.py``, ``put``) prints, under
``--diff``, the old and new lines of the file it changes, the old ones read from the host with
the ``FileContents`` fact: for /etc/gpuhost/server.env that is every secret host data put there
(a ``WANDB_API_KEY``), old and new, on the operator's terminal and in CI logs. This operation is
``files.template`` itself, run with pyinfra's diff off; under ``--diff`` it prints its own diff
of the same lines with every value masked (:func:`masked_diff`), so an operator still sees which
keys are added, removed or given a new value. Both operations here write their file whole
(operations/stages/whole_file.py): a full disk leaves the old file as it was, serving, said in one
line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

from pyinfra import host, logger, state
from pyinfra.api import FileUploadCommand, operation
from pyinfra.facts.files import FileContents
from pyinfra.operations import files
from pyinfra.operations.util.files import generate_color_diff

from operations.runtime import shipped_files
from operations.stages.whole_file import whole

#: A systemd EnvironmentFile assignment (systemd.exec(5), EnvironmentFile=: ``KEY=VALUE``
#: lines, ``#`` and ``;`` comments, an optional ``export``).
_ASSIGNMENT: Final = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_.]*)\s*=(.*)$")
HIDDEN: Final = "<hidden>"
CHANGED: Final = "<hidden, new value>"

#: How many secret operations are in a step of pyinfra's own operation now (greenlets of
#: several hosts run the same operation at once), and --diff as it was before the first.
_quiet = 0
_diff_was = False


def _values(lines: list[str]) -> dict[str, str]:
    found = {}
    for line in lines:
        match = _ASSIGNMENT.match(line)
        if match:
            found[match[1]] = match[2]
    return found


def mask(lines: list[str], before: dict[str, str] | None = None) -> list[str]:
    """``lines`` with every value replaced: ``KEY=<hidden>``, or ``KEY=<hidden, new value>``
    where ``before`` (the old file's values) gives the key another value or none; a blank line
    stays blank, any other line (a comment) is hidden whole."""
    out = []
    for line in lines:
        match = _ASSIGNMENT.match(line)
        if match:
            new = before is not None and before.get(match[1]) != match[2]
            out.append(f"{match[1]}={CHANGED if new else HIDDEN}\n")
        elif line.strip():
            out.append(f"{HIDDEN} (a line that is not KEY=VALUE)\n")
        else:
            out.append("\n")
    return out


def masked_diff(current: list[str] | None, desired: list[str]) -> list[str]:
    """pyinfra's diff lines (``generate_color_diff``) between the file as it is (None: absent)
    and as it will be, with :func:`mask`'s masking: keys, never values."""
    old = current or []
    return list(generate_color_diff(mask(old), mask(desired, _values(old))))


@contextmanager
def _diff_off() -> Iterator[None]:
    global _quiet, _diff_was
    if _quiet == 0:
        _diff_was = state.config.DIFF
        state.config.DIFF = False
    _quiet += 1
    try:
        yield
    finally:
        _quiet -= 1
        if _quiet == 0:
            state.config.DIFF = _diff_was


def _diff_asked() -> bool:
    """Whether the run was asked for --diff: ``state.config.DIFF``, unless another host's
    secret file holds it off now (hosts run in parallel greenlets, and a fact read inside
    :func:`_diff_off` switches to another host: its line was left out, seen on the second
    host of a fleet whose certificates were issued again)."""
    return _diff_was if _quiet else state.config.DIFF


def _say(upload: FileUploadCommand, dest: str) -> None:
    src = upload.src
    if not hasattr(src, "getvalue"):
        return
    desired = src.getvalue().splitlines(keepends=True)
    contents = host.get_fact(FileContents, path=dest)
    current = [line + "\n" for line in contents] if contents is not None else None
    host.log(f"Will {'modify' if current is not None else 'create'} {dest} (values hidden: "
             "it holds secrets)", logger.info)
    for line in masked_diff(current, desired):
        logger.info("  %s", line)
    logger.info("")


def _quietly(inner: Iterator[Any], say: Callable[[FileUploadCommand], None]) -> Iterator[Any]:
    """The commands of pyinfra's file operation ``inner``, its body run with pyinfra's diff
    off; under --diff, ``say`` called once, at its first upload, in place of pyinfra's diff."""
    diff = _diff_asked()
    said = False
    while True:
        with _diff_off():
            try:
                command = next(inner)
            except StopIteration:
                return
        if diff and not said and isinstance(command, FileUploadCommand):
            said = True
            say(command)
        yield command


@operation()
def _secret_template(src: str, dest: str, mode: str = "600", **data):
    """``files.template`` for a file that holds secrets: the same changes, and under --diff
    the keys of its lines, never their values.

    + src: the template (jinja2), as for files.template
    + dest: the file on the host
    + mode: its permissions (owner only: 600 or 400)
    + data: the template's variables

    **Example:**

    .. code:: python

        secret_template(name="Server environment", src="templates/server.env.j2",
                        dest="/etc/gpuhost/server.env", env={"WANDB_API_KEY": "..."})
    """
    yield from whole(_quietly(files.template._inner(src=src, dest=dest, mode=mode, **data),
                              lambda upload: _say(upload, dest)), dest, mode)


#: The operation, announcing files.template's reads to the fact cache as files.template does
#: (operations/runtime/shipped_files.py).
secret_template = shipped_files.announced(_secret_template, "template")


def put_hidden(src: Any, dest: str, mode: str = "600") -> Iterator[Any]:
    """The commands of pyinfra's ``files.put`` (root's file) for a file that holds a private key,
    to yield from inside an operation: pyinfra's diff off, and under --diff one line saying the
    file changes, its contents hidden (a PEM has no line worth showing masked); written whole
    (operations/stages/whole_file.py)."""
    yield from whole(_quietly(
        files.put._inner(src=src, dest=dest, user="root", group="root", mode=mode),
        lambda _: host.log(f"Will write {dest} (contents hidden: it holds a private key)",
                           logger.info)), dest, mode)
