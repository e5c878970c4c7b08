"""torch.version: sandbox stand-in (gpuhost sandbox lab) for PyTorch 2.9.1 built with CUDA 12.8.

The source tree's own (imported where the tree itself is on sys.path); each stack's wheel gets
the file sandbox/pypi_index.py writes over it (2.11.0+cu130, CUDA 13.0, for CUDA 13.0's)."""

__version__ = "2.9.1+cu128"
cuda = "12.8"
hip = None
debug = False
git_version = "sandbox-stand-in"
