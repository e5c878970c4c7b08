"""sgl_kernel: sandbox stand-in (gpuhost sandbox lab) for sgl-kernel 0.3.21. No kernels."""

__version__ = "0.3.21"
__standin__ = True
