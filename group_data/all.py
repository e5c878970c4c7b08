"""Defaults for every host of every inventory.

Each key is one row of the README's host data table; the values not set here take the
defaults in operations/plans/settings.py, the server's from the launch profile
(operations/plans/launch_profiles.py; gpuhost_launch_profile = "reference-lab" is the reference
lab's own launch, ../shared/reference-lab.md).
Set a key here to change it for the whole fleet, in an inventory's host data for one host.

pyinfra executes this file while it builds the inventory, before it connects to any host: the
inventory check runs here (a host given twice with different data, a --limit matching no host).
"""

from operations.runtime import inventory_check

inventory_check.check()

# The server profile: GLM-5-NVFP4 on SGLang at tensor parallel size 8, as launched in the
# reference lab.
gpuhost_model = "lukealonso/GLM-5-NVFP4"
gpuhost_served_model_name = "glm-5"
gpuhost_tensor_parallel_size = 8

# The driver branch and the CUDA stack: branch 580 supports CUDA 12.8, CUDA 13.0 and Blackwell.
# gpuhost_cuda_toolkit picks the toolkit and its lock (locks/cuda12.8.txt, locks/cuda13.0.txt);
# gpuhost_lock, set, names another lock.
gpuhost_driver_branch = "580"
gpuhost_cuda_toolkit = "12.8"
