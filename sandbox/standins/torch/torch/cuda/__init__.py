"""torch.cuda: sandbox stand-in. The devices are the scenario's GPUs (torch/_sandbox.py)."""

import time as _time
import warnings as _warnings

from torch import _sandbox

_current = 0
_initialized = False


class CudaError(RuntimeError):
    pass


class OutOfMemoryError(RuntimeError):
    pass


def _problem():
    return _sandbox.driver_problem()


def is_available():
    """True when the driver is usable and at least one GPU is visible (as torch answers)."""
    problem = _problem()
    if problem is not None and problem[0] != 35:
        # torch warns once from cudaGetDeviceCount when the driver is there but unusable
        code, message = problem
        _warnings.warn(
            "CUDA initialization: Unexpected error from cudaGetDeviceCount(). Did you "
            "run some cuda functions before calling NumCudaDevices() that might have "
            f"already set an error? Error {code}: {message} (Triggered internally at "
            "/pytorch/c10/cuda/CUDAFunctions.cpp:109.)",
            UserWarning,
            stacklevel=2,
        )
    return device_count() > 0


def device_count():
    return len(_sandbox.visible_gpus())


def is_initialized():
    return _initialized


def init():
    _lazy_init()


def _lazy_init():
    global _initialized
    if _initialized:
        return
    problem = _problem()
    if problem is not None:
        if problem[0] == 35:
            raise RuntimeError(problem[1])
        code, message = problem
        raise RuntimeError(
            "Unexpected error from cudaGetDeviceCount(). Did you run some cuda "
            "functions before calling NumCudaDevices() that might have already set "
            f"an error? Error {code}: {message}"
        )
    if device_count() == 0:
        raise RuntimeError("No CUDA GPUs are available")
    _initialized = True


def _gpu(device=None):
    _lazy_init()
    idx = _index(device)
    gpus = _sandbox.visible_gpus()
    if not 0 <= idx < len(gpus):
        raise AssertionError("Invalid device id")
    return gpus[idx]


def _index(device):
    if device is None:
        return _current
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        return int(device.split(":", 1)[1]) if ":" in device else _current
    return device.index if device.index is not None else _current


def current_device():
    return _current


def set_device(device):
    global _current
    idx = _index(device)
    _gpu(idx)
    _current = idx


class device:
    """Context manager that changes the current device."""

    def __init__(self, device):
        self.idx, self.prev = _index(device), None

    def __enter__(self):
        global _current
        self.prev, _current = _current, self.idx

    def __exit__(self, *exc):
        global _current
        _current = self.prev
        return False


def get_device_name(device=None):
    return _gpu(device)["name"]


def get_device_capability(device=None):
    major, minor = _gpu(device)["compute_cap"].split(".")
    return int(major), int(minor)


def get_arch_list():
    # PyTorch 2.9.1+cu128's build targets
    return ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


class _CudaDeviceProperties:
    def __init__(self, gpu):
        major, minor = gpu["compute_cap"].split(".")
        bus = gpu["pci_bus_id"]
        self.name = gpu["name"]
        self.major, self.minor = int(major), int(minor)
        self.total_memory = gpu["cuda_total_memory_bytes"]
        self.multi_processor_count = gpu.get("multiprocessor_count") or 0
        self.uuid = gpu["uuid"][4:]
        self.pci_domain_id = int(bus[0:8], 16)
        self.pci_bus_id = int(bus[9:11], 16)
        self.pci_device_id = int(bus[12:14], 16)
        self.is_integrated = 0
        self.is_multi_gpu_board = 0

    def __repr__(self):
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
            f"minor={self.minor}, total_memory={self.total_memory // (1024 * 1024)}MB, "
            f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
            f"pci_bus_id={self.pci_bus_id}, pci_device_id={self.pci_device_id}, "
            f"pci_domain_id={self.pci_domain_id})"
        )


def get_device_properties(device=None):
    return _CudaDeviceProperties(_gpu(device))


def can_device_access_peer(device, peer_device):
    """What cudaDeviceCanAccessPeer answers: the scenario's P2P read and write status are OK."""
    _gpu(device), _gpu(peer_device)
    return _sandbox.peer_access(_index(device), _index(peer_device))


def mem_get_info(device=None):
    gpu = _gpu(device)
    total = gpu["cuda_total_memory_bytes"]
    return total - gpu.get("memory_used_mib", 0) * 1024 * 1024, total


def synchronize(device=None):
    _gpu(device)


def empty_cache():
    pass


def memory_allocated(device=None):
    return 0


class Event:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing, self._t = enable_timing, None

    def record(self, stream=None):
        self._t = _time.perf_counter()

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end_event):
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        return (end_event._t - self._t) * 1000.0


from torch.cuda import nccl  # noqa: F401
