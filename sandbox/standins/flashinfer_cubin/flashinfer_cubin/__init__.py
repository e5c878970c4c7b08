"""flashinfer_cubin: sandbox stand-in (gpuhost sandbox lab) for flashinfer-cubin 0.6.3."""

__version__ = "0.6.3"
__standin__ = True
