"""The files gpuhost ships, checked in one command: what pyinfra's file operations will read,
announced to the fact cache when each operation is called.

pyinfra's ``files.put`` and ``files.template`` (pyinfra 3.10, ``operations/files.py``) read
the destination's ``File``, its ``Directory`` when it is not a file, the parent's
``Directory`` (``_create_remote_dir``) and the destination's ``Sha1File`` (``_file_equal``);
``files.file`` reads ``File`` and, to create a file, the parent's ``Directory``;
``files.directory`` reads ``Directory``. Without a change detection pass (a real run), pyinfra
runs each operation's body while executing, one operation after the other, so each reading
was a command of its own: 2 to 4 a file. Announced (``fact_cache.expect``) when the operation
is called while planning, they are read together at the first of them (``fact_batch``), and
again together after anything changed the host. The operations themselves are pyinfra's,
unchanged: they decide from those facts exactly as before, so ``--dry`` and a real run plan the
same changes, with the same modes, owners and parent folders.

And the files gpuhost no longer ships: :func:`retired` removes them from a host an older
gpuhost left them on.
"""

from __future__ import annotations

import functools
import inspect
import posixpath
from collections.abc import Callable, Iterator
from typing import Any, Final

from pyinfra.api.operation import OperationMeta
from pyinfra.context import ctx_host
from pyinfra.facts.files import Directory, File, Sha1File
from pyinfra.operations import files

from operations import LIB_DIR
from operations.runtime import fact_cache

#: Scripts an older gpuhost shipped to LIB_DIR and no stage ships now, so a host upgraded from
#: it kept them: ``api_gate.py``, gpuhost's own API key gate, retired when the gates became
#: nginx from the distribution (commit c69a94f, docs/security.md). A name goes here when its
#: script leaves operations/files/.
RETIRED: Final = ("api_gate.py",)

Reads = Iterator[tuple[Any, str]]  # (fact class, path)


def _put_reads(given: dict[str, Any]) -> Reads:
    dest = given["dest"]
    yield File, dest
    yield Directory, dest
    yield Sha1File, dest
    if given.get("create_remote_dir", True) and posixpath.dirname(dest):
        yield Directory, posixpath.dirname(dest)


def _file_reads(given: dict[str, Any]) -> Reads:
    path = str(given["path"])
    yield File, path
    if given.get("present", True) and given.get("create_remote_dir", False) \
            and posixpath.dirname(path):
        yield Directory, posixpath.dirname(path)


def _directory_reads(given: dict[str, Any]) -> Reads:
    yield Directory, str(given["path"])


#: pyinfra's file operation -> the facts its body reads, from its arguments by name.
READS: dict[str, Callable[[dict[str, Any]], Reads]] = {
    "put": _put_reads, "template": _put_reads, "file": _file_reads,
    "directory": _directory_reads,
}


def _announcing(operation: Any, reads: Callable[[dict[str, Any]], Reads]) -> Any:
    parameters = inspect.signature(operation._inner).parameters

    @functools.wraps(operation)
    def call(*args: Any, **kwargs: Any) -> Any:
        own = {k: v for k, v in kwargs.items() if k in parameters}
        try:
            given = inspect.signature(operation._inner).bind_partial(*args, **own).arguments
            for cls, path in reads(given):
                fact_cache.expect(ctx_host.get(), cls, path=path)
        except (TypeError, KeyError):
            pass  # pyinfra's own call below says what is wrong with the arguments
        return operation(*args, **kwargs)

    call._gpuhost_announcing = True  # type: ignore[attr-defined]
    return call


def announced(operation: Any, like: str = "put") -> Any:
    """``operation`` (one of gpuhost's own that runs pyinfra's ``files.<like>`` inside, as
    operations/stages/secret_template.py does) announcing the reads of ``files.<like>``."""
    return _announcing(operation, READS[like])


def install() -> None:
    """Announce the reads of ``files.put``, ``template``, ``file`` and ``directory`` for this
    run (idempotent); the fact cache (``fact_cache.install``) reads them together."""
    for name, reads in READS.items():
        operation = getattr(files, name)
        if not getattr(operation, "_gpuhost_announcing", False):
            setattr(files, name, _announcing(operation, reads))


def retired(lib_dir: str = LIB_DIR) -> list[OperationMeta]:
    """Remove :data:`RETIRED` from ``lib_dir`` (pyinfra's ``files.file`` with ``present=False``:
    ``rm -f`` where the file is, no change where it is not).

    Called after the server and router stages: until they have replaced a gate's unit, an older
    unit may still run ``api_gate.py`` (started again at a reboot of the NVIDIA stage); a host
    that fails before them keeps the file with the unit that needs it.

    Only where the file is (pyinfra's File fact while planning): a fresh host, which never had
    it, is not told of a removal that does nothing (issue 42)."""
    host = ctx_host.get()
    return [files.file(name=f"Remove {lib_dir}/{name} (no longer shipped)",
                       path=f"{lib_dir}/{name}", present=False)
            for name in RETIRED if host.get_fact(File, path=f"{lib_dir}/{name}")]
