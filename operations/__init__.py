"""gpuhost's pyinfra operations and facts, one module per concern, in layers that import only
downwards (each folder's README.md says what lives there and what it may import):

- runtime/: the seam with pyinfra (every patch of its internals, checked first)
- facts/: what a host is (pyinfra facts and the tools' parsers)
- plans/: what the run decides (settings, pure decisions, refusals)
- reports/: what the controller says of the figures (bench report, status)
- stages/: what the run changes (the operations deploy.py and bench.py call)
- files/: programs that run on the hosts (the standard library and what is shipped beside them)
"""

#: The layers, lowest first: a module may import its own layer's and those before it
#: (tests/test_import_circles.py holds every import to it).
LAYERS = ("runtime", "facts", "plans", "reports", "stages")

import os
import sys
from pathlib import Path

#: The repository's root: templates/, locks/ and the files shipped to hosts are found from it.
REPO_ROOT = Path(__file__).resolve().parent.parent
#: Where the scripts gpuhost ships to a host live there (operations/stages/p2p.py ships the folder).
LIB_DIR = "/opt/gpuhost/lib"


def cache_root() -> Path | None:
    """gpuhost's folder in the controller's cache (XDG's cache folder, as pip's and others'):
    ``$XDG_CACHE_HOME/gpuhost``, ``~/.cache/gpuhost`` where it is unset or relative (a relative
    one is ignored, as the XDG Base Directory Specification 0.8 says); None where no home is
    known either."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(root):
        root = os.path.expanduser("~/.cache")
    return Path(root) / "gpuhost" if os.path.isabs(root) else None


def _bytecode_in_the_cache() -> None:
    """Keep the bytecode of gpuhost's modules under :func:`cache_root`'s ``bytecode/``.

    pyinfra's CLI turns bytecode writing off (``pyinfra_cli/main.py``: ``sys.dont_write_bytecode
    = True``, pyinfra 3.10) so that no ``__pycache__`` lands in a deploy's folder; every run
    then compiled gpuhost's modules again: 0.37 s of the controller's CPU of a no-op run,
    profiled (docs/development.md). A parallel tree outside the repository
    (``sys.pycache_prefix``, the docs' "sys" module) leaves the folder as clean. Under pyinfra's
    CLI only, and not where the environment asks for no bytecode (PYTHONDONTWRITEBYTECODE) or
    for a tree of its own (PYTHONPYCACHEPREFIX)."""
    if ("pyinfra_cli" not in sys.modules or os.environ.get("PYTHONDONTWRITEBYTECODE")
            or sys.pycache_prefix is not None):
        return
    root = cache_root()
    if root is not None:
        sys.pycache_prefix = str(root / "bytecode")
        sys.dont_write_bytecode = False


_bytecode_in_the_cache()

# the installed pyinfra checked against what gpuhost patches, before the first patch: one line
# naming each symbol that no longer fits, before any host is touched
# (operations/runtime/pyinfra_seam.py)
from operations.runtime import pyinfra_seam  # noqa: E402

if pyinfra_seam.read_before_patching():
    from operations.runtime.run_exit import end_run

    end_run("gpuhost: " + "; ".join(pyinfra_seam.SEEN))

# before any fact class of gpuhost's is defined: pyinfra's FactBase.__init_subclass__ lists the
# global arguments at each (operations/runtime/global_arguments.py)
from operations.runtime import global_arguments  # noqa: E402

global_arguments.install()
