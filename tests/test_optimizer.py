"""train/optimizer.py: weight decay shrinks weight matrices only (experiments/small_corpus.py relies on it)."""
import types

import jax.numpy as jnp
import numpy as np
import optax

from train.optimizer import make_optimizer


def _train_config(weight_decay):
  return types.SimpleNamespace(grad_clip_norm=0.0, weight_decay=weight_decay,
                               adam_b1=0.9, adam_b2=0.98, adam_eps=1e-9)


def _step_with_zero_gradients(weight_decay, lr=0.01):
  params = {"dense": {"kernel": jnp.full((3, 4), 2.0), "bias": jnp.full((4,), 2.0)},
            "norm": {"scale": jnp.full((4,), 2.0)}, "embed": jnp.full((5, 3), 2.0)}
  tx = make_optimizer(_train_config(weight_decay), optax.constant_schedule(lr))
  grads = {"dense": {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros((4,))},
           "norm": {"scale": jnp.zeros((4,))}, "embed": jnp.zeros((5, 3))}
  updates, _ = tx.update(grads, tx.init(params), params)
  return optax.apply_updates(params, updates)


def test_weight_decay_shrinks_matrices_and_spares_biases_and_norms():
  new = _step_with_zero_gradients(weight_decay=0.2, lr=0.01)
  # Decoupled (AdamW): with zero gradients a matrix shrinks by lr * weight_decay, whatever Adam's moments.
  np.testing.assert_allclose(new["dense"]["kernel"], 2.0 * (1 - 0.01 * 0.2), rtol=1e-6)
  np.testing.assert_allclose(new["embed"], 2.0 * (1 - 0.01 * 0.2), rtol=1e-6)
  np.testing.assert_array_equal(new["dense"]["bias"], 2.0)
  np.testing.assert_array_equal(new["norm"]["scale"], 2.0)


def test_no_weight_decay_leaves_parameters_with_zero_gradients_alone():
  new = _step_with_zero_gradients(weight_decay=0.0)
  for leaf in (new["dense"]["kernel"], new["dense"]["bias"], new["norm"]["scale"], new["embed"]):
    np.testing.assert_array_equal(leaf, 2.0)
