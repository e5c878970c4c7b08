"""flash_attn.cute: sandbox stand-in (gpuhost sandbox lab) for flash-attn-4 4.0.0b19. No kernels.

The real wheel (flash_attn_4-4.0.0b19-py3-none-any.whl) puts its files under flash_attn/cute/
only (no flash_attn/__init__.py: flash_attn is a namespace package there), reads its version
from the installed distribution's metadata, and exports flash_attn_func and
flash_attn_varlen_func (flash_attn/cute/__init__.py).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flash-attn-4")
except PackageNotFoundError:
    __version__ = "0.0.0"

__standin__ = True


def flash_attn_func(*args, **kwargs):
    raise NotImplementedError("flash_attn.cute sandbox stand-in: no kernels")


flash_attn_varlen_func = flash_attn_func

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
