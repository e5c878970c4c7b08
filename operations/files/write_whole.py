"""Put a file in place whole: its new content, uploaded beside nothing that serves, copied to a
temporary file in the destination's own folder, synced, renamed over the old file, the folder
synced; a full disk (ENOSPC) said in one line, and the old file left as it was, serving.

    python3 -c "$(cat write_whole.py)" SRC DEST MODE

SRC: the uploaded content (a file under /dev/shm, removed here whatever happens); DEST: the file
put in place, owned by the caller (root) with MODE (octal). rename(2) replaces DEST atomically
within its file system: a reader (nginx reading host.pem at its start) sees the old file or the
new one, never a part. Sent as ``python3 -c`` (operations/stages/whole_file.py): it runs where
nothing of gpuhost's is shipped yet. Standard library only. Exit 0, or 28 for a full disk, 1
otherwise, with one line on stderr.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def put(src: str, dest: str, mode: int) -> None:
    folder = os.path.dirname(dest) or "."
    tmp = os.path.join(folder, f".{os.path.basename(dest)}.gpuhost-new")
    try:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out, open(src, "rb") as data:
            os.fchmod(out.fileno(), mode)
            shutil.copyfileobj(data, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def main(argv: list[str]) -> int:
    src, dest, mode = argv[0], argv[1], int(argv[2], 8)
    try:
        put(src, dest, mode)
    except OSError as exc:
        kept = "the old one is left as it was" if os.path.exists(dest) else "nothing written"
        if exc.errno == errno.ENOSPC:
            folder = os.path.dirname(dest) or "."
            free = human(shutil.disk_usage(folder).free)
            print(f"{dest}: no space left on the device (ENOSPC) writing it ({free} free in "
                  f"{folder}, as df counts it): {kept}, serving; free space there and run "
                  "again", file=sys.stderr)
            return 28
        print(f"{dest}: could not be written ({exc.strerror or exc}): {kept}", file=sys.stderr)
        return 1
    finally:
        try:
            os.unlink(src)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
