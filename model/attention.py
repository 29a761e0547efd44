"""Multi-head scaled dot-product attention, and the masks it takes.

Masks are boolean, True where a query may attend to a key, shaped [batch, 1, q_len, kv_len] so that one
mask serves every head.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import precision
from model.dropout import dropout

# Large enough to zero a softmax entry in float32, small enough not to overflow when added to logits.
_MASKED = -1e9


def segment_mask(q_segments: jax.Array, kv_segments: jax.Array) -> jax.Array:
  """Queries attend to keys of the same packed segment; segment 0 is padding and sees nothing.

  q_segments: int [b, q]; kv_segments: int [b, k]. Returns bool [b, 1, q, k].
  """
  same = q_segments[:, :, None] == kv_segments[:, None, :]  # [b, q, k]
  real = (q_segments[:, :, None] != 0) & (kv_segments[:, None, :] != 0)
  return (same & real)[:, None]


def causal_mask(length: int) -> jax.Array:
  """Position i sees positions <= i. Returns bool [1, 1, length, length]."""
  idx = jnp.arange(length)
  return (idx[:, None] >= idx[None, :])[None, None]


def _masked_softmax(logits, mask):
  """float32 softmax over the last axis; positions where mask is False get (numerically) zero weight."""
  if mask is not None:
    logits = jnp.where(mask, logits, _MASKED)
  return jax.nn.softmax(logits, axis=-1)


def dot_product_attention(q, k, v, mask, *, dropout_rate=0.0, deterministic=True, dropout_rng=None,
                          dtype=jnp.float32, matmul_dtype=None):
  """softmax(q k^T / sqrt(d_k)) v, with the softmax in float32.

  q: [b, q_len, h, d_k]; k: [b, kv_len, h, d_k]; v: [b, kv_len, h, d_v];
  mask: bool broadcastable to [b, h, q_len, kv_len] or None. Returns [b, q_len, h, d_v] in `dtype`.
  matmul_dtype: None, or the operand dtype of both matmuls (mixed precision, model/precision.py).
  """
  scale = q.shape[-1] ** -0.5
  logits = precision.einsum("bqhd,bkhd->bhqk", q * jnp.asarray(scale, q.dtype), k,
                            matmul_dtype)                   # float32 [b, h, q_len, kv_len]
  weights = _masked_softmax(logits, mask)                   # float32
  if dropout_rate > 0.0 and not deterministic:
    weights = dropout(weights, dropout_rate, dropout_rng)
  return _weighted_values("bhqk,bkhd->bqhd", weights, v, dtype, matmul_dtype)  # [b, q_len, h, d_v]


def _weighted_values(spec, weights, v, dtype, matmul_dtype):
  """The attention weights (float32) times the values, in `dtype` (or mixed precision)."""
  if matmul_dtype is None:
    return jnp.einsum(spec, weights.astype(dtype), v.astype(dtype))
  return precision.einsum(spec, weights, v, matmul_dtype).astype(dtype)


def cached_attention(q, k, v, mask, dtype=jnp.float32, matmul_dtype=None):
  """Attention against head-major keys and values, the layout of the decoding caches.

  q: [b, q_len, h, d_k]; k: [b, h, kv_len, d_k]; v: [b, h, kv_len, d_v]; mask: bool broadcastable to
  [b, h, q_len, kv_len] or None. Returns [b, q_len, h, d_v] in `dtype`.
  With heads before positions, both matmuls read the (long) keys and values as they lie in memory; the
  position-major layout of the teacher-forced pass would make XLA transpose the whole cache every step.
  """
  scale = q.shape[-1] ** -0.5
  q = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)                 # [b, h, q_len, d_k] (small)
  k = k if matmul_dtype is not None else k.astype(q.dtype)  # (mixed: the cache is stored rounded)
  logits = precision.einsum("bhqd,bhkd->bhqk", q, k, matmul_dtype)  # float32 [b, h, q_len, kv_len]
  weights = _masked_softmax(logits, mask)                   # float32
  out = _weighted_values("bhqk,bhkd->bhqd", weights, v, dtype, matmul_dtype)  # [b, h, q_len, d_v]
  return jnp.swapaxes(out, 1, 2)                                            # [b, q_len, h, d_v]


def beam_attention(q, k, v, mask, dtype=jnp.float32, matmul_dtype=None):
  """Attention of each sentence's k hypotheses against the caches of all k of its beam slots.

  q: [b, k, h, d_k] (hypothesis j of sentence r is row r*k + j); k: [b, k, h, L, d_k] and
  v: [b, k, h, L, d_v], the head-major caches of the sentence's k slots; mask: bool [b, k, 1, k, L],
  True where slot s's entry at position t belongs to hypothesis j's history (mask[r, s, 0, j, t]).
  The softmax runs over (slot, position) jointly. Returns [b, k, h, d_v] in `dtype`.
  Beam search then never reorders the caches: a hypothesis reads its history from whichever slots
  wrote it, at the price of k times the (small) attention arithmetic of one decoding step.
  """
  scale = q.shape[-1] ** -0.5
  q = jnp.swapaxes(q * jnp.asarray(scale, q.dtype), 1, 2)                 # [b, h, j, d_k] (small)
  if matmul_dtype is not None:   # round the operands as a mixed-precision matmul would
    q, k = q.astype(matmul_dtype), k.astype(matmul_dtype)
  # The logits as a multiply-and-sum: XLA fuses it into one pass over the keys, where a batched matmul
  # of [k, d_k] x [d_k, L] per (sentence, slot, head) measured 1.1x-1.2x slower for the whole search.
  logits = jnp.sum(q[:, None, :, :, None, :].astype(jnp.float32)
                   * k[:, :, :, None].astype(jnp.float32), axis=-1)        # [b, s, h, j, L]
  logits = jnp.where(mask, logits, _MASKED)
  logits = logits - jnp.max(logits, axis=(1, 4), keepdims=True)
  weights = jnp.exp(logits)
  weights = weights / jnp.sum(weights, axis=(1, 4), keepdims=True)
  out = _weighted_values("bshjt,bshtd->bshjd", weights, v, dtype, matmul_dtype)  # [b, s, h, j, d_v]
  return jnp.swapaxes(jnp.sum(out, axis=1), 1, 2)                          # [b, j, h, d_v]


class MultiHeadAttention(nn.Module):
  """h parallel heads with their own Q, K (d_k each) and V (d_v each) projections, then W^O.

  Besides the plain call, it exposes the pieces incremental decoding needs: `project_kv` (keys and
  values of a memory, computed once) and `attend` (queries against given keys and values).
  """
  num_heads: int
  d_k: int
  d_v: int
  d_model: int
  use_bias: bool = True
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  matmul_dtype: Any = None   # None, or the operand dtype of every matmul (mixed precision)

  def setup(self):
    dense = lambda features, axis=-1: nn.DenseGeneral(
        features, axis=axis, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=nn.initializers.xavier_uniform(),
        dot_general=precision.dot_general_for(self.matmul_dtype))
    self.query = dense((self.num_heads, self.d_k))
    self.key = dense((self.num_heads, self.d_k))
    self.value = dense((self.num_heads, self.d_v))
    self.out = dense(self.d_model, axis=(-2, -1))

  def project_kv(self, memory):
    """memory [b, kv_len, d_model] -> (keys [b, kv_len, h, d_k], values [b, kv_len, h, d_v])."""
    return self.key(memory), self.value(memory)

  def project_q(self, x):
    """x [b, q_len, d_model] -> queries [b, q_len, h, d_k]."""
    return self.query(x)

  def attend(self, q, k, v, mask, deterministic=True):
    """Queries [b, q, h, d_k] against keys/values; returns the projected output [b, q, d_model]."""
    rng = None
    if self.dropout_rate > 0.0 and not deterministic:
      rng = self.make_rng("dropout")
    heads = dot_product_attention(q, k, v, mask, dropout_rate=self.dropout_rate,
                                  deterministic=deterministic, dropout_rng=rng, dtype=self.dtype,
                                  matmul_dtype=self.matmul_dtype)
    return self.out(heads)

  def attend_cached(self, q, k, v, mask):
    """Queries [b, q, h, d_k] against head-major keys [b, h, kv, d_k] and values [b, h, kv, d_v]
    (decoding; no dropout). Returns the projected output [b, q, d_model]."""
    return self.out(cached_attention(q, k, v, mask, self.dtype, self.matmul_dtype))

  def attend_beams(self, q, k, v, mask):
    """`beam_attention` (decoding with beam-slot caches that are never reordered): queries
    [b, k, h, d_k] against slot caches [b, k, h, L, d]. Returns the projected output [b, k, d_model]."""
    return self.out(beam_attention(q, k, v, mask, self.dtype, self.matmul_dtype))

  def __call__(self, x, memory, mask, deterministic=True):
    """x [b, q_len, d_model] attends to memory [b, kv_len, d_model]; returns [b, q_len, d_model]."""
    k, v = self.project_kv(memory)
    return self.attend(self.project_q(x), k, v, mask, deterministic)
