"""torch.version: sandbox stand-in (gpuhost sandbox lab) for PyTorch 2.9.1 built with CUDA 12.8."""

__version__ = "2.9.1+cu128"
cuda = "12.8"
hip = None
debug = False
git_version = "sandbox-stand-in"
