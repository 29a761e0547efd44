"""The family on the default translation task, one switch at a time from the default experiment (as the
paper's Table 3 varies one thing at a time from its base model), or the whole grid (docs/family.md).

Command:  python -m jobs.sweep --config experiments/variants.py --workdir runs/variants   (11 trials)
          the grid: python -m jobs.sweep --config experiments/variants.py:grid --workdir runs/variants_grid
          (positions x attention x FFN = 5 x 3 x 4 = 60 trials)
          one trial: python -m train --config experiments/variants.py --config.model.positions=rope
Expected (docs/variants/results.md): base = the default experiment (test BLEU 97.94); RoPE
          99.69, relative 99.05, ALiBi 96.32, learned positions 84.49 (one seed each); the rest in the docs.
Smoke:    python -m train --config experiments/variants.py:smoke --workdir /tmp/variants_smoke

The default sweep: base (the default experiment: sinusoidal positions, MHA, ReLU, LayerNorm), then
each other positions kind, GQA with 2 key/value heads, MQA, each other activation, and RMSNorm, every
other setting as in experiments/default.py. GQA/MQA change the parameter count (fewer key/value
projections), SwiGLU/GeGLU add a third FFN matrix (d_ff is left as is).
"""
from experiments._family import family_config

ARGS = (None, "smoke", "grid")
POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "relative")
ATTENTION = {"mha": None, "gqa2": 2, "mqa": 1}          # num_kv_heads (default: num_heads = 4)
FFN = ("relu", "gelu", "swiglu", "geglu")


def get_config(arg=None):
  """The default experiment with the family switches declared ('grid': the same; it names the sweep)."""
  if arg not in ARGS:
    raise ValueError(f"experiments/variants.py: unknown arg {arg!r}; use '', 'smoke' or 'grid'")
  if arg == "smoke":   # one non-default combination end to end, test-set beam search included
    return family_config(arg, workdir="runs/variants", positions="rope", num_kv_heads=1,
                         activation="swiglu", norm="rmsnorm")
  return family_config(arg, workdir="runs/variants")


def _attention(kv_heads):
  return {} if kv_heads is None else {"model.num_kv_heads": kv_heads}


def sweep(add, arg=None):
  """Calls add(name=..., **overrides) once per trial: one switch at a time from the default experiment
  (11 trials), or with arg 'grid' every positions x attention x FFN choice (60)."""
  if arg == "smoke":
    add(name="rope_mqa_swiglu", **{"model.positions": "rope", "model.num_kv_heads": 1,
                                   "model.activation": "swiglu"})
  elif arg == "grid":
    for positions in POSITIONS:
      for attention, kv_heads in ATTENTION.items():
        for ffn in FFN:
          add(name=f"{positions}_{attention}_{ffn}", **{"model.positions": positions,
                                                        "model.activation": ffn, **_attention(kv_heads)})
  else:
    add(name="base")
    for positions in POSITIONS[1:]:
      add(name=f"pos_{positions}", **{"model.positions": positions})
    for attention, kv_heads in list(ATTENTION.items())[1:]:
      add(name=attention, **_attention(kv_heads))
    for ffn in FFN[1:]:
      add(name=f"ffn_{ffn}", **{"model.activation": ffn})
    add(name="rmsnorm", **{"model.norm": "rmsnorm"})
