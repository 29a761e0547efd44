"""Dense layers that a decoding step can run on their kernels laid out in panels.

A decoding step multiplies a few rows (a device's sentences times the beam) by every kernel of the
decoder. On a CPU, XLA's dot streams a kernel slowly for so few rows; the CPU decoding backend lays each
kernel out once per set of parameters as panels (kernels/output_layer.py, the output layer's layout) and
multiplies by them with a C++ product (kernels/cpu_decoding.py); docs/performance.md has the gain.

These are flax's nn.Dense and nn.DenseGeneral, with the same parameters and the same results when called
as usual. `decoding_panels(layout)` lays out the kernel with the backend's `layout`
(Transformer.decoding_weights; only model/ops.py's CPU decoding backend has one), and `__call__(x, panels)`
multiplies by it (kernels.output_layer.panel_matmul).
"""
from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn

from kernels import output_layer


def _panel_product(module, x, panels, contracted: int, features: tuple):
  """x [..., *contracted axes] times the module's kernel as panels, plus its bias -> [..., *features]."""
  lead = x.shape[:x.ndim - contracted]
  rows = x.reshape(math.prod(lead), -1)                                        # [n, d_in]
  y = output_layer.panel_matmul(rows, panels, math.prod(features))           # float32 [n, d_out]
  if module.use_bias:
    y = y + module.get_variable("params", "bias").reshape(-1)
  return y.reshape(lead + features).astype(module.dtype)


def _layout(module, contracted: int, layout: Callable):
  kernel = module.get_variable("params", "kernel")
  d_in = math.prod(kernel.shape[:contracted])
  return layout(kernel.reshape(d_in, -1))


class Dense(nn.Dense):
  """nn.Dense, which a decoding step can also run on `decoding_panels`."""

  def __call__(self, x, panels=None):
    if panels is None:
      return super().__call__(x)
    return _panel_product(self, x, panels, 1, (self.features,))

  def decoding_panels(self, layout: Callable):
    """layout (model/ops.py's Decoding.layer_panels) applied to the kernel [d_in, d_out]."""
    return _layout(self, 1, layout)


class DenseGeneral(nn.DenseGeneral):
  """nn.DenseGeneral over trailing axes, which a decoding step can also run on `decoding_panels`."""

  def _contracted(self) -> int:
    axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
    if self.batch_dims or sorted(axes) != list(range(-len(axes), 0)):
      raise ValueError(f"model/dense.py: panels need the trailing axes contracted and no batch_dims, "
                       f"not axis={self.axis}, batch_dims={self.batch_dims}")
    return len(axes)

  def __call__(self, x, panels=None):
    if panels is None:
      return super().__call__(x)
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    return _panel_product(self, x, panels, self._contracted(), features)

  def decoding_panels(self, layout: Callable):
    """layout (model/ops.py's Decoding.layer_panels) applied to the kernel as a matrix [d_in, d_out]."""
    return _layout(self, self._contracted(), layout)
