"""Decoding caches for XLA:CPU: head-major keys and values stored in the matmul dtype, and beam slots.

Same methods as model.cache.KVCache (the reference, position-major, gathered by beam search), same
results up to float rounding:

- HeadMajorCache: keys [n, h, L, d_k] and values [n, h, L, d_v]. With heads before positions both
  attention matmuls read the (long) cache as it lies in memory; the position-major layout makes XLA:CPU
  transpose the whole cache at every step. With mixed precision the cache (self and cross) is stored
  already rounded to the matmul dtype: the matmuls would round it anyway, so the numbers are the same at
  half the memory.
- BeamSlotCache: for beam search, keys and values are never reordered. Row r*k + j's cache is beam
  *slot* j of sentence r, written by whichever hypothesis held the slot at each step; 'slot_history'
  int32 [n, L] names, per row and position, the slot holding that entry, and only it is reordered. Each
  hypothesis attends over (slot, position) jointly (`beam_attention`), k times the small attention
  arithmetic of one step instead of copying every layer's cache at every step. Its keys are stored
  [n, h, d_k, L], positions last, so that the scores' sum over d_k adds whole rows of positions (SIMD
  lanes side by side) rather than summing across the lanes of each d_k-vector.

With ffi=True (float32 only; model/ops.py sets it where kernels/cpu_decoding.py's C++ kernel built),
both caches attend through that kernel, one custom call per attention, and every key (self and cross) is
stored positions-last, [n, h, d_k, L], which is how the kernel reads them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kernels import MASKED, cpu_decoding
from kernels.mixed_matmul import einsum


def _weighted_values(spec, weights, v, dtype, matmul_dtype):
  """The attention weights (float32) times the values, in `dtype` (or mixed precision)."""
  if matmul_dtype is None:
    return jnp.einsum(spec, weights.astype(dtype), v.astype(dtype))
  return einsum(spec, weights, v, matmul_dtype).astype(dtype)


def _scaled(q):
  """Queries times 1/sqrt(d_k), as the XLA attention scales them."""
  return q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)


def _softmax(logits, mask, axis):
  """The softmax of the caches' attention (both layouts), over `axis`, of the logits a query may see."""
  return jax.nn.softmax(jnp.where(mask, logits, MASKED), axis=axis)


def cached_attention(q, k, v, mask, dtype=jnp.float32, matmul_dtype=None):
  """q [b, q_len, h, d_k] against head-major k [b, h, kv_len, d_k] and v [b, h, kv_len, d_v]; mask bool
  broadcastable to [b, h, q_len, kv_len]. Returns [b, q_len, h, d_v] in `dtype`."""
  scale = q.shape[-1] ** -0.5
  q = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)                 # [b, h, q_len, d_k] (small)
  k = k if matmul_dtype is not None else k.astype(q.dtype)  # (mixed: the cache is stored rounded)
  logits = einsum("bhqd,bhkd->bhqk", q, k, matmul_dtype)                  # float32 [b, h, q_len, kv_len]
  weights = _softmax(logits, mask, axis=-1)
  out = _weighted_values("bhqk,bhkd->bhqd", weights, v, dtype, matmul_dtype)  # [b, h, q_len, d_v]
  return jnp.swapaxes(out, 1, 2)                                            # [b, q_len, h, d_v]


def beam_attention(q, k, v, mask, dtype=jnp.float32, matmul_dtype=None):
  """Attention of each sentence's k hypotheses against the caches of all k of its beam slots.

  q: [b, k, h, d_k] (hypothesis j of sentence r is row r*k + j); k: [b, k, h, d_k, L] (positions last)
  and v: [b, k, h, L, d_v], the caches of the sentence's k slots; mask: bool [b, k, 1, k, L],
  True where slot s's entry at position t belongs to hypothesis j's history (mask[r, s, 0, j, t]).
  The softmax runs over (slot, position) jointly. Returns [b, k, h, d_v] in `dtype`.
  """
  scale = q.shape[-1] ** -0.5
  q = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)                 # [b, h, j, d_k] (small)
  if matmul_dtype is not None:   # round the operands as a mixed-precision matmul would
    q, k = q.astype(matmul_dtype), k.astype(matmul_dtype)
  # A multiply-and-sum rather than a batched matmul: XLA:CPU fuses it into one pass over the keys.
  logits = jnp.sum(q[:, None, :, :, :, None].astype(jnp.float32)
                   * k[:, :, :, None].astype(jnp.float32), axis=-2)        # [b, s, h, j, L]
  weights = _softmax(logits, mask, axis=(1, 4))                            # over (slot, position)
  out = _weighted_values("bshjt,bshtd->bshjd", weights, v, dtype, matmul_dtype)  # [b, s, h, j, d_v]
  return jnp.swapaxes(jnp.sum(out, axis=1), 1, 2)                          # [b, j, h, d_v]


def slot_attention(q, k, v, slot, index, dtype=jnp.float32):
  """XLA's kernels/cpu_decoding.slot_attention (same arguments, q not yet scaled): q [b, j, h, d_k];
  keys positions-last k [b * s, h, d_k, L], v [b * s, h, L, d_v]; slot int32 [b * j, L]. Returns
  [b, j, h, d_v] in `dtype`."""
  b, j = q.shape[:2]
  s, length = k.shape[0] // b, k.shape[-1]
  wrote = slot.reshape(b, 1, 1, j, length) == jnp.arange(s)[None, :, None, None, None]   # [b, s, 1, j, L]
  slots = lambda c: c.reshape((b, s) + c.shape[1:])
  return beam_attention(q, slots(k), slots(v), wrote & (jnp.arange(length) <= index), dtype)


def masked_attention(q, k, v, mask, dtype=jnp.float32):
  """XLA's kernels/cpu_decoding.masked_attention (q not yet scaled): q [b, j, h, d_k]; keys positions-last
  k [b, h, d_k, S], v [b, h, S, d_v]; mask bool [b, S]. Returns [b, j, h, d_v] in `dtype`."""
  return beam_attention(q, k[:, None], v[:, None], mask[:, None, None, None, :], dtype)


def _ffi(kernel, elsewhere, q, *arrays):
  """The C++ kernel (queries scaled as it takes them) where lowered for a CPU, elsewhere XLA's."""
  return cpu_decoding.on_cpu(lambda q, *a: kernel(_scaled(q), *a), elsewhere, q, *arrays)


def _write_keys_last(layer_cache, k_new, v_new, index):
  """Keys [n, 1, h, d_k] into [n, h, d_k, L], values [n, 1, h, d_v] into [n, h, L, d_v], at `index`."""
  k_cache, v_cache = layer_cache["k"], layer_cache["v"]
  k = jax.lax.dynamic_update_slice_in_dim(
      k_cache, jnp.transpose(k_new, (0, 2, 3, 1)).astype(k_cache.dtype), index, axis=3)
  v = jax.lax.dynamic_update_slice_in_dim(
      v_cache, jnp.swapaxes(v_new, 1, 2).astype(v_cache.dtype), index, axis=2)
  return k, v


@dataclasses.dataclass(frozen=True)
class HeadMajorCache:
  """See the module docstring. matmul_dtype: None, or the operand dtype of mixed precision."""
  num_layers: int
  num_heads: int
  d_k: int
  d_v: int
  dtype: Any
  matmul_dtype: Any = None
  ffi: bool = False   # attend through kernels/cpu_decoding.py (float32, no matmul_dtype)

  def init(self, batch_size: int, max_len: int) -> dict:
    dtype = self.matmul_dtype or self.dtype   # only matmuls read it: stored rounded
    keys = (self.d_k, max_len) if self.ffi else (max_len, self.d_k)           # positions last for ffi
    layer = lambda: {"k": jnp.zeros((batch_size, self.num_heads) + keys, dtype),
                     "v": jnp.zeros((batch_size, self.num_heads, max_len, self.d_v), dtype)}
    return {"index": jnp.zeros((batch_size,), jnp.int32),
            "layers": [layer() for _ in range(self.num_layers)]}

  def length(self, cache: dict) -> int:
    return cache["layers"][0]["v"].shape[2]   # values are [n, h, L, d_v] in every layout

  def start_step(self, cache: dict, index, num_sentences: int):
    return {}, None

  def prepare_cross(self, keys, values):
    """[b, src_len, h, d] -> head-major [b, h, src_len, d], rounded once for mixed precision."""
    dtype = self.matmul_dtype or keys.dtype
    if self.ffi:   # keys positions-last, [b, h, d_k, src_len]
      return jnp.transpose(keys, (0, 2, 3, 1)).astype(dtype), jnp.swapaxes(values, 1, 2).astype(dtype)
    return jnp.swapaxes(keys, 1, 2).astype(dtype), jnp.swapaxes(values, 1, 2).astype(dtype)

  def _write(self, layer_cache, k_new, v_new, index):
    if self.ffi:
      return _write_keys_last(layer_cache, k_new, v_new, index)
    write = lambda cache, new: jax.lax.dynamic_update_slice_in_dim(
        cache, jnp.swapaxes(new, 1, 2).astype(cache.dtype), index, axis=2)
    return write(layer_cache["k"], k_new), write(layer_cache["v"], v_new)   # [n, h, L, d]

  def attend_self(self, attend, q, k_new, v_new, layer_cache: dict, index, context, mask):
    """mask bool [n, 1, 1, L]: the model's (model/attention.py's visible). The C++ kernel reads the
    positions up to `index` instead, which is the same for every config that cpu_backend.CACHES takes."""
    del attend, context
    k, v = self._write(layer_cache, k_new, v_new, index)
    if self.ffi:   # a plain cache is one slot per row
      slot = jnp.zeros((k.shape[0], k.shape[3]), jnp.int32)
      return _ffi(cpu_decoding.slot_attention, slot_attention, q, k, v, slot, index), {"k": k, "v": v}
    return cached_attention(q, k, v, mask, self.dtype, self.matmul_dtype), {"k": k, "v": v}

  def attend_cross(self, attend, q, keys, values, mask):
    del attend
    if self.ffi:
      return _ffi(cpu_decoding.masked_attention, masked_attention, q, keys, values,
                  mask.reshape(mask.shape[0], -1))
    return cached_attention(q, keys, values, mask, self.dtype, self.matmul_dtype)

  def reorder(self, cache: dict, rows) -> dict:
    return jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0), cache)


class BeamSlotCache(HeadMajorCache):
  """See the module docstring; reorder with `reorder` (beam_search(..., reorder=...))."""

  def init(self, batch_size: int, max_len: int) -> dict:
    cache = super().init(batch_size, max_len)
    if not self.ffi:   # (with ffi the head-major cache already stores its keys positions-last)
      for layer in cache["layers"]:
        layer["k"] = jnp.swapaxes(layer["k"], 2, 3)                           # [n, h, d_k, L]
    cache["slot_history"] = jnp.zeros((batch_size, max_len), jnp.int32)
    return cache

  def _write(self, layer_cache, k_new, v_new, index):
    return _write_keys_last(layer_cache, k_new, v_new, index)

  def start_step(self, cache: dict, index, num_sentences: int):
    """Row r writes its entry at `index` into its own slot and reads earlier ones from the slots that
    wrote them. Returns ({'slot_history'}, wrote bool [b, k(slot), 1, k(hypothesis), L]: slot s wrote
    hypothesis j's entry at position t)."""
    n = cache["slot_history"].shape[0]
    b, beams = num_sentences, n // num_sentences
    slot_history = jax.lax.dynamic_update_slice_in_dim(
        cache["slot_history"], (jnp.arange(n, dtype=jnp.int32) % beams)[:, None], index, axis=1)
    length = slot_history.shape[1]
    if self.ffi:   # the kernel reads the history itself: [b, k, L]
      return {"slot_history": slot_history}, slot_history.reshape(b, beams, length)
    wrote = slot_history.reshape(b, 1, 1, beams, length) == jnp.arange(beams)[None, :, None, None, None]
    return {"slot_history": slot_history}, wrote

  def attend_self(self, attend, q, k_new, v_new, layer_cache: dict, index, context, mask):
    del attend
    k, v = self._write(layer_cache, k_new, v_new, index)
    b, beams = context.shape[:2]
    if self.ffi:
      q = q.reshape(b, beams, *q.shape[2:])
      heads = _ffi(cpu_decoding.slot_attention, slot_attention, q, k, v, context.reshape(b * beams, -1), index)
      return heads, {"k": k, "v": v}
    slots = lambda c: c.reshape((b, beams) + c.shape[1:])                    # [b, k, h, ., .] (no copy)
    visible = context & mask.reshape(b, 1, 1, beams, -1)                   # [b, s, 1, j, L]
    heads = beam_attention(q.reshape(b, beams, *q.shape[2:]), slots(k), slots(v), visible,
                           self.dtype, self.matmul_dtype)                  # [b, k, h, d_v]
    return heads, {"k": k, "v": v}   # the layer projects, then reshapes to [n, 1, d_model]

  def reorder(self, cache: dict, rows) -> dict:
    """Gathers only 'index' and 'slot_history': keys and values stay where they were written."""
    take = lambda x: jnp.take(x, rows, axis=0)
    return dict(cache, index=take(cache["index"]), slot_history=take(cache["slot_history"]))
