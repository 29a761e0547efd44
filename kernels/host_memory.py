"""Keep the memory XLA:CPU frees, so that the next step does not fault it back in page by page.

    from kernels import host_memory
    if __name__ == "__main__":
      host_memory.keep_freed_memory_on_cpu("train")   # first thing in a command, before JAX is imported

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

It is an XLA:CPU setting, and a GPU or TPU process's host memory is not its business. The backend is not
known before JAX starts, so `expected_backend` tells it from what JAX will look at: JAX_PLATFORMS, then
the accelerator plugins installed (the `jax_plugins` packages and entry points, libtpu). No plugin: JAX
can only run on the CPU. A plugin with no device for it: JAX falls back to the CPU, malloc was left as it
is, and `check_backend` says so once JAX has started.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import importlib.util
import os
import pkgutil
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8   # <malloc.h>
_set_for_cpu = []   # [True] once keep_freed_memory_on_cpu has set malloc


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


def expected_backend() -> str:
  """The platform JAX will choose, told without importing JAX: 'cpu', or the accelerator's plugins."""
  platforms = os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME") or ""
  if platforms.strip():
    return platforms.split(",")[0].strip().lower()
  plugins = {entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")}
  try:
    import jax_plugins   # the namespace package JAX scans; importing it does not import JAX
    plugins |= {module.name for module in pkgutil.iter_modules(jax_plugins.__path__)}
  except ImportError:
    pass
  if importlib.util.find_spec("libtpu") is not None:
    plugins.add("libtpu")
  return ",".join(sorted(plugins)) or "cpu"


def keep_freed_memory_on_cpu(prog: str) -> bool:
  """keep_freed_memory() where JAX will run on the CPU, and prints one line saying so. Call it in a command's
  `if __name__ == "__main__":` before JAX is imported; returns whether malloc was set."""
  if _set_for_cpu:
    return True
  if expected_backend() != "cpu" or not keep_freed_memory():
    return False
  _set_for_cpu.append(True)
  print(f"[{prog}] glibc malloc keeps the memory XLA:CPU frees (kernels/host_memory.py; "
        "AIAYN_KEEP_FREED_MEMORY=0 leaves it as is)", flush=True)
  return True


def check_backend(prog: str, backend: str) -> None:
  """Once JAX has started: says when the expectation that chose the malloc setting was wrong."""
  expected = expected_backend()
  if backend == "cpu" and expected != "cpu" and os.environ.get("AIAYN_KEEP_FREED_MEMORY", "1") != "0":
    print(f"[{prog}] JAX runs on the CPU although {expected} is installed; malloc was left as it is "
          "(JAX_PLATFORMS=cpu sets it, and trains faster on a CPU)", flush=True)
  elif backend != "cpu" and _set_for_cpu:
    print(f"[{prog}] warning: malloc was set for XLA:CPU but JAX runs on {backend}", flush=True)
