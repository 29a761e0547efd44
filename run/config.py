"""A run's config: workdir/config.json, written once by the trainer and read by everything that opens the
run (experiments are loaded by experiments/__init__.py).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import ml_collections

from model import TransformerConfig
from run.user_errors import UserError
from run.workdir import DAMAGED, read_file, run_file, write_atomically

CONFIG_FILE = "config.json"


def save_config(config: ml_collections.ConfigDict, workdir) -> pathlib.Path:
  """Writes workdir/config.json (atomically: tmp file then rename)."""
  return write_atomically(pathlib.Path(workdir) / CONFIG_FILE,
                          json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")


def read_config_json(path) -> dict:
  """A run's config.json as a dict; not JSON, or not a config's sections, is a UserError naming it."""
  try:
    config = json.loads(read_file(path))
  except json.JSONDecodeError as error:
    raise UserError(f"{path} is not valid JSON ({error.msg}, line {error.lineno} column {error.colno}): "
                    f"{DAMAGED}") from None
  sections = ("model", "data", "train")
  if not isinstance(config, dict) or not all(isinstance(config.get(s), dict) for s in sections):
    raise UserError(f"{path} is not a run's config (a JSON object with the sections {', '.join(sections)}): "
                    f"{DAMAGED}")
  return _renamed_keys(config)


def _renamed_keys(config: dict) -> dict:
  """A config.json written before a key was renamed, in today's keys: model.learned_positions=True
  (older runs) is model.positions='learned'."""
  model = config["model"]
  if "learned_positions" in model:
    model = dict(model)
    if model.pop("learned_positions"):
      model["positions"] = "learned"
    config = {**config, "model": model}
  return config


def load_run_config(workdir) -> ml_collections.ConfigDict:
  """workdir/config.json -> the locked ConfigDict the run was trained with."""
  config = ml_collections.ConfigDict(read_config_json(run_file(workdir, CONFIG_FILE)))
  config.lock()
  return config


def recorded_max_len(workdir) -> int:
  """config.data.max_len as workdir/config.json records it, 0 where there is none: a run that asked for
  max_len=0 records the value it derived from its corpus, and resumes with that value."""
  path = pathlib.Path(workdir) / CONFIG_FILE
  if not path.exists():
    return 0
  return int(read_config_json(path)["data"].get("max_len", 0) or 0)


def check_resume(config: ml_collections.ConfigDict, workdir, has_checkpoints: bool) -> list[str]:
  """The changes of `config` since workdir/config.json was written ("key: old -> new"); a change of the
  model, data or seed of a run that has checkpoints is a UserError (kernels, remat and attention_impl
  compute the same parameters, so they may change)."""
  path = pathlib.Path(workdir) / CONFIG_FILE
  if not path.exists():
    return []
  new = config.to_dict()
  changes = diff_configs(with_model_defaults(read_config_json(path), new), new)
  fatal = [c for c in changes if c.startswith(("model.", "data.", "seed:"))
           and not c.startswith(("model.kernels:", "model.remat:", "model.attention_impl:"))]
  if fatal and has_checkpoints:
    raise UserError(f"{path}: this run directory was trained with different settings "
                    f"({'; '.join(fatal)}); use a new --workdir, or restore those values to resume")
  old_impl = read_config_json(path).get("train", {}).get("rng_impl", "threefry")
  new_impl = new.get("train", {}).get("rng_impl", "threefry")
  if old_impl != new_impl and has_checkpoints:
    raise UserError(f"{path}: config.train.rng_impl={new_impl!r}, but this run's checkpoints hold a "
                    f"{old_impl!r} dropout key, and a key of one implementation cannot continue another's "
                    f"random stream; resume with --config.train.rng_impl={old_impl}, or use a new --workdir")
  return changes


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


def with_model_defaults(old: dict, new: dict) -> dict:
  """`old` (a config.json's dict) with every config.model key that `new` has and `old` lacks set to
  TransformerConfig's default: what a run written before the key existed was trained with."""
  defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
  model = dict(old.get("model", {}))
  for key in new.get("model", {}):
    if key not in model and key in defaults:
      model[key] = defaults[key]
  return {**old, "model": model} if "model" in old else old
