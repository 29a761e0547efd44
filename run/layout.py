"""The two layouts of a model's parameters (model/stack.py, compute.scan_layers): unrolled,
params[stack]['layers_i'] per layer, and scanned, params[stack]['layers'] with leaves [num_layers, ...].
Training runs in either; decoding and export read the unrolled one (`run.load_run` unrolls a scanned run
when it opens it), and run/convert.py rewrites a run's checkpoints from one into the other.
"""
from __future__ import annotations

import jax
import numpy as np

from model.stack import SCANNED

STACKS = ("encoder", "decoder")   # the Transformer's stacks of layers


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
