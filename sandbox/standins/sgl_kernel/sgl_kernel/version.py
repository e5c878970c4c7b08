"""The source tree's version (sgl-kernel 0.3.21); each stack's wheel gets the file
sandbox/pypi_index.py writes over it (sglang-kernel 0.4.5 for CUDA 13.0's)."""

__version__ = "0.3.21"
