"""The roll's state on the router host: which workers a roll took out of the router, and how far
each got, kept across runs (an interrupted run's next run starts from it).

The file (``/etc/gpuhost/roll-state.json``, root-only) is a JSON object, one entry per worker
URL a roll took out and has not put back yet::

    {"http://10.0.0.12:8000": {"host": "gpu2", "state": "drained", "since": 1765040000.0}}

States, in a worker's order (after NVIDIA's GPU Operator's per-node upgrade states: drain, wait
for requests, restart, validate, uncordon, done or failed; its docs' "GPU Driver Upgrades"
page):

- ``draining``: the router was asked to remove it (``DELETE /workers/{id}``, smg drains its
  in-flight requests: ``"status": "draining"``);
- ``drained``: the router lists it no more; its server is not touched yet;
- ``restarting``: its restart (or what waited for its turn) began: only a passed health gate
  and the router's own health checks say it may serve again;
- no entry: it is back in the router, healthy (or never left).

Written whole: a temporary file in the same folder, flushed and synced, renamed over the old
one, the folder synced (rename(2) is atomic within a file system). Standard library only.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time

PATH = "/etc/gpuhost/roll-state.json"
STATES = ("draining", "drained", "restarting")


class StateError(Exception):
    """The roll state cannot be read or written: one line, naming the file."""


#: What the file must be to be read (the budget and the resume trust it: an entry removed by
#: someone else hides a worker an interrupted run left out, and the next roll drains one more).
ALLOWED = ("a regular file owned by the deploy's user (root) that no one else may write "
           "(mode 0600, as the deploy writes it)")
_AFTER = "the next run registers every worker the router does not list"


def _opened(path: str):
    """``path`` opened for reading where it is :data:`ALLOWED` (a symlink not followed, a FIFO
    not waited on), else :class:`StateError`; FileNotFoundError where it is missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise StateError(f"the roll state {path} is not trusted (a symlink): allowed: "
                         f"{ALLOWED}; see who made it, then remove it ({_AFTER})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise StateError(f"the roll state {path} is not trusted ({kind}, owned by uid "
                         f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): allowed: "
                         f"{ALLOWED}; see who changed it, then remove it ({_AFTER})")
    return os.fdopen(fd, encoding="utf-8")


def read(path: str = PATH) -> dict[str, dict]:
    """The entries, by worker URL; {} where the file is missing. An entry whose state is not
    one of :data:`STATES` is dropped; a file that does not parse raises :class:`StateError`
    (it is written whole: something else wrote it), and so does one that is not
    :data:`ALLOWED` (a local user of the router host is a stranger)."""
    try:
        with _opened(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise StateError(f"the roll state {path} cannot be read ({exc}): remove it, and the "
                         "next run registers every worker the router does not list") from None
    if not isinstance(data, dict):
        raise StateError(f"the roll state {path} holds {type(data).__name__}, not an object: "
                         "remove it, and the next run registers every worker the router does "
                         "not list")
    return {url: e for url, e in data.items()
            if isinstance(e, dict) and e.get("state") in STATES}


def write(entries: dict[str, dict], path: str = PATH) -> None:
    """``entries`` at ``path``, whole (module docstring); raises :class:`StateError` where it
    cannot (a full disk: the old file stays as it was)."""
    try:
        _write(entries, path)
    except OSError as exc:
        why = ("no space left on its file system" if exc.errno == errno.ENOSPC
               else exc.strerror or str(exc))
        raise StateError(f"the roll state {path} could not be written ({why}): the old one "
                         "is left as it was; nothing more was changed") from None


def _write(entries: dict[str, dict], path: str) -> None:
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, f".{os.path.basename(path)}.new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def mark(url: str, host: str, state: str | None, path: str = PATH) -> dict[str, dict]:
    """Set ``url``'s entry to ``state`` (None: remove it), written whole; returns the entries."""
    entries = read(path)
    if state is None:
        if url not in entries:
            return entries
        entries.pop(url)
    else:
        entries[url] = {"host": host, "state": state, "since": round(time.time(), 1)}
    write(entries, path)
    return entries


def where(entries: dict[str, dict], url: str) -> str:
    """``url``'s entry in words: its host and state."""
    e = entries.get(url)
    if not e:
        return url
    return f"{e.get('host') or url} ({e['state']} by a roll)"
