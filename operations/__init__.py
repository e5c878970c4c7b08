"""gpuhost's pyinfra operations and facts: one module per concern."""

from pathlib import Path

#: The repository's root: templates/, locks/ and the files shipped to hosts are found from it.
REPO_ROOT = Path(__file__).resolve().parent.parent
