"""The source tree's version (0.6.3); each stack's wheel gets the file sandbox/pypi_index.py
writes over it (0.6.15.post1 for CUDA 13.0's)."""

__version__ = "0.6.3"
