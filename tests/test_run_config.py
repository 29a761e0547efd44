"""run/config.py: a config.json written before the compute section existed reads in today's layout, and a
resume refuses another model, data or seed while the compute settings may change."""
import dataclasses
import json
import pathlib

import ml_collections
import pytest

import experiments
import run
from model import Compute, TransformerConfig
from run import config as config_io
from run.user_errors import UserError

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What `python -m train --config experiments/default.py:smoke` wrote before the compute settings left the
# model section (commit fae0a53).
OLD_CONFIG = ROOT / "tests" / "data" / "config_before_compute.json"
COMPUTE = {field.name for field in dataclasses.fields(Compute)}


# Settings changed on purpose since OLD_CONFIG was written, beside the keys added since:
# decode.batch_tokens 0 is a batch per device, the CPU's being the 4,096 tokens it was (decode/__init__.py).
CHANGED_SINCE = {"decode.batch_tokens"}


def _keys(config: dict, prefix="") -> set[str]:
  return set().union(*({f"{prefix}{k}"} if not isinstance(v, dict) else _keys(v, f"{prefix}{k}.")
                       for k, v in config.items()))


def _since_old(changes: list[str]) -> list[str]:
  """The changes a comparison with OLD_CONFIG lists, less CHANGED_SINCE and the keys added since."""
  old = _keys(config_io.read_config_json(OLD_CONFIG))
  return [c for c in changes if c.split(":")[0] in old and c.split(":")[0] not in CHANGED_SINCE]


def _smoke():
  return experiments.load_experiment(str(ROOT / "experiments" / "default.py") + ":smoke")


def as_old_layout(config: dict) -> dict:
  """A config.json's dict in the layout of OLD_CONFIG: the compute settings under "model"."""
  config = dict(config)
  compute = config.pop("compute")
  return {**config, "model": {**config["model"], **compute}}


def test_an_old_config_json_reads_in_todays_layout():
  old = json.loads(OLD_CONFIG.read_text())
  assert "compute" not in old and COMPUTE <= set(old["model"])
  config = config_io.read_config_json(OLD_CONFIG)
  assert set(config["compute"]) == COMPUTE and not COMPUTE & set(config["model"])
  assert {**config["model"], **config["compute"]} == old["model"]
  # Today's smoke experiment is the run that wrote it: with the keys added since at their defaults (as a
  # resume reads it) nothing differs, and as_old_layout writes that layout.
  today = _smoke().to_dict()
  filled = config_io.with_defaults(config, today)
  assert set(filled["model"]) - set(config["model"]), "no model key was added since: the test checks nothing"
  assert _since_old(config_io.diff_configs(filled, today)) == []
  assert as_old_layout(today)["model"] == {**filled["model"], **filled["compute"]}
  cfg = run.model_config(ml_collections.ConfigDict(config), 300)
  assert cfg.compute == Compute() and cfg.d_model == old["model"]["d_model"]


def _saved(tmp_path, config: dict) -> pathlib.Path:
  (tmp_path / config_io.CONFIG_FILE).write_text(json.dumps(config))
  return tmp_path


def test_a_resume_may_change_the_compute_settings_but_not_the_model(tmp_path):
  workdir = _saved(tmp_path, json.loads(OLD_CONFIG.read_text()))   # also across the layout change
  config = _smoke()
  config.compute.update(dtype="bfloat16", kernels="reference", attention_impl="xla", remat="full")
  config.compute.matmul_dtype = "bfloat16"
  changes = config_io.check_resume(config, workdir, has_checkpoints=True)
  assert _since_old(changes) == ["compute.attention_impl: 'auto' -> 'xla'", "compute.dtype: 'float32' -> 'bfloat16'",
                     "compute.kernels: 'auto' -> 'reference'", "compute.matmul_dtype: None -> 'bfloat16'",
                     "compute.remat: 'none' -> 'full'"]
  for key, value in (("model.d_ff", 48), ("data.vocab_size", 200), ("seed", 1)):
    changed = experiments.apply_overrides(_smoke(), {key: value})
    with pytest.raises(UserError, match=f"trained with different settings .*{key}"):
      config_io.check_resume(changed, workdir, has_checkpoints=True)
    assert config_io.check_resume(changed, workdir, has_checkpoints=False)   # nothing to resume: allowed
  # The layout of the parameters: refused, naming run.convert.
  scanned = experiments.apply_overrides(_smoke(), {"compute.scan_layers": True})
  with pytest.raises(UserError, match="compute.scan_layers=True.*unrolled layout.*python -m run.convert"):
    config_io.check_resume(scanned, workdir, has_checkpoints=True)


def test_an_old_key_on_the_command_line_names_it():
  with pytest.raises(KeyError, match="no key 'dtype' in model; did you mean 'compute.dtype'"):
    experiments.apply_overrides(_smoke(), {"model.dtype": "bfloat16"})


def test_every_model_switch_is_on_the_command_line_without_an_experiment_declaring_it():
  raw = experiments.load_module(str(ROOT / "experiments" / "default.py")).get_config("smoke")
  assert "norm" not in raw.model and "num_kv_heads" not in raw.model   # default.py does not declare them
  config = _smoke()
  fields = {f.name for f in dataclasses.fields(TransformerConfig)} - set(config_io.NOT_MODEL_KEYS)
  assert fields <= set(config.model) and {f.name for f in dataclasses.fields(Compute)} <= set(config.compute)
  experiments.apply_overrides(config, ["model.norm=rmsnorm", "model.num_kv_heads=1",
                                       "model.relative_buckets=8"])
  cfg = run.model_config(config, 300)
  assert (cfg.norm, cfg.kv_heads, cfg.relative_buckets) == ("rmsnorm", 1, 8)
  # Set explicitly, a default reads as what the experiment declared (the config.json of older runs).
  assert run.model_config(_smoke(), 300) == TransformerConfig(vocab_size=300, **raw.model.to_dict(),
                                                              compute=Compute(**raw.compute.to_dict()))
