"""The lent GPU machine (the device tool's nvidia-h200 and nvidia-h200-x2 kinds): H200s, compute
capability 9.0, driver 580.159.04 mounted from the hypervisor, reached with pyinfra's @local
connector on the machine itself. Used for dry runs only: nothing can be installed there (no
package index reachable).

    pyinfra inventory/h200.py deploy.py --dry                      # nvidia-h200: one GPU
    GPUHOST_H200_GPUS=2 pyinfra inventory/h200.py deploy.py --dry  # nvidia-h200-x2

The GPU count is the inventory's claim, which preflight checks against nvidia-smi; the tensor
parallel size follows it (one server over every GPU).
"""

import os

GPUS = int(os.environ.get("GPUHOST_H200_GPUS", "1"))

gpu_hosts = [
    (
        "@local",
        {
            "gpuhost_gpu_count": GPUS,
            "gpuhost_compute_capability": "9.0",
            "gpuhost_tensor_parallel_size": GPUS,
            # nvidia-smi there reports CUDA 13.0 (driver 580): the 12.8 stack runs on it too.
            "gpuhost_cuda_toolkit": "12.8",
            # The driver there is mounted from the hypervisor, installed by no package.
            "gpuhost_unpackaged_driver": "keep",
        },
    ),
]
