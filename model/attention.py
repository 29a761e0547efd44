"""Multi-head scaled dot-product attention, and the masks it takes.

Masks are boolean, True where a query may attend to a key, shaped [batch, 1, q_len, kv_len] so that one
mask serves every head.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import ops
from model import positions as positions_lib


def visible(cfg, q_segments: jax.Array, kv_segments: jax.Array, q_positions: jax.Array | None = None,
            kv_positions: jax.Array | None = None, causal: bool = False) -> jax.Array:
  """Which keys each query may see: the one rule of every attention of the model (the teacher-forced
  passes, prefill and the cached step) and of every cache and kernel that decodes it. A query sees the
  keys of its own segment (segment 0 is padding, which sees and is seen by nothing) and, causal, none at
  a later position. q_segments int [b, q], kv_segments int [b, k]; positions int, same shapes (None for
  cross-attention: queries and keys of two sequences); cfg: the TransformerConfig, for a switch that
  changes what is visible (docs/model.md, "Adding a switch"). Returns bool [b, 1, q, k]."""
  del cfg   # no switch of today's family changes it
  mask = segment_mask(q_segments, kv_segments)
  if causal:
    mask = mask & (q_positions[:, :, None] >= kv_positions[:, None, :])[:, None]
  return mask


def packed_mask(q_segments: jax.Array, kv_segments: jax.Array, causal: bool = False, packed: bool = True,
                cfg=None, q_positions=None, kv_positions=None) -> ops.PackedMask:
  """visible(...) as a PackedMask: the dense mask with the segment ids and causal flag that a fused kernel
  reads instead (kernels/fused_attention.py). Causal without positions: 0, 1, 2, ... in every row."""
  if causal and q_positions is None:
    q_positions = kv_positions = jnp.broadcast_to(jnp.arange(q_segments.shape[1]), q_segments.shape)
  dense = visible(cfg, q_segments, kv_segments, q_positions, kv_positions, causal)
  return ops.PackedMask(dense, q_segments, kv_segments, causal, packed)


def segment_mask(q_segments: jax.Array, kv_segments: jax.Array) -> jax.Array:
  """Queries attend to keys of the same packed segment; segment 0 is padding and sees nothing.
  q_segments int [b, q], kv_segments int [b, k] -> bool [b, 1, q, k]."""
  same = q_segments[:, :, None] == kv_segments[:, None, :]  # [b, q, k]
  real = (q_segments[:, :, None] != 0) & (kv_segments[:, None, :] != 0)
  return (same & real)[:, None]


def scores(cfg, q, k, bias=None, dot_general=None) -> jax.Array:
  """The attention's scores, q k^T / sqrt(d_k) + bias, in float32: the one place of every plain attention
  (teacher-forced, prefill, the plain cache's step, the recorded maps) where a switch that changes the
  scores goes (docs/model.md, "Adding a switch"). q [b, q_len, h, d_k]; k [b, kv_len, g, d_k], g dividing
  h (g < h: grouped-query attention, each key/value head serving h/g consecutive query heads); bias float
  (ALiBi, relative positions) broadcastable to [b, h, q_len, kv_len], or None; cfg: the TransformerConfig
  (None: the paper's). Returns float32 [b, h, q_len, kv_len]."""
  del cfg   # no switch of today's family changes them
  groups = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, groups, axis=2) if groups > 1 else k                     # [b, kv_len, h, d_k]
  logits = jnp.einsum("bqhd,bkhd->bhqk", q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype), k,
                      preferred_element_type=jnp.float32,
                      _dot_general=dot_general or jax.lax.dot_general)       # float32 [b, h, q_len, kv_len]
  return logits if bias is None else logits + bias


def attention_weights(cfg, q, k, mask, bias=None, dot_general=None) -> jax.Array:
  """softmax(scores) over the keys a query may see (mask, from `visible`), in float32: the plain
  attention's one softmax, which the model attends with and its recorded maps show
  (decode/attention_maps.py). q, k, bias, cfg: as `scores`; mask bool broadcastable to
  [b, h, q_len, kv_len], or None. Returns float32 [b, h, q_len, kv_len]."""
  logits = scores(cfg, q, k, bias, dot_general)
  if mask is not None:
    logits = jnp.where(mask, logits, ops.MASKED)
  return jax.nn.softmax(logits, axis=-1)


def dot_product_attention(q, k, v, mask, *, dtype=jnp.float32, dot_general=None, dropout=None,
                          bias=None, cfg=None):
  """attention_weights(cfg, q, k, mask, bias) v, the product in `dtype`. q, k, mask, bias, cfg: as
  attention_weights (mask may be a PackedMask); v [b, kv_len, g, d_v]. Returns [b, q_len, h, d_v] in
  `dtype`. dot_general: both matmuls' (None: lax.dot_general); dropout: None or a function applied to the
  attention weights."""
  mask = mask.dense if isinstance(mask, ops.PackedMask) else mask
  weights = attention_weights(cfg, q, k, mask, bias, dot_general)           # float32
  if dropout is not None:
    weights = dropout(weights)
  groups = q.shape[2] // v.shape[2]
  v = jnp.repeat(v, groups, axis=2) if groups > 1 else v                     # [b, kv_len, h, d_v]
  return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(dtype), v.astype(dtype),
                    _dot_general=dot_general or jax.lax.dot_general)       # [b, q_len, h, d_v]


class MultiHeadAttention(nn.Module):
  """h parallel heads with their own Q, K (d_k each) and V (d_v each) projections, then W^O. Decoding
  calls the pieces: `project_kv` (a memory's keys and values, computed once), `project_q`, `heads` (the
  attention without W^O) and `out` (W^O)."""
  num_heads: int
  d_k: int
  d_v: int
  d_model: int
  use_bias: bool = True
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  dot_general: Any = None       # for every matmul (None: lax.dot_general); see model/ops.py
  dropout_cls: Any = nn.Dropout
  num_kv_heads: int | None = None   # heads of K and V (None: num_heads); fewer = GQA, 1 = MQA
  rope: bool = False                # rotate queries and keys by their positions (model/positions.py)
  impl: str = "xla"                 # Compute.attention_impl (model/ops.py's attention_impl)
  fused: tuple = ()                 # the fused kernels whose declarations take the model (the same)
  cfg: Any = None                   # the TransformerConfig, for a switch of `visible` or `scores`

  def setup(self):
    dense = lambda features, axis=-1: nn.DenseGeneral(
        features, axis=axis, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
        kernel_init=nn.initializers.xavier_uniform(), dot_general=self.dot_general)
    self.query = dense((self.num_heads, self.d_k))
    kv_heads = self.num_kv_heads or self.num_heads
    self.key = dense((kv_heads, self.d_k))
    self.value = dense((kv_heads, self.d_v))
    self.out = dense(self.d_model, axis=(-2, -1))
    self.weights_dropout = self.dropout_cls(self.dropout_rate)

  def project_kv(self, memory, positions=None):
    """memory [b, kv_len, d_model] -> (keys [b, kv_len, g, d_k], values [b, kv_len, g, d_v]), g the
    key/value heads; with rope, keys are rotated by positions int [b, kv_len]."""
    k = self.key(memory)
    return (positions_lib.rope(k, positions) if self.rope else k), self.value(memory)

  def project_q(self, x, positions=None):
    """x [b, q_len, d_model] -> queries [b, q_len, h, d_k] (with rope, rotated by positions)."""
    q = self.query(x)
    return positions_lib.rope(q, positions) if self.rope else q

  def heads(self, q, k, v, mask, deterministic=True, bias=None):
    """Queries [b, q, h, d_k] against keys [b, kv, g, d_k] and values [b, kv, g, d_v] -> [b, q, h, d_v]."""
    dropout = None
    if self.dropout_rate > 0.0 and not deterministic:
      rng = self.make_rng("dropout")
      dropout = lambda w: self.weights_dropout(w, deterministic=False, rng=rng)
    dense = mask.dense if isinstance(mask, ops.PackedMask) else mask
    if self.is_mutable_collection("intermediates"):   # decode/attention_maps.py asks; training never does
      self.sow("intermediates", "attention_weights", attention_weights(self.cfg, q, k, dense, bias))
    reference = lambda q, k, v, mask, bias: dot_product_attention(
        q, k, v, mask, dtype=self.dtype, dot_general=self.dot_general, dropout=dropout, bias=bias, cfg=self.cfg)
    if not isinstance(mask, ops.PackedMask):   # a decoding step: one query against the cache
      return reference(q, k, v, mask, bias)
    return ops.attention(self.impl, q, k, v, mask, bias, dropout is not None, reference,
                         self.fused).astype(self.dtype)

  def __call__(self, x, memory, mask, deterministic=True, positions=None, bias=None):
    """x [b, q_len, d_model] attends to memory [b, kv_len, d_model]; returns [b, q_len, d_model].

    positions int [b, len] (rope, self-attention only: x is memory); bias float [b, h, q_len, kv_len]."""
    k, v = self.project_kv(memory, positions)
    return self.out(self.heads(self.project_q(x, positions), k, v, mask, deterministic, bias))
