"""The source tree's version (0.5.9); each stack's wheel gets the file sandbox/pypi_index.py
writes over it (0.5.17 for CUDA 13.0's)."""

__version__ = "0.5.9"
