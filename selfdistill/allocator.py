"""Process-wide memory settings for CPU training: keep freed memory in the heap, and bound
oneDNN's kernel caches.

glibc's malloc serves every request above its mmap threshold (128 KiB to 32 MiB, adaptive) with
a fresh `mmap` and gives it back on `free`. A training step allocates and frees hundreds of
tensors of megabytes ((B, T, 1536) activations, (B·T, V) logits), so each new tensor is fresh
pages the kernel must fault in and zero: measured on a 2-core AVX2 EPYC, a student
forward+backward of the default model (32 rows × 74 columns) spent 1 min 24 s of a 5 min 22 s
job in the kernel, `log_softmax` over (768, 49152) took 460 ms instead of 33 ms, and one update
took 17.4 s instead of 12.5–15.0 s (separate runs on a shared machine). With `mmap` off for the
heap and no trimming, freed blocks are reused and the pages stay mapped: the process does not
hand memory back to the system until it exits (its effect on peak RSS is not measured yet).

`SELFDISTILL_MALLOC=system` (environment) leaves glibc's defaults alone.

oneDNN (bf16 matmuls on the CPU, the packed decode weights of `rollout.weights`) compiles a
kernel for every new input shape and keeps it in two caches of 1024 entries each by default
(oneDNN's primitive cache and ideep's, PyTorch's C++ wrapper). Sequence lengths change from
batch to batch, so a training run keeps compiling: measured on a 2-core AVX512-BF16 EPYC, the
vs-TRL lean settings in bf16 (micro-batches of 2) grew by ~30 MiB a step, 1672 → 2400 MiB peak
RSS over 25 steps and still rising, at the same step time as with 64 entries each (1662 → 1741
MiB, flat after step 12). `bound_kernel_caches` sets both capacities (the CLI does, at start).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

KERNEL_CACHE_CAPACITY = 64
"""Kernels each oneDNN cache keeps (`bound_kernel_caches`); about 0.5 MiB each."""
# each cache's environment variable, with the older name oneDNN also reads
_KERNEL_CACHES = (("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"),
                  ("LRU_CACHE_CAPACITY",))
# <malloc.h> parameter numbers (glibc).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1


def keep_freed_memory() -> bool:
    """Tell glibc malloc to serve large blocks from the heap and never trim it; returns whether
    the setting was applied (False: not glibc, or `SELFDISTILL_MALLOC=system`). Affects
    allocations made after the call; call it once, early (the CLI does)."""
    if os.environ.get("SELFDISTILL_MALLOC", "").lower() == "system":
        return False
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> dict[str, str]:
    """Cap oneDNN's primitive cache and ideep's kernel cache at `capacity` entries each (module
    docstring); a capacity the environment already sets is kept. oneDNN reads them when it
    first runs a kernel: call this before any tensor work (importing torch is fine). Returns
    the capacities in force, by variable name."""
    for names in _KERNEL_CACHES:
        if not any(name in os.environ for name in names):
            os.environ[names[0]] = str(capacity)
    return {name: os.environ[name] for names in _KERNEL_CACHES for name in names
            if name in os.environ}
