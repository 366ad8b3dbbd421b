"""Native CPU kernels (torch C++ extensions); built ahead of time by ``python -m specserve.kernels.build``."""
