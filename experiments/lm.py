"""A decoder-only language model (GPT-style: causal self-attention, no cross-attention) on the target
(German-like) side of the embedded corpus, with RoPE positions; scored by dev perplexity.

Command:  python -m train --config experiments/lm.py --workdir runs/lm
Expected: dev perplexity 48.8 (eval/nll 3.89 nats per piece, next-piece accuracy 0.26) after 1,000 steps
          (docs/family.md). Perplexity = exp(eval/nll) of the dev
          targets, per piece (EOS included). data.task=lm: every batch row holds BOS + text / text + EOS, packed as the
          default packs its targets; --config.data.text_side=source reads the English-like side instead.
Smoke:    python -m train --config experiments/lm.py:smoke --workdir /tmp/lm_smoke  (seconds)

Why these settings: the default experiment's budget and optimizer; four decoder layers, so that the
parameter count is close to the 2+2-layer encoder-decoder default (the cross-attention it lacks).
"""
from experiments._family import family_config

ARGS = (None, "smoke")


def get_config(arg=None):
  if arg not in ARGS:
    raise ValueError(f"experiments/lm.py: unknown arg {arg!r}; use '' or 'smoke'")
  config = family_config(arg, workdir="runs/lm", task="lm", arch="decoder_only", positions="rope")
  if arg != "smoke":
    config.model.num_decoder_layers = 4
  return config
