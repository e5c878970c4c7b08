"""Files the deploy puts on a host written whole: certificates, keys and the files that hold
secrets never written in place.

pyinfra's ``files.put`` and ``files.template`` (pyinfra 3.x, ``connectors/ssh.py``
``put_file``) write the destination itself: over SFTP where the login is root, else uploaded to
a temporary file and copied over the destination with ``cp``, which truncates it first. A full
disk then leaves a part of the file, or an empty one (seen: an empty ``host.pem``, issue 40
finding 4), and pyinfra's only line is cp's own. Here the upload goes to /dev/shm (memory, not
the disk being written), and operations/files/write_whole.py, sent as ``python3 -c``, copies it
to a temporary file in the destination's folder, syncs it, renames it over the old file and
syncs the folder: the old file or the new one, whole; a full disk is one line, the old file
left serving.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any, Final

from pyinfra.api import FileUploadCommand, QuoteString, StringCommand

from operations import REPO_ROOT

SCRIPT: Final = (REPO_ROOT / "operations" / "files" / "write_whole.py").read_text()


def staged(dest: str) -> str:
    """Where ``dest``'s new content is uploaded first: /dev/shm, one name per destination."""
    return f"/dev/shm/gpuhost-whole-{hashlib.sha256(dest.encode()).hexdigest()[:16]}"


def whole(commands: Iterator[Any], dest: str, mode: str) -> Iterator[Any]:
    """The commands of a pyinfra file operation (``files.put._inner``, ``files.template._inner``)
    for ``dest``, each upload to ``dest`` replaced by: the stage made root's alone (so that
    the root copy pyinfra makes there under sudo is never readable by another user), the upload
    to it, and write_whole.py putting it in place with ``mode`` (octal)."""
    for command in commands:
        if not (isinstance(command, FileUploadCommand) and command.dest == dest):
            yield command
            continue
        stage = staged(dest)
        yield StringCommand("sh", "-c", QuoteString(f"umask 077 && rm -f {stage} && : > {stage}"))
        yield FileUploadCommand(command.src, stage, remote_temp_filename=f"{stage}.up",
                                **command.connector_arguments)
        yield StringCommand("python3", "-c", QuoteString(SCRIPT), stage, QuoteString(dest),
                            mode)
