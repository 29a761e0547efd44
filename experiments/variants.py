"""The family on the default translation task: positions x attention x feed-forward, each trial the
default experiment with one combination of switches (docs/family.md).

Command:  python -m train.sweep --config experiments/variants.py   (the trials of `sweep` below)
          one trial: python -m train --config experiments/variants.py --config.model.positions=rope
Expected: not yet measured (docs/family.md): the results table and plot are to be filled in by a run.
Smoke:    python -m train --config experiments/variants.py:smoke --workdir /tmp/variants_smoke

The trials keep everything else at the default experiment's settings; GQA/MQA change the parameter
count (fewer key/value projections), SwiGLU/GeGLU add a third FFN matrix (d_ff is left as is).
"""
import ml_collections

from experiments import default

ARGS = (None, "smoke")
POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "relative")
ATTENTION = {"mha": None, "gqa2": 2, "mqa": 1}          # num_kv_heads (default: num_heads = 4)
FFN = ("relu", "gelu", "swiglu", "geglu")


def get_config(arg=None):
  if arg not in ARGS:
    raise ValueError(f"experiments/variants.py: unknown arg {arg!r}; use '' or 'smoke'")
  config = default.get_config(arg)
  config.workdir = "runs/variants"
  config.model.arch = "encoder_decoder"
  config.model.positions = "sinusoidal"
  config.model.num_kv_heads = ml_collections.FieldReference(None, field_type=int)
  config.model.activation = "relu"
  config.model.norm = "layernorm"
  if arg == "smoke":   # one non-default combination end to end, test-set beam search included
    config.model.update(positions="rope", activation="swiglu", norm="rmsnorm")
    config.model.num_kv_heads = 1
  return config


def sweep(add, arg=None):
  """Calls add(name=..., **overrides) once per trial: every positions x attention x FFN choice."""
  if arg == "smoke":
    add(name="rope_mqa_swiglu", **{"model.positions": "rope", "model.num_kv_heads": 1,
                                   "model.activation": "swiglu"})
    return
  for positions in POSITIONS:
    for attention, kv_heads in ATTENTION.items():
      for ffn in FFN:
        overrides = {"model.positions": positions, "model.activation": ffn}
        if kv_heads is not None:
          overrides["model.num_kv_heads"] = kv_heads
        add(name=f"{positions}_{attention}_{ffn}", **overrides)
