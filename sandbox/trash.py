"""Host trees set aside by `down`, deleted off the critical path.

Deleting a host tree is slow here and in CI: each freed extent is discarded (the root
filesystem is mounted ``discard``: /proc/mounts), and a converged host's tree is about 0.9 GB in
22,000 files; on this 2-core machine one such delete took 13 s idle and 34 s for /usr alone at
load 5 (measured with ``rm -rf`` per top-level folder; a just-extracted bare tree, whose blocks
were never written back, went in 2.4 s). So `up`, once its hosts answer, hands the trees that
`down` set aside to a deleter process of its own (``trash.main``, with the entries) and
returns; the next commands on the lab do not wait for it.

One rule keeps it free of races: TRASH holds only whole trees set aside under names never used
again (``gpuN-<ns>``; rootfs.set_aside, under `up`/`down`'s lock), a deleter deletes only the
entries it was named, one deleter at a time, and a full `down`, which removes TRASH itself,
holds the same lock (LOCK below), so it waits for a deleter still at work. A new `up` never
touches TRASH's entries; it extracts new trees into the hosts folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from sandbox import rootfs
from sandbox.layout import STATE_DIR, TRASH

LOCK = STATE_DIR / ".trash.lock"
LOG = STATE_DIR / "trash.log"


@contextlib.contextmanager
def held() -> Iterator[None]:
    """The deleters' lock (waits for one at work)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def entries() -> list[Path]:
    return sorted(TRASH.iterdir()) if TRASH.is_dir() else []


def delete_in_background(names: list[Path]) -> None:
    """Start a deleter for `names` (entries of TRASH) and return at once; its output goes to
    LOG, not to this process's (a caller reading our stdout to its end must not wait for it)."""
    if not names:
        return
    root = Path(__file__).resolve().parent.parent
    with open(LOG, "a") as log:
        # -c rather than -m: the package's __init__ imports this module first
        subprocess.Popen([sys.executable, "-c", "import sys; from sandbox import trash; "
                          "trash.main(sys.argv[1:])", *map(str, names)], cwd=root,
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                         start_new_session=True)


def delete(names: list[Path]) -> None:
    """Delete the named TRASH entries (those already gone are skipped), holding LOCK."""
    with held():
        began = time.monotonic()
        for name in names:
            if name.parent != TRASH:
                raise ValueError(f"{name} is not an entry of {TRASH}")
            rootfs.remove_tree(name)
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} deleted {len(names)} tree(s) in "
              f"{time.monotonic() - began:.1f}s: {' '.join(n.name for n in names)}", flush=True)


def main(argv: list[str]) -> None:
    delete([Path(a) for a in argv])
