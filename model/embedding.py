"""Token embeddings and positional encodings."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def sinusoid(positions: jax.Array, d_model: int) -> jax.Array:
  """The paper's encoding, sin and cos interleaved exactly as its formula writes them:
  PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).
  positions: int [...]. Returns float32 [..., d_model]."""
  if d_model % 2:
    raise ValueError(f"sinusoidal positions need an even d_model, got {d_model}")
  two_i = np.arange(0, d_model, 2, dtype=np.float32)                  # [d_model / 2]
  inv_freq = jnp.asarray(np.power(10000.0, -two_i / d_model), jnp.float32)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq        # [..., d_model / 2]
  # Stack on a new last axis, then flatten: even dims get sin, odd dims cos.
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, d_model)


class Embedder(nn.Module):
  """Token ids -> vectors scaled by sqrt(d_model), plus positions; dropout on the sum (the paper). With
  `shared`, the parent's matrix: encoder, decoder and the pre-softmax projection use one."""
  d_model: int
  max_len: int
  dropout_rate: float
  position_kind: str = "sinusoidal"   # added here: "sinusoidal" | "learned"; others act inside attention
  shared: nn.Module | None = None
  vocab_size: int = 0
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  dropout_cls: Any = nn.Dropout   # model.ops chooses it (kernels/dropout16.py on the CPU)

  def setup(self):
    self.table = self.shared or nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype,
                                         param_dtype=self.param_dtype,
                                         embedding_init=nn.initializers.normal(stddev=self.d_model ** -0.5))
    if self.position_kind == "learned":
      self.positions = nn.Embed(self.max_len, self.d_model, dtype=self.dtype,
                                param_dtype=self.param_dtype,
                                embedding_init=nn.initializers.normal(stddev=0.02))
    self.dropout = self.dropout_cls(self.dropout_rate)

  def __call__(self, ids, positions, deterministic=True):
    """ids, positions: int [b, len]. Returns [b, len, d_model] in the compute dtype."""
    x = self.table(ids) * jnp.asarray(self.d_model ** 0.5, self.dtype)
    if self.position_kind == "learned":
      x = x + self.positions(positions)
    elif self.position_kind == "sinusoidal":
      x = x + sinusoid(positions, self.d_model).astype(self.dtype)
    return self.dropout(x, deterministic=deterministic)
