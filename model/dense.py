"""Dense layers that a decoding step can run on their kernels laid out in panels.

A decoding step multiplies a few rows (a device's sentences times the beam) by every kernel of the
decoder. XLA's dot streams a kernel slowly for so few rows; read as it lies, a [d_in, d_out] kernel is a
stride of d_out floats from one weight to the next a row uses (4 KB for the FFN's d_ff = 1,024), which the
caches serve badly. Laid out as panels (kernels/output_layer.panels, the output layer's layout), each
weight is read once, in order, for up to 8 rows. On one core, with the weights beyond the caches, 32 rows
x 256 x 1,024 took 204 us with XLA's dot, 631 us read with that stride and 150-170 us on panels
(benchmarks/notes/changes.md).

These are flax's nn.Dense and nn.DenseGeneral, with the same parameters and the same results when called
as usual. `decoding_panels(layout)` lays out the kernel once per set of parameters
(Transformer.decoding_weights; the decoding memory keeps it, on the C++ path of model/ops.py only), and
`__call__(x, panels)` multiplies by it with the C++ panel product of kernels/cpu_attention.py, which
adds the bias in the same call.

Layers that read the same input (self-attention's query, key and value) can be laid out side by side as
one set of panels (`side_by_side_panels`) and multiplied in one call (`side_by_side_product`): the same
bits as one product per layer, since each output column is its own sum over the inputs in order, with
one call and one pass over the input where there were three. `product_and_norm` is a post-norm
sub-layer's last product with its residual connection and LayerNorm in the same call (model/layers.py's
Residual.ending_in_product).
"""
from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax.numpy as jnp

from kernels import cpu_attention


def _product(rows, panels, columns: int, bias):
  """rows [n, d_in] times panels, plus bias [columns] (None: no bias) inside the call -> float32 [n, columns]."""
  if bias is None:
    return cpu_attention.panel_matmul(rows, panels, columns)
  return cpu_attention.panel_matmul_bias(rows, panels, bias)


def _bias(module):
  return module.get_variable("params", "bias").reshape(-1) if module.use_bias else None


def _panel_product(module, x, panels, contracted: int, features: tuple):
  """x [..., *contracted axes] times the module's kernel as panels, plus its bias -> [..., *features]."""
  lead = x.shape[:x.ndim - contracted]
  y = _product(x.reshape(math.prod(lead), -1), panels, math.prod(features), _bias(module))   # [n, d_out]
  return y.reshape(lead + features).astype(module.dtype)


def product_and_norm(module, x, panels, residual, norm):
  """norm(residual + module(x)) for a post-norm sub-layer's last product on its panels, norm a flax
  nn.LayerNorm with scale and bias: the product, the residual connection and the norm in one C++ call
  (kernels/cpu_attention.panel_matmul_norm; equal to the separate steps up to float rounding).
  residual [..., d_out] with the leading axes of x, flattened alike."""
  contracted = module.contracted()
  columns = math.prod(module.feature_shape())
  rows = x.reshape(-1, math.prod(x.shape[x.ndim - contracted:]))
  if not (norm.use_scale and norm.use_bias):
    raise ValueError("model/dense.py: product_and_norm needs a LayerNorm with a scale and a bias")
  bias = _bias(module)
  y = cpu_attention.panel_matmul_norm(
      rows, panels, jnp.zeros((columns,), jnp.float32) if bias is None else bias,
      residual.reshape(rows.shape[0], columns), norm.get_variable("params", "scale"),
      norm.get_variable("params", "bias"), norm.epsilon)
  return y.reshape(residual.shape).astype(norm.dtype or residual.dtype)


def _matrix(module, contracted: int):
  """The module's kernel as a matrix [d_in, d_out]."""
  kernel = module.get_variable("params", "kernel")
  return kernel.reshape(math.prod(kernel.shape[:contracted]), -1)


def _layout(module, contracted: int, layout: Callable):
  return layout(_matrix(module, contracted))


def side_by_side_panels(modules, layout: Callable):
  """The kernels of dense layers that read the same input, side by side as one matrix [d_in, sum of
  their d_out], laid out by `layout`: the panels of side_by_side_product."""
  return layout(jnp.concatenate([_matrix(m, m.contracted()) for m in modules], axis=1))


def side_by_side_product(modules, x, panels):
  """Each module applied to x, from side_by_side_panels(modules, ...): one panel product, split into the
  modules' outputs (each plus its bias, shaped [..., *its features]). The same bits as calling each
  module on its own panels."""
  contracted = modules[0].contracted()
  lead = x.shape[:x.ndim - contracted]
  sizes = [math.prod(m.feature_shape()) for m in modules]
  biases = [_bias(m) for m in modules]
  bias = None if all(b is None for b in biases) else jnp.concatenate(
      [jnp.zeros((size,), jnp.float32) if b is None else b for b, size in zip(biases, sizes)])
  y = _product(x.reshape(math.prod(lead), -1), panels, sum(sizes), bias)   # float32 [n, sum of d_out]
  outputs, start = [], 0
  for module, size in zip(modules, sizes):
    outputs.append(y[:, start:start + size].reshape(lead + module.feature_shape()).astype(module.dtype))
    start += size
  return outputs


class Dense(nn.Dense):
  """nn.Dense, which a decoding step can also run on `decoding_panels`."""

  def contracted(self) -> int:
    return 1

  def feature_shape(self) -> tuple:
    return (self.features,)

  def __call__(self, x, panels=None):
    if panels is None:
      return super().__call__(x)
    return _panel_product(self, x, panels, 1, self.feature_shape())

  def decoding_panels(self, layout: Callable):
    """layout (model/ops.py's Ops.layer_panels) applied to the kernel [d_in, d_out]."""
    return _layout(self, 1, layout)


class DenseGeneral(nn.DenseGeneral):
  """nn.DenseGeneral over trailing axes, which a decoding step can also run on `decoding_panels`."""

  def contracted(self) -> int:
    """How many trailing axes of the input the kernel contracts."""
    axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
    if self.batch_dims or sorted(axes) != list(range(-len(axes), 0)):
      raise ValueError(f"model/dense.py: panels need the trailing axes contracted and no batch_dims, "
                       f"not axis={self.axis}, batch_dims={self.batch_dims}")
    return len(axes)

  def feature_shape(self) -> tuple:
    return (self.features,) if isinstance(self.features, int) else tuple(self.features)

  def __call__(self, x, panels=None):
    if panels is None:
      return super().__call__(x)
    return _panel_product(self, x, panels, self.contracted(), self.feature_shape())

  def decoding_panels(self, layout: Callable):
    """layout (model/ops.py's Ops.layer_panels) applied to the kernel as a matrix [d_in, d_out]."""
    return _layout(self, self.contracted(), layout)
