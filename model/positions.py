"""Positions inside attention: rotary embeddings (RoPE), ALiBi and T5's bucketed relative bias.

The paper adds sinusoids to the embeddings (model/embedding.py); these three instead act on the
attention scores of self-attention, so that a score depends on how far apart two tokens are:

  rope      rotates queries and keys by angles proportional to their positions (Su et al. 2021):
            q_i . k_j depends on i - j only.
  alibi     adds -m_h * |i - j| to head h's scores, with fixed slopes m_h (Press et al. 2022).
  relative  adds a learned scalar per head and bucket of j - i, the buckets exact near 0 and
            logarithmic further out, one table per stack shared by its layers (Raffel et al. 2020).

Positions are the per-segment positions the model already takes, so packing changes nothing.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model.config import TransformerConfig, as_dtype


def rope(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotates x [b, len, h, d] (d even) by its positions int [b, len]; returns x's shape and dtype.
  Dimension pairs (i, i + d/2) are rotated by the angle position * base^(-2i/d), in float32."""
  d = x.shape[-1]
  if d % 2:
    raise ValueError(f"rope needs an even head dimension, got {d}")
  inv_freq = jnp.asarray(np.power(base, -np.arange(0, d, 2, dtype=np.float32) / d))   # [d/2]
  angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq                 # [b, len, 1, d/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)                              # [b, len, h, d/2]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
  """ALiBi's head slopes: 2^(-8/n), 2^(-16/n), ... for n = num_heads a power of two; otherwise the
  slopes of the next lower power of two, then every other slope of the next higher one (the paper's rule).
  Returns float32 [num_heads]."""
  def power_of_two(n):
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]
  lower = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = power_of_two(lower)
  if lower < num_heads:
    slopes += power_of_two(2 * lower)[0::2][:num_heads - lower]
  return np.asarray(slopes, np.float32)


def alibi_bias(q_positions: jax.Array, k_positions: jax.Array, num_heads: int) -> jax.Array:
  """-m_h * |i - j| for queries at q_positions int [b, q] and keys at k_positions int [b, k]: float32
  [b, h, q, k]. Causality comes from the mask, so one formula serves both directions."""
  distance = jnp.abs(q_positions[:, None, :, None] - k_positions[:, None, None, :])   # [b, 1, q, k]
  slopes = jnp.asarray(alibi_slopes(num_heads))[None, :, None, None]                   # [1, h, 1, 1]
  return -slopes * distance.astype(jnp.float32)


def relative_bucket(relative_position, bidirectional: bool, num_buckets: int = 32,
                    max_distance: int = 128):
  """T5's bucket of relative_position = key position - query position (int array, any shape).
  Bidirectional: half the buckets for keys after the query, half for keys at or before it. Causal: keys
  after the query (which the mask hides anyway) share bucket 0 with the query itself. In each half, the
  first half of the buckets are exact distances; the rest grow logarithmically up to max_distance, and
  everything further shares the last bucket."""
  relative_position = jnp.asarray(relative_position)
  bucket = jnp.zeros_like(relative_position)
  distance = -relative_position                          # > 0: the key lies before the query
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (distance < 0).astype(relative_position.dtype) * num_buckets
    distance = jnp.abs(distance)
  else:
    distance = jnp.maximum(distance, 0)
  max_exact = num_buckets // 2
  is_small = distance < max_exact
  # Logarithmic buckets max_exact .. num_buckets - 1 for distances max_exact .. max_distance.
  log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact) / math.log(
      max_distance / max_exact)
  large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(relative_position.dtype)
  large = jnp.minimum(large, num_buckets - 1)
  return bucket + jnp.where(is_small, distance, large)


class RelativeBias(nn.Module):
  """One learned scalar per head and relative-position bucket; one per stack, shared by its layers."""
  num_heads: int
  bidirectional: bool
  num_buckets: int = 32
  max_distance: int = 128
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, q_positions, k_positions):
    """q_positions int [b, q], k_positions int [b, k] -> float32 bias [b, h, q, k]."""
    table = self.param("rel_embedding", nn.initializers.normal(stddev=1.0),
                       (self.num_buckets, self.num_heads), self.param_dtype)
    relative = k_positions[:, None, :] - q_positions[:, :, None]                       # [b, q, k]
    buckets = relative_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
    return jnp.take(table.astype(jnp.float32), buckets, axis=0).transpose(0, 3, 1, 2)  # [b, h, q, k]


class PositionBias(nn.Module):
  """The self-attention score bias of positions="alibi" or "relative", one per stack and shared by its
  layers; None for the other position kinds."""
  cfg: TransformerConfig
  bidirectional: bool

  def setup(self):
    cfg = self.cfg
    if cfg.positions == "relative":
      self.relative = RelativeBias(cfg.num_heads, self.bidirectional, cfg.relative_buckets,
                                   cfg.relative_max_distance, as_dtype(cfg.param_dtype))

  def __call__(self, q_positions, k_positions):
    """q_positions int [b, q], k_positions int [b, k] -> float32 [b, h, q, k] or None."""
    if self.cfg.positions == "alibi":
      return alibi_bias(q_positions, k_positions, self.cfg.num_heads)
    if self.cfg.positions == "relative":
      return self.relative(q_positions, k_positions)
    return None
