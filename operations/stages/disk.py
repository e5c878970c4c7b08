"""A full disk on the host said in one line: commands that write run through
operations/files/no_space.py (shipped by the ML venv stage, run by the host's python3)."""

from __future__ import annotations

import shlex
from typing import Final

from pyinfra.api import StringCommand

from operations import LIB_DIR

#: The wrapper that names a full disk (operations/files/no_space.py), shipped by the ML venv
#: stage (model_fetch.py imports it too) and run by the host's python3: it needs no working
#: venv.
NO_SPACE: Final = f"{LIB_DIR}/no_space.py"


def no_space_named(what: str, path: str, command: list[str]) -> StringCommand:
    """``command`` run by the host's python3 through no_space.py: its output and exit status as
    they are, except where it fails for lack of disk space (ENOSPC), which is said in one line
    naming ``what`` it did, the path written, its file system and the space free there."""
    return StringCommand(*(shlex.quote(c) for c in (
        "python3", NO_SPACE, "--what", what, "--path", path, "--", *command)))
