"""Learning-rate schedules, as functions of the optimizer's update count (0 for the first update).

The paper counts steps from 1; with a 0-based count its formula would give lr 0 for the first update,
so every schedule here evaluates at step = count + 1.
"""
from __future__ import annotations

import jax.numpy as jnp


def paper(d_model: int, warmup_steps: int, multiplier: float = 1.0):
  """lrate = multiplier * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (Vaswani et al., sec. 5.3).

  Rises linearly for `warmup_steps` steps to d_model^-0.5 * warmup^-0.5, then decays as step^-0.5.
  """
  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return multiplier * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)
  return schedule


def inverse_sqrt(peak_lr: float, warmup_steps: int):
  """Linear warmup to `peak_lr` at step `warmup_steps`, then peak_lr * sqrt(warmup / step).

  The paper's schedule with its peak set directly instead of through d_model.
  """
  warmup = max(warmup_steps, 1)

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return peak_lr * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))
  return schedule


def cosine(peak_lr: float, warmup_steps: int, total_steps: int, final_fraction: float = 0.0):
  """Linear warmup to `peak_lr`, then a cosine decay to final_fraction * peak_lr at `total_steps`."""
  warmup = max(warmup_steps, 1)
  decay_steps = max(total_steps - warmup, 1)

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    progress = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
    decayed = final_fraction + (1 - final_fraction) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
    return peak_lr * jnp.where(step < warmup, step / warmup, decayed)
  return schedule


def make_schedule(train_config, d_model: int):
  """config.train (schedule, learning_rate, warmup_steps, num_steps) -> count -> lr."""
  name = train_config.schedule
  if name == "paper":
    return paper(d_model, train_config.warmup_steps, train_config.learning_rate)
  if name == "inverse_sqrt":
    return inverse_sqrt(train_config.learning_rate, train_config.warmup_steps)
  if name == "cosine":
    return cosine(train_config.learning_rate, train_config.warmup_steps, train_config.num_steps)
  raise ValueError(f"config.train.schedule={name!r} is not known; use 'paper', 'inverse_sqrt' or 'cosine'")
