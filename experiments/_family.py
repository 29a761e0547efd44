"""The family's settings on the default experiment, shared by lm.py, variants.py, decoder_only_mt.py and
mlm.py (not an experiment: it has no get_config).

`family_config` sets the switches of model.config.TransformerConfig (arch, positions, num_kv_heads,
activation, norm) and config.data.task to what a caller asks. Neither it nor experiments/default.py need
declare a switch for the command line to set it: experiments.load_experiment fills every model key an
experiment leaves out with its default (run/config.py's fill_defaults), and a resume reads a config.json
written before a key existed with that default (run/config.py's with_defaults).
"""
import ml_collections

from data.tasks import TRANSLATING
from experiments import default


def family_config(arg, *, workdir, task="translation", arch="encoder_decoder", positions="sinusoidal",
                  num_kv_heads=None, activation="relu", norm="layernorm"):
  """default.get_config(arg) ('smoke' or the full experiment, whatever other arg names the caller's
  variant) with the family switches and data.task set as given (the paper's choices by default). lm and
  mlm also declare data.text_side ('': the task's default side) and score no BLEU."""
  config = default.get_config("smoke" if arg == "smoke" else None)
  config.workdir = workdir
  config.model.arch = arch
  config.model.positions = positions
  # Typed, so that --config.model.num_kv_heads=1 can override a None.
  config.model.num_kv_heads = ml_collections.FieldReference(num_kv_heads, field_type=int)
  config.model.activation = activation
  config.model.norm = norm
  config.data.task = task
  if task not in TRANSLATING:
    config.data.text_side = ""
    config.train.update(test_bleu=False, bleu_every=0, num_samples=0)
  return config
