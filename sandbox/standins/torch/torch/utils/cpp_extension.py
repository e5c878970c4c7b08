"""torch.utils.cpp_extension: sandbox stand-in. CUDA_HOME is found as PyTorch finds it; the
extension classes exist for setup.py files that import them, and compile nothing."""

import os
import shutil

from setuptools.command.build_ext import build_ext as _build_ext


def _find_cuda_home():
    """CUDA_HOME or CUDA_PATH, else the directory above the nvcc on PATH, else /usr/local/cuda."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home is None:
        nvcc = shutil.which("nvcc")
        if nvcc is not None:
            cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        else:
            cuda_home = "/usr/local/cuda"
            if not os.path.exists(cuda_home):
                cuda_home = None
    return cuda_home


CUDA_HOME = _find_cuda_home()


class BuildExtension(_build_ext):
    @classmethod
    def with_options(cls, **options):
        return cls


def CUDAExtension(name, sources, *args, **kwargs):
    from setuptools import Extension

    return Extension(name, sources, *args, **kwargs)


CppExtension = CUDAExtension
