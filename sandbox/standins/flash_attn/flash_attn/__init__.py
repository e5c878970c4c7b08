"""flash_attn: sandbox stand-in (gpuhost sandbox lab) for FlashAttention 2.8.3.post2. No kernels.

build_env.json (beside this file) records what the build was given: MAX_JOBS, NVCC_THREADS,
FLASH_ATTN_CUDA_ARCHS, the nvcc it found and the torch it built against.
"""

import json as _json
import os as _os

__version__ = "2.8.3.post2"
__standin__ = True


def build_env():
    """What setup.py recorded when this package was built (dict)."""
    with open(_os.path.join(_os.path.dirname(__file__), "build_env.json")) as fh:
        return _json.load(fh)


def flash_attn_func(*args, **kwargs):
    raise NotImplementedError("flash_attn sandbox stand-in: no kernels")


flash_attn_varlen_func = flash_attn_qkvpacked_func = flash_attn_func
