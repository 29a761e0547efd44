"""Experiments: one Python file per experiment, and the one loader for them.

An experiment file defines `get_config(arg=None) -> ml_collections.ConfigDict` (and may define a
`sweep(add[, arg])`, see jobs/sweep.py, and a `for_platform(config, platform)`, see load_experiment).
`load_experiment('experiments/default.py:smoke')` returns the locked config, with every model and
compute key the file leaves out at its default (run/config.py's fill_defaults: a switch added to model/
needs no line in any experiment), so an override of a key that does not exist (a typo) is an error
instead of a silent no-op.
The trainer's command line (train/__main__.py), the sweep, the benchmarks and the tests all load
experiments through this module.
"""
from __future__ import annotations

import ast
import difflib
import importlib.util
import pathlib

import ml_collections

from run import config as run_config


def load_module(path):
  """Imports an experiment file by its path (it need not be inside this package) and returns the module."""
  file = pathlib.Path(path)
  if not file.is_file():
    raise FileNotFoundError(f"experiment file {str(path)!r} does not exist; pass e.g. experiments/default.py "
                            f"or experiments/default.py:smoke")
  module_spec = importlib.util.spec_from_file_location(f"_experiment_{file.stem}", file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def load_experiment(spec: str, platform: str | None = None) -> ml_collections.ConfigDict:
  """'experiments/default.py:smoke' -> the locked ConfigDict that file's get_config('smoke') returns.

  platform: the JAX backend the run trains on ('cpu', 'gpu', 'tpu'), for an experiment file that defines
  `for_platform(config, platform)` (sizes that follow the device, e.g. experiments/finetune.py's batch
  and dtype); None: get_config's config as it is. The trainer passes it once JAX has started
  (train/__main__.py); the experiment never probes the machine itself.
  """
  path, _, arg = spec.partition(":")
  module = load_module(path)
  if not hasattr(module, "get_config"):
    raise AttributeError(f"{path} has no get_config(arg) function")
  config = run_config.fill_defaults(module.get_config(arg or None))
  if platform is not None and hasattr(module, "for_platform"):
    module.for_platform(config, platform)
  config.lock()
  return config


def _parse_value(text: str, old):
  """Parses an override value like config_flags does: Python literal if possible, else the string."""
  if isinstance(old, str):
    return text
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text
  if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  return value


def apply_overrides(config: ml_collections.ConfigDict, overrides) -> ml_collections.ConfigDict:
  """Applies {'train.num_steps': 10} or ['train.num_steps=10', ...] to a locked config in place.

  A key that does not exist raises KeyError naming it (the config is locked).
  """
  items = overrides.items() if isinstance(overrides, dict) else (o.split("=", 1) for o in overrides)
  for dotted, value in items:
    *parents, leaf = dotted.split(".")
    node = config
    for name in parents:
      if name not in node:
        raise KeyError(f"config override {dotted!r}: no section {name!r}; known: {sorted(node.keys())}")
      node = node[name]
    if leaf not in node:
      # A key that lives in another section (model.dtype moved to compute.dtype) before a similar name.
      elsewhere = [f"{name}.{leaf}" for name, section in config.items()
                   if isinstance(section, ml_collections.ConfigDict) and leaf in section]
      close = elsewhere or difflib.get_close_matches(leaf, list(node.keys()), n=1)
      known = f"did you mean {close[0]!r}?" if close else f"known: {sorted(node.keys())}"
      raise KeyError(f"config override {dotted!r}: no key {leaf!r} in {'.'.join(parents) or 'config'}; "
                     f"{known}")
    old = node[leaf]
    if isinstance(value, str):
      value = _parse_value(value, old)
    if (old is not None and value is not None and not isinstance(value, type(old))
        and not isinstance(old, ml_collections.ConfigDict)):
      raise TypeError(f"config override {dotted}={value!r}: expected a {type(old).__name__} like the "
                      f"experiment's {old!r}")
    with node.ignore_type():
      node[leaf] = value
  return config
