"""torch: sandbox stand-in (gpuhost sandbox lab) for PyTorch 2.9.1+cu128 (CUDA 12.8's stack) and
2.11.0+cu130 (CUDA 13.0's; torch/version.py written by sandbox/pypi_index.py). Not PyTorch.

What it answers comes from the host's scenario hardware file and the stand-in driver's state
(torch/_sandbox.py): torch.cuda.is_available(), device_count(), get_device_capability(),
get_device_name(), get_device_properties(), can_device_access_peer() (from the P2P read status).
Tensors are symbolic: they carry a shape, a dtype, a device and a description of their content,
enough for a copy between GPUs to be written and compared; no arithmetic on data happens.
"""

import builtins as _builtins
import itertools as _itertools
import time as _time

from torch import version  # noqa: F401
from torch.version import __version__  # noqa: F401

__standin__ = True


class dtype:
    def __init__(self, name, itemsize, is_floating_point):
        self._name, self.itemsize, self.is_floating_point = name, itemsize, is_floating_point

    def __repr__(self):
        return "torch." + self._name


float32 = float = dtype("float32", 4, True)
float64 = double = dtype("float64", 8, True)
float16 = half = dtype("float16", 2, True)
bfloat16 = dtype("bfloat16", 2, True)
float8_e4m3fn = dtype("float8_e4m3fn", 1, True)
int64 = long = dtype("int64", 8, False)
int32 = int = dtype("int32", 4, False)
int8 = dtype("int8", 1, False)
uint8 = dtype("uint8", 1, False)
bool = dtype("bool", 1, False)


class device:
    def __init__(self, type, index=None):
        if isinstance(type, device):
            type, index = type.type, type.index
        elif isinstance(type, _builtins.int):
            type, index = "cuda", type
        elif ":" in type:
            type, idx = type.split(":", 1)
            index = _builtins.int(idx)
        if type not in ("cpu", "cuda", "meta"):
            raise RuntimeError(
                "Expected one of cpu, cuda, meta device type at start of device string: " + type
            )
        if type == "cuda" and index is None:
            from torch import cuda as _cuda

            index = _cuda.current_device()
        self.type, self.index = type, index

    def __eq__(self, other):
        other = device(other) if not isinstance(other, device) else other
        return (self.type, self.index) == (other.type, other.index)

    def __hash__(self):
        return hash((self.type, self.index))

    def __repr__(self):
        index = "" if self.index is None else f", index={self.index}"
        return f"device(type='{self.type}'{index})"

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


class Size(tuple):
    def numel(self):
        n = 1
        for d in self:
            n *= d
        return n

    def __repr__(self):
        return f"torch.Size({list(self)})"


_seeds = _itertools.count(1)


class Tensor:
    """A symbolic tensor: `content` describes the data (a fill value, a random draw, a view)."""

    def __init__(self, shape, dtype_, device_, content):
        self.shape, self.dtype, self.device, self._content = Size(shape), dtype_, device_, content

    # placement -----------------------------------------------------------------------------
    def to(self, *args, **kwargs):
        dev, dt = kwargs.get("device"), kwargs.get("dtype")
        for a in args:
            if isinstance(a, dtype):
                dt = a
            elif a is not None:
                dev = a
        dev = self.device if dev is None else _device(dev)
        dt = self.dtype if dt is None else dt
        content = self._content if dt is self.dtype else ("cast", self._content, repr(dt))
        if dev != self.device and dev.type == "cuda":
            _check_device(dev)
        content = _across_gpus(self.device, dev, content, self.nbytes)
        return Tensor(self.shape, dt, dev, content)

    def cuda(self, device=None, non_blocking=False):
        return self.to(_device(device if device is not None else "cuda"))

    def cpu(self):
        return self.to(device("cpu"))

    def copy_(self, src, non_blocking=False):
        if src.shape != self.shape:
            raise RuntimeError(
                f"The size of tensor a ({list(self.shape)}) must match the size "
                f"of tensor b ({list(src.shape)})"
            )
        content = (
            src._content if src.dtype is self.dtype else ("cast", src._content, repr(self.dtype))
        )
        self._content = _across_gpus(src.device, self.device, content, src.nbytes)
        return self

    def clone(self):
        return Tensor(self.shape, self.dtype, self.device, self._content)

    def fill_(self, value):
        self._content = ("fill", value)
        return self

    def zero_(self):
        return self.fill_(0)

    # shape ----------------------------------------------------------------------------------
    def numel(self):
        return self.shape.numel()

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self):
        return len(self.shape)

    def element_size(self):
        return self.dtype.itemsize

    @property
    def nbytes(self):
        return self.numel() * self.element_size()

    @property
    def is_cuda(self):
        return self.device.type == "cuda"

    def view(self, *shape):
        return Tensor(_shape(shape, self.numel()), self.dtype, self.device, self._content)

    reshape = view

    def contiguous(self):
        return self

    # comparisons ----------------------------------------------------------------------------
    def __eq__(self, other):
        same = (
            isinstance(other, Tensor)
            and self._content == other._content
            and self.shape == other.shape
        )
        if not isinstance(other, Tensor):
            same = self._content == ("fill", other)
        return Tensor(self.shape, bool, self.device, ("fill", same))

    __hash__ = object.__hash__

    def all(self):
        return Tensor((), bool, self.device, ("fill", self._content == ("fill", True)))

    def item(self):
        if self._content[0] == "fill":
            return self._content[1]
        raise RuntimeError("sandbox stand-in: item() of a tensor without a known value")

    def sum(self):
        if self._content[0] == "fill":
            return Tensor((), self.dtype, self.device, ("fill", self._content[1] * self.numel()))
        return Tensor((), self.dtype, self.device, ("sum", self._content))

    def __repr__(self):
        shape = list(self.shape)
        return f"tensor(<sandbox stand-in {shape}>, device='{self.device}', dtype={self.dtype!r})"


def _device(d):
    return d if isinstance(d, device) else device(d)


def _across_gpus(src, dst, content, nbytes):
    """What arrives when data moves from device src to device dst. Between two GPUs, torch
    copies peer-to-peer when CUDA reports peer access (it enables it for the copy), else through
    host memory; the scenario's peer_transfers.copy says whether peer copies arrive intact. The
    copy takes nbytes at the stand-in's rates (torch/_sandbox.py)."""
    if src.type != "cuda" or dst.type != "cuda" or src.index == dst.index:
        return content
    from torch import _sandbox

    peer = _sandbox.peer_access(src.index, dst.index)
    _time.sleep(nbytes / (_sandbox.PEER_BYTES_PER_S if peer else _sandbox.STAGED_BYTES_PER_S))
    if peer and _sandbox.peer_transfers()["copy"] == "wrong-data":
        return ("lost-peer-write", next(_seeds))
    return content


def _check_device(dev):
    from torch import cuda as _cuda

    _cuda._lazy_init()
    if dev.index is not None and not 0 <= dev.index < _cuda.device_count():
        raise RuntimeError("CUDA error: invalid device ordinal")


def _shape(size, numel=None):
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    if numel is not None and -1 in size:
        known = 1
        for d in size:
            if d != -1:
                known *= d
        size = tuple(numel // known if d == -1 else d for d in size)
    return tuple(size)


def _new(size, content, dtype=None, device=None, **_):
    dev = _device(device or "cpu")
    if dev.type == "cuda":
        _check_device(dev)
    return Tensor(_shape(size), dtype or float32, dev, content)


def empty(*size, **kw):
    return _new(size, ("empty", next(_seeds)), **kw)


def zeros(*size, **kw):
    return _new(size, ("fill", 0), **kw)


def ones(*size, **kw):
    return _new(size, ("fill", 1), **kw)


def full(size, fill_value, **kw):
    return _new((tuple(size),), ("fill", fill_value), **kw)


def randn(*size, **kw):
    return _new(size, ("random", next(_seeds)), **kw)


rand = randn


def randint(low, high=None, size=(), **kw):
    return _new((tuple(size),), ("random", next(_seeds)), dtype=kw.pop("dtype", int64), **kw)


def arange(*args, **kw):
    n = args[0] if len(args) == 1 else args[1] - args[0]
    return _new((n,), ("arange",) + tuple(args), dtype=kw.pop("dtype", int64), **kw)


def equal(a, b):
    return a.shape == b.shape and a._content == b._content


def manual_seed(seed):
    global _seeds
    _seeds = _itertools.count(seed * 1000003 + 1)


class no_grad:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __call__(self, fn):
        return fn


inference_mode = no_grad

from torch import (
    cuda,  # noqa: F401
    distributed,  # noqa: F401
    utils,  # noqa: F401
)
