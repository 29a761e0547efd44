"""The decoder's pre-softmax weights laid out once per set of parameters, for incremental decoding.

The model computes logits as y @ table^T with the [vocab, d_model] table (the shared embedding). Inside
the decoding loop XLA:CPU transposes that table at every step; transposed once before the loop (and
rounded to the matmul dtype), the per-step matmul reads it as it lies.

With the C++ kernels (float32), the table is laid out instead as the panels that
kernels/cpu_decoding.py's panel_matmul reads: a decoding step has a few rows (a device's sentences
times the beam), and XLA's dot streams an 8,000-column table slowly for so few. The decoder's other
kernels are laid out the same way (kernel_panels, kernels/cpu_backend.py).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from kernels import cpu_decoding


def decoding_kernel(table, *, dtype):
  """table [vocab, d_model] -> kernel [d_model, vocab] in `dtype` (the matmul operand dtype)."""
  return jnp.swapaxes(table, 0, 1).astype(dtype)


def logits(y, kernel):
  """y [n, d_model] x kernel [d_model, vocab] -> float32 logits [n, vocab] (float32 accumulation)."""
  return jnp.dot(y.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)


def panels(table, width: int):
  """table float32 [vocab, d_model] -> panels [ceil(vocab / width), d_model, width]: panels[p, i, c] =
  table[p * width + c, i], zeros past vocab."""
  vocab, d = table.shape
  count = -(-vocab // width)
  padded = jnp.pad(table.astype(jnp.float32), ((0, count * width - vocab), (0, 0)))
  return jnp.swapaxes(padded.reshape(count, width, d), 1, 2)


def panel_matmul(x, panels, columns: int):
  """x [n, d] times panels [count, d, width] (the layout of `panels`) -> float32 [n, columns]: the C++
  panel product where the program is lowered for a CPU, the same product as an XLA dot elsewhere."""
  def xla(x, panels):
    y = jnp.einsum("nd,pdc->npc", x.astype(jnp.float32), panels, preferred_element_type=jnp.float32)
    return y.reshape(x.shape[0], -1)[:, :columns]
  return cpu_decoding.on_cpu(functools.partial(cpu_decoding.panel_matmul, columns=columns), xla, x, panels)


def decoding_panels(table):
  """decoding_kernel for the C++ path: the table as panel_matmul reads it (this CPU's panel width)."""
  return panels(table, cpu_decoding.panel_width())


def kernel_panels(kernel):
  """A dense layer's kernel [d_in, d_out] as the panels of x @ kernel (kernels/cpu_backend.py)."""
  return decoding_panels(jnp.swapaxes(kernel, 0, 1))


def panel_logits(y, kernel, *, vocab: int):
  """y [n, d_model] x panels (decoding_panels) -> float32 logits [n, vocab]."""
  return panel_matmul(y, kernel, vocab)
