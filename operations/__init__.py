"""gpuhost's pyinfra operations and facts: one module per concern."""

from pathlib import Path

#: The repository's root: templates/, locks/ and the files shipped to hosts are found from it.
REPO_ROOT = Path(__file__).resolve().parent.parent
#: Where the scripts gpuhost ships to a host live there (operations/p2p.py ships the folder).
LIB_DIR = "/opt/gpuhost/lib"
