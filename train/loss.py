"""Per-token losses in float32. They return SUMS over real tokens; the caller divides by the number of
real target tokens of the whole global batch (not per device, not per micro-batch).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


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
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1)
  target_logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]   # [b, len]
  # sum_v q_v log p_v with q = low everywhere except confidence at the target.
  cross = low * jnp.sum(log_probs, axis=-1) + (confidence - low) * target_logp      # [b, len]
  entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20)) \
      if label_smoothing > 0 else 0.0
  return jnp.sum((-cross - entropy) * weights)


def nll(logits, targets, weights):
  """Plain negative log-likelihood summed over weighted tokens (float32 scalar)."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  target_logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]   # [b, len]
  return -jnp.sum(target_logp * weights)


def correct(logits, targets, weights):
  """Number of weighted tokens whose argmax prediction is the target (float32 scalar)."""
  return jnp.sum((jnp.argmax(logits, axis=-1) == targets) * weights)
