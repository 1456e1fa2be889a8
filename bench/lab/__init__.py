"""Lab code shared by the scripts in bench/: not part of the splitspec package.

A script run as ``python bench/<script>.py`` has bench/ as ``sys.path[0]``, so it imports ``lab.<module>``; the tests
reach the same modules through pytest's ``pythonpath = ["bench"]`` (pyproject.toml)."""

#: NCCL, torch's symmetric memory and NVSHMEM kept off NVLink multicast (NVLS), which some machines lack
#: (docs/measuring.md): set in the environment before the first collective, and inherited by child processes.
NO_NVLINK_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
