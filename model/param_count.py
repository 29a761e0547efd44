"""The number of parameters a config's model has, counted from the shapes `init` would create."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from model.config import TransformerConfig
from model.transformer import Transformer


def num_params(cfg: TransformerConfig) -> int:
  """Parameters `Transformer(cfg).init` creates (with the classification head where cfg has one), from
  jax.eval_shape: nothing is allocated or computed."""
  model = Transformer(cfg)
  ids = jnp.ones((1, 4), jnp.int32)   # [batch, length]: any shape within max_len gives the same params

  def init():
    params = model.init(jax.random.key(0), ids, ids)["params"]
    if cfg.num_classes:   # the pooler and classifier exist only on the classify path
      params = {**params, **model.init(jax.random.key(0), ids, method="classify")["params"]}
    return params

  return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(jax.eval_shape(init)))
