"""The optimizer: Adam (beta1 0.9, beta2 0.98, eps 1e-9, as in the paper) with a schedule, and options.

Options (off in the paper): global-norm gradient clipping, and decoupled weight decay (AdamW) on matrices
only (not on biases, LayerNorm scales or offsets). Gradient accumulation lives in train/step.py (a scan
over micro-batches inside the step), so that the loss stays normalised by the tokens of the whole batch.
"""
from __future__ import annotations

import jax
import optax


def _decay_mask(params):
  """True for weight matrices (ndim >= 2), False for biases and norm parameters."""
  return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def make_optimizer(train_config, schedule) -> optax.GradientTransformation:
  """config.train + schedule (count -> lr) -> an optax transformation."""
  c = train_config
  parts = []
  if c.grad_clip_norm and c.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(c.grad_clip_norm))
  if c.weight_decay and c.weight_decay > 0:
    parts.append(optax.adamw(schedule, b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps,
                             weight_decay=c.weight_decay, mask=_decay_mask))
  else:
    parts.append(optax.adam(schedule, b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps))
  return optax.chain(*parts) if len(parts) > 1 else parts[0]
