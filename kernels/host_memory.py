"""Keep the memory XLA:CPU frees, so that the next step does not fault it back in page by page.

    from kernels import host_memory
    host_memory.keep_freed_memory()   # first thing in a command, before JAX is imported

XLA:CPU allocates one temporary buffer each time it runs a compiled step, and frees it when the step
ends: hundreds of MB for the benchmark model's training step (benchmarks/throughput.py). glibc's malloc serves a
block above 32 MB with mmap and gives it back with munmap, so every step maps fresh pages, and the kernel
zeroes each 4 KiB page at its first touch: a page fault for every page of the buffer, every step
(docs/performance.md has what it cost and what this gained).

The fix is three of glibc's documented malloc parameters (mallopt(3)):
- M_MMAP_MAX 0: serve every block from the heap, never from its own mapping;
- M_TRIM_THRESHOLD -1: never give the top of the heap back to the kernel;
- M_ARENA_MAX 1: one arena for every thread. Another thread's arena grows in heaps of at most 64 MB, and
  a larger block there would be mapped anyway.

The freed buffer then stays mapped, and the next step reuses it. The cost: the process keeps its peak
heap until it exits, and its threads share one malloc lock (XLA's threads allocate little outside these
buffers).

The arena limit binds only threads that have not allocated yet, and importing JAX starts a thread. So
`python -m train` calls this before it imports JAX, and so does the benchmarks' training worker. Decoding
does not: with it, decoding ran slower while training ran faster (docs/performance.md). Only glibc has these
parameters; elsewhere (macOS, musl) this does nothing. Set AIAYN_KEEP_FREED_MEMORY=0 to leave malloc as
it is.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8   # <malloc.h>


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
  """Sets glibc's malloc to keep freed memory (see the module docstring). Returns whether it did."""
  if os.environ.get("AIAYN_KEEP_FREED_MEMORY", "1") == "0":
    return False
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return False
  try:
    mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  return all([mallopt(M_ARENA_MAX, 1), mallopt(M_MMAP_MAX, 0), mallopt(M_TRIM_THRESHOLD, -1)])
