"""Process-wide allocator setting for CPU training: keep freed memory in the heap.

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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

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
