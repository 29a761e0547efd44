"""Per-token losses in float32. They return SUMS over real tokens; the caller divides by the number of
real target tokens of the whole global batch (not per device, not per micro-batch).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from train import chunked_loss


def smoothed_target(vocab: int, label_smoothing: float):
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
  confidence, low, entropy = smoothed_target(vocab, label_smoothing)
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


def fused_output_losses(y, table, targets, weights, label_smoothing: float, chunk_tokens: int = 1024,
                        matmul_dtype=None, bias=None):
  """The output layer and the three sums above in one pass, without the [tokens, vocab] logits
  (train/chunked_loss.py): (smoothed loss sum, nll sum, correct sum) of logits = y @ table^T (+ bias).

  y [rows, length, d_model]; table [vocab, d_model]; targets, weights [rows, length]; chunk_tokens:
  about this many tokens per chunk; matmul_dtype: None or the operand dtype of mixed precision; bias:
  None or the model's logits bias [vocab]. Gradients flow through the smoothed loss only.
  """
  target = smoothed_target(table.shape[0], label_smoothing)
  return chunked_loss.fused_output_losses(y, table, targets, weights, bias, target, int(chunk_tokens),
                                          matmul_dtype)
