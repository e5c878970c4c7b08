"""sgl_kernel: sandbox stand-in (gpuhost sandbox lab) for sgl-kernel 0.3.21 (CUDA 12.8's stack)
and sglang-kernel 0.4.5 (CUDA 13.0's: the distribution renamed, the import package still
sgl_kernel). No kernels. sgl_kernel/version.py, as the real package's, is written by
sandbox/pypi_index.py for each release."""

from sgl_kernel.version import __version__  # noqa: F401

__standin__ = True
