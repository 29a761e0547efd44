"""Per-token losses in float32. They return SUMS over real tokens; the caller divides by the number of
real target tokens of the whole global batch (not per device, not per micro-batch).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from model import precision


def _smoothed_target(vocab: int, label_smoothing: float):
  """The smoothed target distribution q: (probability of the right token, of each other token, entropy
  of q). Python floats."""
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1)
  entropy = -(confidence * np.log(confidence) + (vocab - 1) * low * np.log(low + 1e-20)) \
      if label_smoothing > 0 else 0.0
  return confidence, low, entropy


def smoothed_cross_entropy(logits, targets, weights, label_smoothing: float):
  """Label-smoothed cross-entropy, summed over weighted tokens.

  logits float [b, len, vocab]; targets int [b, len]; weights float [b, len] (1 on real tokens, 0 on pad).
  The smoothed target puts 1 - eps on the right token and eps / (vocab - 1) on each other one (Szegedy
  et al. 2016, as in the paper, eps = 0.1). The entropy of that target is subtracted, so the loss is
  KL(target || model): 0 for a perfect model, equal to the NLL when eps = 0.
  Returns a float32 scalar (sum over tokens).
  """
  vocab = logits.shape[-1]
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)     # [b, len, vocab]
  confidence, low, entropy = _smoothed_target(vocab, label_smoothing)
  target_logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]   # [b, len]
  # sum_v q_v log p_v with q = low everywhere except confidence at the target.
  cross = low * jnp.sum(log_probs, axis=-1) + (confidence - low) * target_logp      # [b, len]
  return jnp.sum((-cross - entropy) * weights)


def nll(logits, targets, weights):
  """Plain negative log-likelihood summed over weighted tokens (float32 scalar)."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  target_logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]   # [b, len]
  return -jnp.sum(target_logp * weights)


def correct(logits, targets, weights):
  """Number of weighted tokens whose target has the highest logit (float32 scalar).

  That is argmax == target, except that a target tied for the maximum counts as correct (argmax would
  pick the first of the tied). Comparing with the row maximum, which the loss computes anyway, saves an
  argmax pass over the [tokens, vocab] logits (XLA's CPU argmax does not vectorize: 4-5% of a step).
  """
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jnp.sum((target_logit >= jnp.max(logits, axis=-1)) * weights)


# ----------------------------------------------------------------------------------------------------
# The output layer and the loss fused, chunk by chunk over target positions.
# ----------------------------------------------------------------------------------------------------
# With a vocabulary of thousands of pieces, the [tokens, vocab] float32 logits are the largest tensor of
# the step (4,096 tokens x 8,000 pieces = 131 MB), and the plain path writes and reads it several times:
# the projection, the log-softmax, the loss, the metrics, and again in the backward pass. Here each chunk
# of tokens computes its logits, the three sums and the gradient of the smoothed loss at once, while its
# logits are still in cache; the full logits never exist. The gradient is ready at the end of the forward
# pass (the residuals), so the backward pass only scales it by the incoming cotangent.


def _chunk_sums_and_grads(y, table, targets, weights, label_smoothing: float, operand_dtype=None):
  """One chunk. y [c, d] (compute dtype), table [vocab, d], targets int [c], weights float32 [c].
  operand_dtype: None, or the dtype the three matmuls read their operands in (mixed precision).

  Returns (loss, nll, correct) float32 scalars, dy [c, d] and dtable_t [d, vocab] (float32), the
  gradients of the smoothed loss sum (the table's transposed).
  """
  vocab = table.shape[0]
  if operand_dtype is not None:
    y, table = y.astype(operand_dtype), table.astype(operand_dtype)
  logits = jnp.einsum("cd,vd->cv", y, table, preferred_element_type=jnp.float32)   # [c, vocab]
  top = jnp.max(logits, axis=-1, keepdims=True)                                    # [c, 1]
  exp = jnp.exp(logits - top)
  total = jnp.sum(exp, axis=-1, keepdims=True)
  lse = (top + jnp.log(total))[:, 0]                                                # [c]
  target_logit = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]      # [c]
  nll_tok = lse - target_logit
  confidence, low, entropy = _smoothed_target(vocab, label_smoothing)
  # sum_v q_v log p_v with q = low everywhere except confidence at the target (see smoothed_cross_entropy).
  cross = low * (jnp.sum(logits, axis=-1) - vocab * lse) + (confidence - low) * (target_logit - lse)
  loss = jnp.sum((-cross - entropy) * weights)
  nll_sum = jnp.sum(nll_tok * weights)
  correct_sum = jnp.sum((target_logit >= top[:, 0]) * weights)   # see `correct`
  # d loss / d logits = (softmax - q) * weight.
  onehot = jnp.arange(vocab)[None, :] == targets[:, None]                          # [c, vocab]
  dlogits = (exp / total - jnp.where(onehot, confidence, low)) * weights[:, None]
  dlogits = dlogits.astype(y.dtype)
  dy = jnp.einsum("cv,vd->cd", dlogits, table, preferred_element_type=jnp.float32)
  # Transposed, [d, vocab]: the matmul then transposes y [c, d] to read it row-major, not the 8x larger
  # dlogits (1.06x-1.08x for the whole step, float32 or mixed, measured side by side).
  dtable_t = precision.einsum("cd,cv->dv", y, dlogits, operand_dtype)
  return (loss, nll_sum, correct_sum), dy, dtable_t


def _fused_forward(y, table, targets, weights, label_smoothing, chunk_tokens, operand_dtype=None):
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
  low_table = table if operand_dtype is None else table.astype(operand_dtype)

  def body(dtable_t, xs):
    yc, tc, wc = xs                                            # [rows, per_chunk, (d)]
    sums, dy, dt = _chunk_sums_and_grads(yc.reshape(-1, d), low_table, tc.reshape(-1), wc.reshape(-1),
                                         label_smoothing, operand_dtype)
    return dtable_t + dt, (sums, dy.reshape(rows, per_chunk, d))

  dtable_t, (sums, dy) = jax.lax.scan(body, jnp.zeros(table.shape[::-1], jnp.float32),
                                      (split(y3), split(t3), split(w3)))
  dtable = dtable_t.T
  sums = tuple(jnp.sum(s) for s in sums)
  dy = jnp.moveaxis(dy, 0, 1).reshape(rows, chunks * per_chunk, d)[:, :length]
  return sums, (dy.reshape(y.shape).astype(y.dtype), dtable.astype(table.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def fused_output_losses(y, table, targets, weights, label_smoothing: float, chunk_tokens: int = 1024,
                        operand_dtype=None):
  """The output projection, softmax and losses in one pass, without materialising the logits.

  y: decoder outputs [rows, length, d_model] (any leading dims before length); table: the output
  embedding [vocab, d_model] (logits = y @ table^T, accumulated in float32); targets int [rows, length];
  weights float [rows, length] (1 on real tokens, 0 on padding). chunk_tokens: about this many tokens
  (rows x a slice of positions) per chunk. operand_dtype: None, or the dtype the matmuls (forward and
  gradient) read their operands in, accumulating in float32 (mixed precision, model/precision.py).
  Returns (smoothed loss sum, nll sum, correct sum), float32 scalars, equal to
  smoothed_cross_entropy, nll and correct on the full logits.
  Gradients flow through the smoothed loss only: nll and correct are metrics (zero gradient).
  """
  sums, _ = _fused_forward(y, table, targets, weights, label_smoothing, chunk_tokens, operand_dtype)
  return sums


def _fused_bwd(label_smoothing, chunk_tokens, operand_dtype, grads, cotangents):
  del label_smoothing, chunk_tokens, operand_dtype
  dy, dtable = grads
  g = cotangents[0]   # the loss's; nll and correct are metrics
  return g.astype(dy.dtype) * dy, g.astype(dtable.dtype) * dtable, None, None


fused_output_losses.defvjp(_fused_forward, _fused_bwd)   # the forward already has the gradient
