"""A stack of identical layers: unrolled (one module per layer, the paper's reading) or scanned, each
layer optionally rematerialized. Neither switch changes what the model computes.

    layers = stack.make(cfg, EncoderLayer, cfg.num_encoder_layers, deterministic_argnum=3)   # in setup
    x = stack.apply(layers, x, mask, deterministic, positions, bias)

cfg.compute.remat: which activations of a layer the backward pass keeps; the rest it recomputes from the layer's
input (jax.checkpoint through nn.remat):
  none     everything the forward pass made (no recomputation);
  minimal  the outputs of the matmuls with no batch dimension (jax.checkpoint_policies.
           dots_with_no_batch_dims_saveable): the projections Q, K, V, the attention output and the FFN,
           which hold nearly all of a layer's FLOPs; attention scores and probabilities [b, h, q, k],
           dropout masks, norms and activations are recomputed, which costs a few elementwise passes
           and the two batched attention matmuls;
  full     nothing but the layer's input: the forward pass is run twice.
cfg.compute.scan_layers: the layers become one nn.scan whose parameters are stacked on a leading axis,
  params[stack]['layers'][...] [num_layers, ...] instead of params[stack]['layers_0'] ...; XLA compiles
  the layer once instead of once per layer. `unroll_params` and `scan_params` convert between the two
  layouts; decoding reads the unrolled one (run.load_run converts a scanned run when it opens it).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np

from model.config import TransformerConfig

POLICIES = {"minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable, "full": None}
STACKS = ("encoder", "decoder")
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
                     f"layout: model, params = model.stack.unrolled(model, params) (run.load_run does it)")


def _layer_index(name: str) -> int | None:
  prefix, _, index = name.rpartition("_")
  return int(index) if prefix == SCANNED and index.isdigit() else None


def unroll_params(params):
  """A parameter tree in the scanned layout -> the unrolled one (unchanged where already unrolled).

  params[stack]['layers'] leaves [num_layers, ...] -> params[stack]['layers_i'] leaves [...]. Works on
  any tree of that structure (Adam's moments too) and on host or device arrays."""
  params = dict(params)
  for name in STACKS:
    if name in params and SCANNED in params[name]:
      part = dict(params[name])
      stacked = part.pop(SCANNED)
      for i in range(jax.tree_util.tree_leaves(stacked)[0].shape[0]):
        part[f"{SCANNED}_{i}"] = jax.tree_util.tree_map(lambda a, i=i: a[i], stacked)
      params[name] = part
  return params


def scan_params(params):
  """The inverse of `unroll_params`: params[stack]['layers_i'] -> params[stack]['layers'] stacked, as
  host (numpy) arrays."""
  params = dict(params)
  for name in STACKS:
    if name in params:
      part = dict(params[name])
      indices = sorted(i for i in map(_layer_index, part) if i is not None)
      if indices:
        layers = [part.pop(f"{SCANNED}_{i}") for i in indices]
        part[SCANNED] = jax.tree_util.tree_map(lambda *a: np.stack([np.asarray(x) for x in a]), *layers)
        params[name] = part
  return params


def unrolled(model, params):
  """(model, params) -> the same model with scan_layers=False and its parameters in that layout."""
  if not model.cfg.compute.scan_layers:
    return model, params
  return type(model)(model.cfg.with_compute(scan_layers=False)), unroll_params(params)
