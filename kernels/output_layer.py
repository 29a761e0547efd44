"""The decoder's pre-softmax weights laid out once per batch, for incremental decoding.

The model computes logits as y @ table^T with the [vocab, d_model] table (the shared embedding). Inside
the decoding loop XLA:CPU transposes that table at every step; transposed once before the loop (and
rounded to the matmul dtype), the per-step matmul reads it as it lies.
"""
from __future__ import annotations

import jax.numpy as jnp


def decoding_kernel(table, *, dtype):
  """table [vocab, d_model] -> kernel [d_model, vocab] in `dtype` (the matmul operand dtype)."""
  return jnp.swapaxes(table, 0, 1).astype(dtype)


def logits(y, kernel):
  """y [n, d_model] x kernel [d_model, vocab] -> float32 logits [n, vocab] (float32 accumulation)."""
  return jnp.dot(y.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
