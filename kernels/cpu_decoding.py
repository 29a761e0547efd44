"""The CPU decoding backend's C++ kernels (kernels/cpu_decoding.cc) as XLA FFI custom calls: a decoding
step's attention (one call per attention), its products by the decoder's weights laid out as panels, and
beam search's choice of candidates.

    heads = cpu_decoding.slot_attention(q, k, v, slot, index)     # self-attention, beam slots or not
    heads = cpu_decoding.masked_attention(q, keys, values, mask)  # cross-attention
    y = cpu_decoding.panel_matmul(x, panels, columns)             # x times panels (kernels/output_layer.py)
    values, index = cpu_decoding.beam_extensions(logits, alive_logp, mode, n, eos_id)

Only decoding on a CPU uses them (kernels/cpu_backend.py's decoding, with kernels "cpu", or "auto" on a
CPU host): nothing here runs at import, model.init or in training. The library is built and registered the
first time a decoding program is traced (`available()`), and every call goes through `on_cpu`, so the
custom call is in the program only where it is lowered for a CPU; a program lowered for a GPU or TPU
(jax.export from a CPU host included) carries the XLA ops that compute the same instead.

In a decoding step XLA:CPU runs each attention as about a dozen small ops (scores, mask, max, exp, sum,
divide, weighted sum, transposes), and at the default model's sizes the dispatch of each costs more than
its arithmetic (docs/performance.md). The C++ kernel does the same float32 arithmetic in one call, and
reads only the positions decoded so far. Same results as kernels/decode_cache.py's XLA attention up to
float rounding (tests/test_kernels.py). beam_extensions is decode/beam_search.py's select_extensions
(log_softmax, the eos masks, the top 2k of k * vocab scores) in one call, with the same picks. Each call
shares its work with XLA's intra-op thread pool (one thread per core the process may use), with the same
bits on any number of threads.

The source is compiled once per machine with the C++ compiler (`c++`, or $CXX) and the XLA FFI headers
that ship with jaxlib, into ~/.cache/aiayn (or $AIAYN_CACHE), keyed by the source, jaxlib's version, the
CPU's flags and the compiler command. Without a compiler, or with AIAYN_CPU_DECODING=0 (the older
AIAYN_CPU_ATTENTION=0 too), `available()` is False and decoding uses the XLA ops instead (with a warning
when the build failed).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import kernels

SOURCE = pathlib.Path(__file__).with_name("cpu_decoding.cc")
TARGETS = {"aiayn_slot_attention": "AiaynSlotAttention", "aiayn_masked_attention": "AiaynMaskedAttention",
           "aiayn_beam_extensions": "AiaynBeamExtensions", "aiayn_panel_matmul": "AiaynPanelMatmul"}


# With -march=native the vector width is this machine's (cpu_decoding.cc); AIAYN_CPU_MARCH names another
# target, e.g. x86-64-v3 (AVX2) to run an AVX2 machine's code on an AVX-512 one (benchmarks/throughput.py
# --isa avx2).
FLAGS = ["-O3", "-std=c++17"]


def _cache_dir() -> pathlib.Path:
  root = os.environ.get("AIAYN_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                       os.path.expanduser("~/.cache"), "aiayn")
  return pathlib.Path(root)


def _cpu_flags() -> str:
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("flags"):
        return line
  except OSError:
    pass
  return ""


def find_compiler() -> str | None:
  """The C++ compiler the kernel is built with: $CXX, else c++ or g++ on the PATH (None without one)."""
  return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build(compiler: str | None = None) -> pathlib.Path:
  """Compiles cpu_decoding.cc (once: the library is cached) and returns the shared library's path.
  Raises RuntimeError with the compiler's message if it fails."""
  compiler = compiler or find_compiler()
  if not compiler:
    raise RuntimeError("no C++ compiler (c++ or g++, or $CXX) on the PATH")
  flags = [*FLAGS, f"-march={os.environ.get('AIAYN_CPU_MARCH') or 'native'}", "-shared", "-fPIC",
           f"-I{jax.ffi.include_dir()}"]
  key = hashlib.sha256("\n".join([SOURCE.read_text(), jax.lib.__version__, _cpu_flags(), compiler, *flags])
                       .encode()).hexdigest()[:16]
  target = _cache_dir() / f"cpu_decoding-{key}.so"
  if target.exists():
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=target.parent) as tmp:   # built aside, then moved in whole
    built = pathlib.Path(tmp) / target.name
    command = [compiler, *flags, str(SOURCE), "-o", str(built)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
      raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    os.replace(built, target)
  return target


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether the custom calls are built and registered (building them on the first call)."""
  if os.environ.get("AIAYN_CPU_DECODING", os.environ.get("AIAYN_CPU_ATTENTION", "1")) == "0":
    return False
  try:
    library = _library()
  except (RuntimeError, OSError) as error:
    warnings.warn(f"kernels/cpu_decoding.py: the C++ decoding kernels are not available, decoding uses "
                  f"XLA ops ({error})", stacklevel=2)
    return False
  for name, symbol in TARGETS.items():
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
  return True


def _require(what: str) -> None:
  """Registers the custom calls (available()); RuntimeError naming `what` where they cannot be."""
  if not available():
    raise RuntimeError(f"kernels/cpu_decoding.py: {what} is not available (see the warning above)")


def _call(target, out, **attributes):
  """jax.ffi.ffi_call of one of our targets, registering them first."""
  _require(target)
  return jax.ffi.ffi_call(target, out, **attributes)


def on_cpu(kernel, elsewhere, *arrays, **static):
  """kernel(*arrays, **static) where the program is lowered for a CPU, elsewhere(*arrays, **static) (the
  XLA ops computing the same) on every other platform, chosen by kernels.platform_dependent: a plain jit
  traces its own platform's one; a program exported for several platforms traces both and lowering keeps
  each platform's, so the custom call never reaches a GPU or TPU program and the CPU program is the
  kernel alone."""
  return kernels.platform_dependent(*arrays, cpu=functools.partial(kernel, **static),
                                    default=functools.partial(elsewhere, **static))


def _library():
  return ctypes.cdll.LoadLibrary(str(build()))   # the same handle again once loaded


@functools.lru_cache(maxsize=None)
def panel_width() -> int:
  """The columns per panel that panel_matmul reads (two of this CPU's vector registers of floats).
  Registers the custom calls; raises RuntimeError where they are not available()."""
  _require("aiayn_panel_width")
  width = _library().aiayn_panel_width
  width.restype = ctypes.c_int64
  return int(width())


def panel_matmul(x, panels, columns=None):
  """x float32 [n, d] times weights laid out as panels float32 [count, d, panel_width()] (column
  p * width + c of the [d, count * width] matrix at panels[p, :, c]) -> float32 [n, columns]: the first
  `columns` of the product (default all; the rest of the last panel, its padding, is not written).

  For the few rows of a decoding step: one panel is one contiguous run of weights, each loaded once for
  up to 8 rows (docs/performance.md has what it gained over XLA's dot). Ranges of panels are shared with
  XLA's intra-op thread pool."""
  columns = panels.shape[0] * panels.shape[2] if columns is None else columns
  out = jax.ShapeDtypeStruct((x.shape[0], columns), jnp.float32)
  return _call("aiayn_panel_matmul", out)(x.astype(jnp.float32), panels)


def slot_attention(q, k, v, slot, index):
  """q float32 [b, j, h, d] (already scaled by 1/sqrt(d)); k [b * s, h, d, L] (positions last) and
  v [b * s, h, L, dv] (row r * s + i: slot i of sentence r); slot int32 [b * j, L]: for query j of
  sentence r, the slot that holds each position; index: the last position to attend to.
  Returns float32 [b, j, h, dv]."""
  b, j, h, _ = q.shape
  out = jax.ShapeDtypeStruct((b, j, h, v.shape[-1]), jnp.float32)
  return _call("aiayn_slot_attention", out)(
      q.astype(jnp.float32), k, v, slot.astype(jnp.int32), jnp.asarray(index, jnp.int32))


def masked_attention(q, k, v, mask):
  """q float32 [b, j, h, d] (already scaled); k [b, h, d, S] (positions last), v [b, h, S, dv]; mask
  bool [b, S]. Returns float32 [b, j, h, dv]: the j queries of each sentence against its unmasked
  positions."""
  b, j, h, _ = q.shape
  out = jax.ShapeDtypeStruct((b, j, h, v.shape[-1]), jnp.float32)
  return _call("aiayn_masked_attention", out)(q.astype(jnp.float32), k, v, mask.astype(bool))



def beam_extensions(logits, alive_logp, mode, n, eos_id):
  """decode.beam_search.select_extensions as one custom call: the n best extensions of every sentence.

  logits float32 [b, k, vocab]; alive_logp float32 [b, k]; mode int32 [b] (decode/beam_search.py's FREE,
  NO_EOS, ONLY_EOS, DEAD). Returns (values float32 [b, n], flat indices int32 [b, n]), best first. A row
  with NaN or infinite logits (a diverged model) has NaN totals, which are never picked: slots left empty
  hold NaN at the lowest indices, so every index stays in range.

  XLA:CPU makes four passes over the [b * k, vocab] logits with an op each (log_softmax's max, its exp
  and sum, the subtraction, the chunk maxima of top_extensions); the kernel reads each row twice for the
  log-sum-exp and once more, in blocks skipped with one vector compare, for the few tokens that can still
  enter the n best.
  """
  b, k = alive_logp.shape
  out = (jax.ShapeDtypeStruct((b, n), jnp.float32), jax.ShapeDtypeStruct((b, n), jnp.int32))
  return _call("aiayn_beam_extensions", out)(
      logits.reshape(b, k, -1).astype(jnp.float32), alive_logp.astype(jnp.float32), mode.astype(jnp.int32),
      eos_id=np.int32(eos_id))
