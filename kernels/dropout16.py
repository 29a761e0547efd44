"""Dropout with 16-bit random thresholds: the same estimator as flax.linen.Dropout at half the random bits
(the CPU fast path of the model's nn.Dropout).

On a CPU, drawing the dropout mask is a noticeable part of a training step (threefry costs about as much
as a small matmul per element). flax's Dropout draws one 32-bit uniform float per element; here every
32-bit word of randomness decides two elements, each by comparing 16 bits with a threshold. The keep
probability is round((1 - rate) * 65536) / 65536 (within 1e-5 of 1 - rate), and kept elements are scaled
by the inverse of exactly that probability, so the expected output equals the input.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

_LEVELS = 1 << 16


def keep_threshold(rate: float) -> int:
  """An element is kept when its 16 random bits are below this (out of 65,536)."""
  return int(round((1.0 - rate) * _LEVELS))


def keep_mask(rng, rate: float, shape) -> jax.Array:
  """bool[shape], True with probability keep_threshold(rate) / 65536, elementwise independent."""
  size = int(np.prod(shape))
  words = jax.random.bits(rng, ((size + 1) // 2,), jnp.uint32)                # 2 elements per word
  halves = jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(-1)[:size]  # [size]
  return (halves < keep_threshold(rate)).reshape(shape)


def dropout(x, rate: float, rng) -> jax.Array:
  """Zeroes elements of x with probability ~rate and scales the rest to keep the expectation."""
  if rate <= 0.0:
    return x
  threshold = keep_threshold(rate)
  if threshold == 0:
    return jnp.zeros_like(x)
  scale = jnp.asarray(_LEVELS / threshold, x.dtype)
  return jnp.where(keep_mask(rng, rate, x.shape), x * scale, jnp.zeros((), x.dtype))


class Dropout(nn.Module):
  """Drop-in for flax.linen.Dropout(rate): same 'dropout' rng stream, same `deterministic` switch, and
  an explicit `rng` may be passed instead."""
  rate: float

  @nn.compact
  def __call__(self, x, deterministic: bool = True, rng=None):
    if deterministic or self.rate <= 0.0:
      return x
    return dropout(x, self.rate, self.make_rng("dropout") if rng is None else rng)
