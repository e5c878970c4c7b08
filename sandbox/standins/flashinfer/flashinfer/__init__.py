"""flashinfer: sandbox stand-in (gpuhost sandbox lab) for flashinfer-python. Not FlashInfer.

Imports torch as the real package does; has no kernels. Its version (flashinfer/version.py, as
the real package's) is written by sandbox/pypi_index.py for each stack's release (0.6.3 for
CUDA 12.8, 0.6.15.post1 for CUDA 13.0).
"""

import torch  # noqa: F401  (the real package needs torch at import)

from flashinfer.version import __version__  # noqa: F401

__standin__ = True
