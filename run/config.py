"""Experiment configs: load `experiments/<name>.py[:arg]`, apply overrides, save and reload a run's config.

An experiment file defines `get_config(arg=None) -> ml_collections.ConfigDict`. Configs are locked after
loading, so an override of a key that does not exist (a typo) is an error instead of a silent no-op.
The command line uses `ml_collections.config_flags` (see train/__main__.py); these functions are the same
thing for tests and notebooks.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import pathlib

import ml_collections

CONFIG_FILE = "config.json"


def load_experiment(spec: str) -> ml_collections.ConfigDict:
  """'experiments/default.py:smoke' -> the locked ConfigDict that file's get_config('smoke') returns."""
  path, _, arg = spec.partition(":")
  file = pathlib.Path(path)
  if not file.is_file():
    raise FileNotFoundError(f"experiment file {path!r} (from {spec!r}) does not exist; "
                            f"pass e.g. experiments/default.py or experiments/default.py:smoke")
  module_spec = importlib.util.spec_from_file_location(f"_experiment_{file.stem}", file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise AttributeError(f"{path} has no get_config(arg) function")
  config = module.get_config(arg or None)
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
      raise KeyError(f"config override {dotted!r}: no key {leaf!r} in "
                     f"{'.'.join(parents) or 'config'}; known: {sorted(node.keys())}")
    if isinstance(value, str):
      value = _parse_value(value, node[leaf])
    with node.ignore_type():
      node[leaf] = value
  return config


def save_config(config: ml_collections.ConfigDict, workdir) -> pathlib.Path:
  """Writes workdir/config.json (atomically: tmp file then rename)."""
  path = pathlib.Path(workdir) / CONFIG_FILE
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
  tmp.replace(path)
  return path


def load_run_config(workdir) -> ml_collections.ConfigDict:
  """workdir/config.json -> the locked ConfigDict the run was trained with."""
  path = pathlib.Path(workdir) / CONFIG_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{path} not found: is {workdir!r} a run directory written by `python -m train`?")
  config = ml_collections.ConfigDict(json.loads(path.read_text()))
  config.lock()
  return config


def diff_configs(old: dict, new: dict, prefix: str = "") -> list[str]:
  """Dotted keys whose values differ between two nested dicts (missing keys count as different)."""
  keys = sorted(set(old) | set(new))
  out = []
  for key in keys:
    a, b = old.get(key), new.get(key)
    name = f"{prefix}{key}"
    if isinstance(a, dict) and isinstance(b, dict):
      out += diff_configs(a, b, name + ".")
    elif a != b:
      out.append(f"{name}: {a!r} -> {b!r}")
  return out
