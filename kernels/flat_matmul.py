"""Dense layers with several contracted or output axes as one 2-D matmul (the float32 fast path).

    out = dot_general(x, kernel, (((2,), (0,)), ((), ())))   # x [b, len, d], kernel [d, h, d_k]

The attention projections are DenseGeneral layers with kernels [d_model, heads, d_k] and
[heads, d_v, d_model]. Handed to XLA:CPU as they are, the backward pass transposes every such kernel
with a three-axis permutation, slow on XLA:CPU, once per projection per step (docs/performance.md). Reshaped to the matrices they are ([d_model,
heads * d_k], [heads * d_v, d_model]; a reshape of a row-major array costs nothing), the same products
need only 2-D transposes, which XLA runs at memory speed. The sums are the same; the result can differ
from lax.dot_general's in the last bit where the matmul kernel blocks the contraction differently.
"""
from __future__ import annotations

import math

from jax import lax


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
  """lax.dot_general; a dense-layer product (no batch axes, lhs contracted on its trailing axes and rhs
  on its leading ones, in the same order) runs as one [rows, K] x [K, columns] matmul."""
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc = tuple(a % lhs.ndim for a in lc), tuple(a % rhs.ndim for a in rc)
  n = len(lc)
  dense = (not lb and not rb and lc == tuple(range(lhs.ndim - n, lhs.ndim)) and rc == tuple(range(n))
           and all(v is None for v in kwargs.values()))
  if not dense or (lhs.ndim == 2 and rhs.ndim == 2):
    return lax.dot_general(lhs, rhs, dimension_numbers, precision,
                           preferred_element_type=preferred_element_type, **kwargs)
  k = math.prod(lhs.shape[lhs.ndim - n:])
  out = lax.dot_general(lhs.reshape(-1, k), rhs.reshape(k, -1), (((1,), (0,)), ((), ())), precision,
                        preferred_element_type=preferred_element_type)
  return out.reshape(lhs.shape[:lhs.ndim - n] + rhs.shape[n:])
