"""Matrix multiplies with low-precision operands and float32 accumulation ("mixed precision"), laid out
for XLA:CPU. The reference is model.ops.rounded_dot_general (round, then lax.dot_general into float32).

    out = mixed_dot_general(lhs, rhs, dimension_numbers, dtype=jnp.bfloat16)   # float32 out

Both operands are rounded to `dtype`, the products are accumulated and returned in float32, and the
backward pass does the same: the float32 cotangent is rounded to `dtype` and both gradient matmuls read
`dtype` operands with float32 accumulation. This is what a TPU does for a float32 matmul at its default
precision (one bfloat16 pass), and on CPUs with AVX512-BF16 it runs about twice as fast as float32
(benchmarks/throughput.py prints both peaks). Everything outside the matmuls (residual stream, LayerNorm,
softmax, loss, parameters, optimizer) stays float32.

JAX's own transpose of a dot with bfloat16 operands would multiply the float32 cotangent by a bfloat16
operand, which XLA runs at float32 speed; hence the custom gradient.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _kept(ndim, contract, batch):
  return [a for a in range(ndim) if a not in contract and a not in batch]


def _laid_out(x, order):
  """x with its axes in `order`, as a row-major copy. A bfloat16 dot with an operand that is not
  row-major leaves XLA:CPU's fast matmul (YNNPACK): XLA converts both operands to float32 and multiplies
  at float32 speed. A bare transpose would not do: XLA folds it into the dot, and even behind an
  optimization barrier JAX's transpose comes with a column-major layout that makes it free, which the
  barrier hands on to the dot. A reshape reads its operand row-major, so the unit axis added here (inside
  the barrier) forces the transposed copy. tests/test_precision.py checks that every dot stays bfloat16."""
  if list(order) == list(range(x.ndim)):
    return x
  t = jnp.transpose(x, order)
  return lax.reshape(lax.optimization_barrier(lax.reshape(t, t.shape + (1,))), t.shape)


def _matmul(lhs, rhs, dimension_numbers):
  """lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=float32), with the operands
  laid out as fast matmul kernels read them: lhs as [batch, kept, contracted] and rhs as
  [batch, contracted, kept] or [batch, kept, contracted]. Same output axes as dot_general."""
  (lc, rc), (lb, rb) = dimension_numbers
  l_kept, r_kept = _kept(lhs.ndim, lc, lb), _kept(rhs.ndim, rc, rb)
  nb = len(lb)
  lhs = _laid_out(lhs, list(lb) + l_kept + list(lc))
  l_contract = list(range(nb + len(l_kept), lhs.ndim))
  if list(rb) + r_kept + list(rc) == list(range(rhs.ndim)):   # already [batch, kept, contracted]
    r_contract = list(range(nb + len(r_kept), rhs.ndim))
  else:
    rhs = _laid_out(rhs, list(rb) + list(rc) + r_kept)
    r_contract = list(range(nb, nb + len(rc)))
  batch = list(range(nb))
  return lax.dot_general(lhs, rhs, ((l_contract, r_contract), (batch, batch)),
                         preferred_element_type=jnp.float32)


def _to_order(d, axes):
  """d, whose axes are `axes` of the operand it is the gradient of, in that operand's axis order."""
  order = np.argsort(axes)
  if list(order) == list(range(d.ndim)):
    return d
  # The barrier keeps XLA from rewriting transpose(dot(a, b)) as a dot of transposed operands.
  return jnp.transpose(lax.optimization_barrier(d), order)


def _grad_lhs(g, rhs, dimension_numbers, lhs_ndim):
  """d(lhs) of out = dot_general(lhs, rhs, dimension_numbers), given the cotangent g of out.

  out's axes are [batch, lhs kept, rhs kept]. Contracting g's rhs-kept axes with rhs's kept axes
  (batch axes paired) gives d(lhs) as [batch, lhs kept, lhs contracted]; with the operands swapped,
  as [batch, lhs contracted, lhs kept]. Whichever is lhs's own axis order is used (for a dense layer,
  the first), so that no transpose follows the matmul.
  """
  (lc, rc), (lb, rb) = dimension_numbers
  l_kept, r_kept = _kept(lhs_ndim, lc, lb), _kept(rhs.ndim, rc, rb)
  nb = len(lb)
  g_batch, g_rkept = list(range(nb)), list(range(nb + len(l_kept), g.ndim))
  lc_by_rc = [lc[list(rc).index(a)] for a in sorted(rc)]   # rhs's contracted axes, named as lhs's
  kept_first = list(lb) + l_kept + lc_by_rc
  if kept_first == list(range(lhs_ndim)) or len(l_kept) == 0:
    return _to_order(_matmul(g, rhs, ((g_rkept, r_kept), (g_batch, list(rb)))), kept_first)
  return _to_order(_matmul(rhs, g, ((r_kept, g_rkept), (list(rb), g_batch))),
                   list(lb) + lc_by_rc + l_kept)


def _grad_rhs(g, lhs, dimension_numbers, rhs_ndim):
  """d(rhs): the same with the roles of the operands swapped."""
  (lc, rc), (lb, rb) = dimension_numbers
  l_kept, r_kept = _kept(lhs.ndim, lc, lb), _kept(rhs_ndim, rc, rb)
  nb = len(lb)
  g_batch, g_lkept = list(range(nb)), list(range(nb, nb + len(l_kept)))
  rc_by_lc = [rc[list(lc).index(a)] for a in sorted(lc)]   # lhs's contracted axes, named as rhs's
  contracted_first = list(rb) + rc_by_lc + r_kept
  if contracted_first == list(range(rhs_ndim)) or len(r_kept) == 0:
    return _to_order(_matmul(lhs, g, ((l_kept, g_lkept), (list(lb), g_batch))), contracted_first)
  return _to_order(_matmul(g, lhs, ((g_lkept, l_kept), (g_batch, list(lb)))),
                   list(rb) + r_kept + rc_by_lc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mixed(lhs, rhs, dimension_numbers, dtype):
  return _mixed_fwd(lhs, rhs, dimension_numbers, dtype)[0]


def _mixed_fwd(lhs, rhs, dimension_numbers, dtype):
  low_lhs, low_rhs = lhs.astype(dtype), rhs.astype(dtype)
  out = _matmul(low_lhs, low_rhs, dimension_numbers)
  # The zero-size arrays carry the operands' original dtypes into the backward pass.
  return out, (low_lhs, low_rhs, jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))


def _mixed_bwd(dimension_numbers, dtype, residuals, g):
  low_lhs, low_rhs, lhs_dtype, rhs_dtype = residuals
  g = g.astype(dtype)
  d_lhs = _grad_lhs(g, low_rhs, dimension_numbers, low_lhs.ndim)
  d_rhs = _grad_rhs(g, low_lhs, dimension_numbers, low_rhs.ndim)
  return d_lhs.astype(lhs_dtype.dtype), d_rhs.astype(rhs_dtype.dtype)


_mixed.defvjp(_mixed_fwd, _mixed_bwd)


def _normalize(dimension_numbers):
  (lc, rc), (lb, rb) = dimension_numbers
  return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


def mixed_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                      dtype=jnp.bfloat16, **unused):
  """lax.dot_general with operands rounded to `dtype` and float32 accumulation, forward and backward.

  Takes (and ignores) the `precision` and `preferred_element_type` that Flax layers pass; always
  returns float32.
  """
  del precision, preferred_element_type, unused
  return _mixed(lhs, rhs, _normalize(dimension_numbers), jnp.dtype(dtype).type)


def dot_general_for(dtype):
  """The dot_general for Flax's Dense/DenseGeneral: None (lax.dot_general) for float32, else mixed."""
  if dtype is None or jnp.dtype(dtype) == jnp.float32:
    return None
  return functools.partial(mixed_dot_general, dtype=jnp.dtype(dtype).type)


def einsum(spec: str, a, b, dtype=None):
  """jnp.einsum of two operands returning float32; with `dtype` set, through mixed_dot_general."""
  if dtype is None or jnp.dtype(dtype) == jnp.float32:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
  # preferred_element_type: jnp.einsum would otherwise round the float32 result to the operands' dtype.
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32,
                    _dot_general=functools.partial(mixed_dot_general, dtype=dtype))
