"""flashinfer: sandbox stand-in (gpuhost sandbox lab) for flashinfer-python 0.6.3. Not FlashInfer.

Imports torch as the real package does; has no kernels.
"""

import torch  # noqa: F401  (the real package needs torch at import)

__version__ = "0.6.3"
__standin__ = True
