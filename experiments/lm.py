"""A decoder-only language model (GPT-style: causal self-attention, no cross-attention) on the target
(German-like) side of the embedded corpus, with RoPE positions; scored by dev perplexity.

Command:  python -m train --config experiments/lm.py --workdir runs/lm
Expected: not yet measured (docs/family.md). Perplexity = exp(eval/nll) of the dev targets, per piece
          (EOS included); the train loop's batches already hold BOS + target / target + EOS, which is
          exactly a language model's input and output, so this runs on the unchanged train loop.
Smoke:    python -m train --config experiments/lm.py:smoke --workdir /tmp/lm_smoke  (seconds)

Why these settings: the default experiment's budget and optimizer; four decoder layers, so that the
parameter count is close to the 2+2-layer encoder-decoder default (the cross-attention it lacks).
"""
import ml_collections

from experiments import default

ARGS = (None, "smoke")


def get_config(arg=None):
  if arg not in ARGS:
    raise ValueError(f"experiments/lm.py: unknown arg {arg!r}; use '' or 'smoke'")
  config = default.get_config(arg)
  config.workdir = "runs/lm"
  config.model.arch = "decoder_only"
  config.model.positions = "rope"
  config.model.num_kv_heads = ml_collections.FieldReference(None, field_type=int)
  config.model.activation = "relu"
  config.model.norm = "layernorm"
  if arg != "smoke":
    config.model.num_decoder_layers = 4
  # No translation to score: dev loss (perplexity) only.
  config.train.update(test_bleu=False, bleu_every=0, num_samples=0)
  return config
