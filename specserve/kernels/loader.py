"""Build and load our C++ CPU kernels (torch extensions) on first use, into the specserve cache.

Each kernel is one source file in this folder, compiled with ``-O3 -fopenmp`` (``at::parallel_for`` is inline
OpenMP and shares torch's thread pool) plus ``-mavx2 -mfma`` when the CPU has them; the build is cached under
``$SPECSERVE_CACHE_DIR/torch_extensions`` (default ``~/.cache/specserve``). A kernel that cannot be built, or
whose ``SPECSERVE_DISABLE_*`` variable is set, loads as None and callers keep their plain-torch path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent


def cpu_has_avx2_fma() -> bool:
    """Whether this machine's CPU runs AVX2 and FMA (read from /proc/cpuinfo, else torch's dispatch level)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return {"avx2", "fma"} <= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


# torch's extension builder takes ``<build_dir>/lock`` (a file created exclusively, deleted when done) and waits for
# it forever: a process killed while holding it (even one that only loaded a cached build) would hang every later
# start without a word. So every builder first takes this lock, an flock(2) that the kernel releases when its
# holder dies; whoever holds it is the only builder, and a torch lock file found then is a dead process's.
BUILDER_LOCK = "builder.flock"


@contextlib.contextmanager
def builder_lock(build_dir: Path) -> Iterator[None]:
    """Hold ``build_dir``'s builder lock (waiting for a live holder, logged) and clear a dead builder's torch lock
    file inside it."""
    with open(build_dir / BUILDER_LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building the kernel in %s", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing the build lock of a process that died while building: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass(frozen=True)
class CpuKernel:
    name: str  # extension module base name; "_avx2" or "_scalar" is appended
    source: str  # file name in specserve/kernels
    disable_env: str  # set this variable to keep the torch path
    extra_cflags: tuple[str, ...] = ()

    @property
    def module_name(self) -> str:
        return self.name + ("_avx2" if cpu_has_avx2_fma() else "_scalar")

    @property
    def build_dir(self) -> Path:
        from specserve.models.fetch import cache_dir
        return cache_dir() / "torch_extensions" / self.module_name

    def build(self) -> ModuleType:
        """Compile (or load the cached build); raises on failure."""
        from torch.utils.cpp_extension import load

        flags = ["-O3", "-fopenmp", *self.extra_cflags]
        if cpu_has_avx2_fma():
            flags += ["-mavx2", "-mfma"]
        self.build_dir.mkdir(parents=True, exist_ok=True)
        with builder_lock(self.build_dir):
            return load(name=self.module_name, sources=[str(KERNEL_DIR / self.source)], extra_cflags=flags,
                        extra_ldflags=["-fopenmp"], build_directory=str(self.build_dir), verbose=False)

    def load(self) -> ModuleType | None:
        """The compiled module (built once per process), or None (logged) when disabled or unbuildable."""
        return _load(self)


@functools.cache
def _load(kernel: CpuKernel) -> ModuleType | None:
    if os.environ.get(kernel.disable_env):
        logger.info("%s disabled by $%s", kernel.name, kernel.disable_env)
        return None
    try:
        return kernel.build()
    except Exception as exc:  # compiler or ninja missing, unsupported platform, ...
        logger.warning("%s unavailable, keeping the torch path: %s", kernel.name, exc)
        return None
