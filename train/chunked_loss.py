"""The output layer and the label-smoothed loss fused, chunk by chunk over target positions: the loss of
every training and evaluation step, on every platform.

The reference is train/loss.py: logits from the model, then smoothed_cross_entropy, nll and correct.
With a vocabulary of thousands of pieces, the [tokens, vocab] float32 logits are the largest tensor of
the step (25,000 tokens x 37,000 pieces = 3.7 GB on a GPU; 4,096 x 8,000 = 131 MB on a CPU), and the
plain path writes and reads it several times: the projection, the log-softmax, the loss, the metrics,
and again in the backward pass. Here each chunk of tokens computes its logits, the three sums and the
gradient of the smoothed loss at once, while its logits are still in cache; the full logits never exist.
The gradient is ready at the end of the forward pass (the residuals), so the backward pass only scales
it by the incoming cotangent.

The matmuls read their operands in the compute dtype (bfloat16 on an accelerator, or the mixed-precision
operand dtype) and accumulate in float32; the log-softmax, the loss and the logits' gradient before its
rounding are float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels import mixed_matmul

def _chunk_sums_and_grads(y, table, targets, weights, target, matmul_dtype=None, bias=None):
  """One chunk. y [c, d] (compute dtype), table [vocab, d], targets int [c], weights float32 [c].
  target: (confidence, low, entropy) of the smoothed target distribution (train.loss.smoothed_target).
  matmul_dtype: None, or the dtype the three matmuls read their operands in (mixed precision).

  bias: None, or float32 [vocab] added to the logits (the model's logits bias).

  Returns (loss, nll, correct) float32 scalars, dy [c, d], dtable_t [d, vocab] (float32) and dbias
  [vocab] (float32, None without a bias), the gradients of the smoothed loss sum (the table's transposed).
  """
  vocab = table.shape[0]
  if matmul_dtype is not None:
    y, table = y.astype(matmul_dtype), table.astype(matmul_dtype)
  logits = jnp.einsum("cd,vd->cv", y, table, preferred_element_type=jnp.float32)   # [c, vocab]
  if bias is not None:
    logits = logits + bias
  top = jnp.max(logits, axis=-1, keepdims=True)                                    # [c, 1]
  exp = jnp.exp(logits - top)
  total = jnp.sum(exp, axis=-1, keepdims=True)
  lse = (top + jnp.log(total))[:, 0]                                                # [c]
  target_logit = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]      # [c]
  nll_tok = lse - target_logit
  confidence, low, entropy = target
  # sum_v q_v log p_v, q = low everywhere but confidence at the target (train.loss.smoothed_cross_entropy).
  cross = low * (jnp.sum(logits, axis=-1) - vocab * lse) + (confidence - low) * (target_logit - lse)
  loss = jnp.sum((-cross - entropy) * weights)
  nll_sum = jnp.sum(nll_tok * weights)
  correct_sum = jnp.sum((target_logit >= top[:, 0]) * weights)   # see train.loss.correct
  # d loss / d logits = (softmax - q) * weight.
  onehot = jnp.arange(vocab)[None, :] == targets[:, None]                          # [c, vocab]
  dlogits = (exp / total - jnp.where(onehot, confidence, low)) * weights[:, None]
  dbias = None if bias is None else jnp.sum(dlogits, axis=0)
  dlogits = dlogits.astype(y.dtype)
  dy = jnp.einsum("cv,vd->cd", dlogits, table, preferred_element_type=jnp.float32)
  # Transposed, [d, vocab]: the matmul then transposes y [c, d] to read it row-major, not the 8x larger
  # dlogits (what that gained: docs/performance.md).
  dtable_t = mixed_matmul.einsum("cd,cv->dv", y, dlogits, matmul_dtype)
  return (loss, nll_sum, correct_sum), dy, dtable_t, dbias


def _fused_forward(y, table, targets, weights, bias, target, chunk_tokens, matmul_dtype=None):
  """Scans over chunks of target POSITIONS, each holding every row: [rows, positions/chunk, d] at a time.

  Chunking along positions rather than along flattened tokens keeps the rows axis whole in every chunk,
  so when rows are split over devices (data parallelism) each device computes its own rows of every
  chunk and nothing is gathered.
  """
  *lead, length, d = y.shape
  rows = int(np.prod(lead)) if lead else 1
  y3 = y.reshape(rows, length, d)
  t3, w3 = targets.reshape(rows, length), weights.reshape(rows, length).astype(jnp.float32)
  per_chunk = max(1, min(length, int(chunk_tokens) // max(rows, 1)))   # positions per chunk
  chunks = -(-length // per_chunk)
  pad = chunks * per_chunk - length
  if pad:   # padded positions have weight 0: they add nothing to the sums or the gradients
    y3 = jnp.pad(y3, ((0, 0), (0, pad), (0, 0)))
    t3 = jnp.pad(t3, ((0, 0), (0, pad)))
    w3 = jnp.pad(w3, ((0, 0), (0, pad)))

  def split(x):   # [rows, chunks * per_chunk, ...] -> [chunks, rows, per_chunk, ...]
    return jnp.moveaxis(x.reshape(rows, chunks, per_chunk, *x.shape[2:]), 1, 0)

  # Rounded once here rather than in every chunk.
  low_table = table if matmul_dtype is None else table.astype(matmul_dtype)

  def body(carry, xs):
    dtable_t, dbias = carry
    yc, tc, wc = xs                                            # [rows, per_chunk, (d)]
    sums, dy, dt, db = _chunk_sums_and_grads(yc.reshape(-1, d), low_table, tc.reshape(-1), wc.reshape(-1),
                                             target, matmul_dtype, bias)
    dbias = None if bias is None else dbias + db
    return (dtable_t + dt, dbias), (sums, dy.reshape(rows, per_chunk, d))

  zero_bias = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
  (dtable_t, dbias), (sums, dy) = jax.lax.scan(body, (jnp.zeros(table.shape[::-1], jnp.float32), zero_bias),
                                               (split(y3), split(t3), split(w3)))
  # The barrier keeps XLA from folding this transpose into the table gradient's dot when the scan has one
  # chunk: XLA:CPU has no kernel for the bfloat16 dot that would make (tests/test_train_step.py).
  dtable = jax.lax.optimization_barrier(dtable_t).T
  sums = tuple(jnp.sum(s) for s in sums)
  dy = jnp.moveaxis(dy, 0, 1).reshape(rows, chunks * per_chunk, d)[:, :length]
  dbias = None if bias is None else dbias.astype(bias.dtype)
  return sums, (dy.reshape(y.shape).astype(y.dtype), dtable.astype(table.dtype), dbias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def fused_output_losses(y, table, targets, weights, bias, target: tuple, chunk_tokens: int = 1024,
                        matmul_dtype=None):
  """The output projection, softmax and losses in one pass, without materialising the logits.

  y: decoder outputs [rows, length, d_model] (any leading dims before length); table: the output
  embedding [vocab, d_model] (logits = y @ table^T, accumulated in float32); targets int [rows, length];
  weights float [rows, length] (1 on real tokens, 0 on padding); bias: None or float [vocab] added to
  the logits (Transformer's logits bias, cfg.logits_bias); target: (confidence, low, entropy) of
  the smoothed target distribution (train.loss.smoothed_target). chunk_tokens: about this many tokens
  (rows x a slice of positions) per chunk. matmul_dtype: None, or the dtype the matmuls (forward and
  gradient) read their operands in, accumulating in float32 (mixed precision, kernels/mixed_matmul.py).
  Returns (smoothed loss sum, nll sum, correct sum), float32 scalars, equal to
  train.loss's smoothed_cross_entropy, nll and correct on the full logits.
  Gradients flow through the smoothed loss only: nll and correct are metrics (zero gradient).
  """
  sums, _ = _fused_forward(y, table, targets, weights, bias, target, chunk_tokens, matmul_dtype)
  return sums


def _fused_bwd(target, chunk_tokens, matmul_dtype, grads, cotangents):
  del target, chunk_tokens, matmul_dtype
  dy, dtable, dbias = grads
  g = cotangents[0]   # the loss's; nll and correct are metrics
  dbias = None if dbias is None else g.astype(dbias.dtype) * dbias
  return g.astype(dy.dtype) * dy, g.astype(dtable.dtype) * dtable, None, None, dbias


fused_output_losses.defvjp(_fused_forward, _fused_bwd)   # the forward already has the gradient
