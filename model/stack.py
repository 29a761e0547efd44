"""A stack of identical layers: unrolled (one module per layer, the paper's reading) or scanned, each
layer optionally rematerialized. Neither switch changes what the model computes.

    layers = stack.make(cfg, EncoderLayer, cfg.num_encoder_layers, deterministic_argnum=3)   # in setup
    x = stack.apply(layers, x, mask, deterministic, positions, bias)

cfg.compute.remat: what of a layer's activations the backward pass keeps (jax.checkpoint through nn.remat);
it recomputes the rest from the layer's input:
  none     everything (no recomputation);
  minimal  the outputs of the matmuls with no batch dimension (dots_with_no_batch_dims_saveable): Q, K, V,
           the attention output and the FFN, nearly all of a layer's FLOPs; the scores [b, h, q, k], dropout
           masks, norms and activations are recomputed (a few elementwise passes, two batched matmuls);
  full     the layer's input only: the forward pass runs twice.
cfg.compute.scan_layers: the layers become one nn.scan whose parameters are stacked on a leading axis,
  params[stack]['layers'][...] [num_layers, ...] instead of params[stack]['layers_0'] ...; XLA compiles
  the layer once instead of once per layer. Decoding reads the unrolled layout (run/layout.py converts).
"""
from __future__ import annotations

import flax.linen as nn
import jax

from model.config import TransformerConfig

POLICIES = {"minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable, "full": None}
SCANNED = "layers"   # the scanned stack's module name; the unrolled layers are layers_0, layers_1, ...


def _carry(cls):
  """cls with __call__(x, ...) -> (x, None), the shape of nn.scan's body."""
  class Body(cls):
    def __call__(self, x, *args):
      return super().__call__(x, *args), None
  Body.__name__ = Body.__qualname__ = cls.__name__
  return Body


def make(cfg: TransformerConfig, layer_cls, num_layers: int, deterministic_argnum: int):
  """The layers of one stack, for a module's setup: a list of `num_layers` layer_cls(cfg), or one
  nn.scan over them. deterministic_argnum: where the Python bool `deterministic` is in layer_cls.__call__
  (self counted as 0); remat traces the layer once per value."""
  if cfg.compute.scan_layers and num_layers:
    body = _carry(layer_cls)
    if cfg.compute.remat != "none":   # inside a scan, CSE cannot merge the recomputation away (prevent_cse off)
      body = nn.remat(body, policy=POLICIES[cfg.compute.remat], prevent_cse=False,
                      static_argnums=(deterministic_argnum,))
    scanned = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                      in_axes=nn.broadcast, length=num_layers)
    return scanned(cfg, name=SCANNED)
  if cfg.compute.remat != "none":
    layer_cls = nn.remat(layer_cls, policy=POLICIES[cfg.compute.remat], static_argnums=(deterministic_argnum,))
  return [layer_cls(cfg) for _ in range(num_layers)]


def apply(layers, x, *args):
  """Runs x [b, len, d_model] through the layers from `make`, each called as layer(x, *args)."""
  if isinstance(layers, (list, tuple)):
    for layer in layers:
      x = layer(x, *args)
    return x
  return layers(x, *args)[0]


def check_unrolled(cfg: TransformerConfig, what: str) -> None:
  """Decoding runs layer by layer over the unrolled layout; refuses a scanned model, naming the fix."""
  if cfg.compute.scan_layers:
    raise ValueError(f"{what}: scan_layers=True stacks the layers for training; decode with the unrolled "
                     f"layout: model, params = run.layout.unrolled(model, params) (run.load_run does it)")
