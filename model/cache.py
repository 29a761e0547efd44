"""The plain decoding cache: keys and values of the positions decoded so far, reordered by gathering.

A cache object creates, extends, attends to and reorders the per-layer cache; the layers call it without
knowing its layout. kernels/decode_cache.py has CPU-tuned ones with the same methods (model/ops.py chooses).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class KVCache:
  """Per decoder layer, keys [n, L, h, d_k] and values [n, L, h, d_v] in the compute dtype, laid out
  as the teacher-forced pass lays them out, so decoding runs the same attention."""
  num_layers: int
  num_heads: int
  d_k: int
  d_v: int
  dtype: Any

  def init(self, batch_size: int, max_len: int) -> dict:
    """'index' int32 [n] (the position written next, equal across rows) and per layer 'k', 'v'."""
    layer = lambda: {"k": jnp.zeros((batch_size, max_len, self.num_heads, self.d_k), self.dtype),
                     "v": jnp.zeros((batch_size, max_len, self.num_heads, self.d_v), self.dtype)}
    return {"index": jnp.zeros((batch_size,), jnp.int32),
            "layers": [layer() for _ in range(self.num_layers)]}

  def length(self, cache: dict) -> int:
    """The most positions `cache` holds (L): decoding reads the geometry through the cache that laid it out."""
    return cache["layers"][0]["k"].shape[1]

  def start_step(self, cache: dict, index, num_sentences: int):
    """Before the layers of one step: (entries carried into the new cache, context for attend_self)."""
    return {}, None

  def prepare_cross(self, keys, values):
    """Cross-attention keys [b, src_len, h, d_k] and values [b, src_len, h, d_v], stored once."""
    return keys, values

  def attend_self(self, attend, q, k_new, v_new, layer_cache: dict, index, context, mask):
    """Writes this step's keys and values [n, 1, h, d] at `index` and attends, with the layer's
    attend(q, k, v, mask), to the entries that mask bool [n, 1, 1, L] (the model's, attention.visible)
    shows. Returns (heads [n, 1, h, d_v], new layer cache); a cache may return the heads with other
    leading axes of n * 1 elements (the layer reshapes them)."""
    del context
    write = lambda cache, new: jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype),
                                                                   index, axis=1)
    k, v = write(layer_cache["k"], k_new), write(layer_cache["v"], v_new)    # [n, L, h, d]
    return attend(q, k, v, mask), {"k": k, "v": v}

  def attend_cross(self, attend, q, keys, values, mask):
    """q [b, k, h, d_k]: the k hypotheses of a sentence are k queries against its keys and values
    (from prepare_cross), so the encoder memory is not copied per hypothesis. Returns [b, k, h, d_v]."""
    return attend(q, keys, values, mask)

  def reorder(self, cache: dict, rows) -> dict:
    """Beam search's reorder: new row i continues old row rows[i]."""
    return jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0), cache)
