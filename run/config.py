"""A run's config: workdir/config.json, written once by the trainer and read by everything that opens the
run (experiments are loaded by experiments/__init__.py).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import ml_collections

from model import Compute, TransformerConfig
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
  config = _renamed_keys(config)
  if not isinstance(config["compute"], dict):
    raise UserError(f"{path} is not a run's config (its compute section is not a JSON object): {DAMAGED}")
  return config


def _renamed_keys(config: dict) -> dict:
  """A config.json written before a key was renamed or moved, in today's keys: model.learned_positions=True
  (older runs) is model.positions='learned'; the compute settings (model.dtype, model.kernels, ...: the
  fields of model.Compute) that older runs kept under "model" are the "compute" section."""
  model = config["model"]
  if "learned_positions" in model:
    model = dict(model)
    if model.pop("learned_positions"):
      model["positions"] = "learned"
    config = {**config, "model": model}
  if "compute" not in config:
    names = {field.name for field in dataclasses.fields(Compute)}
    compute = {key: value for key, value in model.items() if key in names}
    model = {key: value for key, value in model.items() if key not in names}
    config = {**config, "model": model, "compute": compute}
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
  """The changes of `config` since workdir/config.json was written ("key: old -> new"). A run that has
  checkpoints resumes with the same model, data and seed (a change is a UserError); its compute settings
  may change, all but the layout of its parameters (compute.scan_layers: python -m run.convert)."""
  path = pathlib.Path(workdir) / CONFIG_FILE
  if not path.exists():
    return []
  new, old = config.to_dict(), read_config_json(path)
  changes = diff_configs(with_defaults(old, new), new)
  fatal = [c for c in changes if c.startswith(("model.", "data.", "seed:"))]
  if fatal and has_checkpoints:
    raise UserError(f"{path}: this run directory was trained with different settings "
                    f"({'; '.join(fatal)}); use a new --workdir, or restore those values to resume")
  if not has_checkpoints:
    return changes
  old_scan = bool(old["compute"].get("scan_layers", False))
  if old_scan != bool(new["compute"].get("scan_layers", False)):
    raise UserError(f"{path}: config.compute.scan_layers={not old_scan}, but this run's checkpoints hold "
                    f"the {'scanned' if old_scan else 'unrolled'} layout; resume with "
                    f"--config.compute.scan_layers={old_scan}, or convert the run first: python -m run.convert "
                    f"--workdir {workdir} --out NEW --scan_layers={not old_scan}")
  old_impl = old.get("train", {}).get("rng_impl", "threefry")
  new_impl = new.get("train", {}).get("rng_impl", "threefry")
  if old_impl != new_impl:
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


# TransformerConfig's fields that are not config.model keys: the vocabulary's size, and the compute section.
NOT_MODEL_KEYS = ("vocab_size", "compute")


def fill_defaults(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """config (unlocked) with every TransformerConfig field that config.model lacks (but NOT_MODEL_KEYS) and
  every Compute field that config.compute lacks set to its default, in place: an experiment declares what
  it sets, and a switch added to model/ can be set on every experiment's command line
  (--config.model.NAME=VALUE). experiments.load_experiment calls it; a run's config.json holds them all."""
  for section, cls, skip in (("model", TransformerConfig, NOT_MODEL_KEYS), ("compute", Compute, ())):
    values = config[section]
    for field in dataclasses.fields(cls):
      if field.name not in values and field.name not in skip:
        values[field.name] = field.default
  return config


def with_defaults(old: dict, new: dict) -> dict:
  """`old` (a config.json's dict) with every config.model and config.compute key that `new` has and `old`
  lacks set to TransformerConfig's (or Compute's) default: what a run written before the key existed was
  trained with."""
  for section, cls in (("model", TransformerConfig), ("compute", Compute)):
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    values = dict(old.get(section, {}))
    for key in new.get(section, {}):
      if key not in values and key in defaults:
        values[key] = defaults[key]
    old = {**old, section: values}
  return old
