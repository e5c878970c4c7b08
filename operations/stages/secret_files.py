"""Check the secret files host data names (the API key file, the Hub token file) on the host,
while planning, without their content ever leaving the host."""

from __future__ import annotations

import json
import shlex
from typing import Final, TypedDict

from pyinfra.api import FactBase
from typing_extensions import override

from operations import REPO_ROOT
from operations.plans.plan import fact, refuse
from operations.plans.settings import PREFIX
from operations.files.secret_file import ALLOWED

#: The check itself: the script the host's programs read their secrets with
#: (operations/files/secret_file.py), sent as ``python3 -c`` so that it runs before anything
#: is shipped. It prints a verdict, never the content.
_SCRIPT: Final = (REPO_ROOT / "operations" / "files" / "secret_file.py").read_text()
#: What the file itself must be.
FILE_ALLOWED: Final = "a file on the host owned by root with mode 0600 or 0400"


class Verdict(TypedDict, total=False):
    type: str  # "file", "symlink", "directory", "other", "absent", or "unknown"
    target: str
    user: str
    mode: str
    problem: str | None


class SecretFile(FactBase[Verdict]):
    """A secret file as secret_file.py's ``--check`` sees it on the host: its type, owner,
    permission bits in octal and what is wrong with its content (None when it is one line of
    header-safe text); never the content:

    .. code:: python

        {"type": "file", "user": "root", "mode": "600", "problem": "it has 2 lines"}
        {"type": "symlink", "target": "/srv/keys/api.key"}
        {"type": "absent"}

    ``{"type": "unknown"}`` where the host has no python3 or the answer does not parse.
    """

    @override
    def requires_command(self, path: str) -> str:
        return "python3"

    @override
    def command(self, path: str) -> str:
        return f"python3 -c {shlex.quote(_SCRIPT)} --check {shlex.quote(path)}"

    @override
    def default(self) -> Verdict:
        return {"type": "unknown"}

    @override
    def process(self, output) -> Verdict:
        try:
            data = json.loads("\n".join(output))
        except ValueError:
            return {"type": "unknown"}
        return data if isinstance(data, dict) else {"type": "unknown"}


def why_not(verdict: Verdict, path: str, what: str) -> tuple[str, str] | None:
    """(what is allowed, why ``path`` is not) for a :class:`SecretFile` verdict, or None when
    the file may be used. ``what`` names the file in messages ("key file")."""
    kind = verdict.get("type")
    if kind == "absent":
        return FILE_ALLOWED, "it does not exist"
    if kind == "symlink":
        target = verdict.get("target") or "?"
        return FILE_ALLOWED, f"it is a symlink (to {target}): name the file itself"
    if kind == "directory":
        return FILE_ALLOWED, "it is a directory, not a regular file"
    if kind == "unknown":
        return FILE_ALLOWED, "it cannot be checked: python3 does not answer on the host"
    if kind != "file":
        return FILE_ALLOWED, verdict.get("problem") or "it is not a regular file"
    user, mode = verdict.get("user"), verdict.get("mode") or "0"
    if user != "root" or int(mode, 8) & 0o077:
        return FILE_ALLOWED, f"it is owned by {user} with mode {mode}"
    problem = verdict.get("problem")
    if problem:
        return (f"a file holding {ALLOWED}",
                f"the {what} {path} is not one line of header-safe text: {problem}")
    return None


def check_secret_file(stage: str, key: str, path: str, what: str) -> bool:
    """Refuse ``stage`` (and return False) unless ``path`` on the host is a regular file owned
    by root, neither readable nor writable by its group or others, holding one line of
    header-safe text (operations/files/secret_file.py).

    + stage: the stage refused, e.g. "SGLang server"
    + key: the host-data key without its prefix, e.g. "api_key_file"
    + path: the file on the host
    + what: how messages call it, e.g. "key file"
    """
    found = why_not(fact(SecretFile, path=path), path, what)
    if found is None:
        return True
    allowed, why = found
    refuse(stage, f"{PREFIX}{key} = {path!r} is not allowed: {allowed} ({why})")
    return False
