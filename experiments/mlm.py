"""A masked language model (BERT-style: a bidirectional encoder with a masked-LM head) on the source
(English-like) side of the embedded corpus; scored by masked-token accuracy on dev.

Command:  python -m train --config experiments/mlm.py --workdir runs/mlm
Expected: masked-token accuracy 0.29 on dev (eval/accuracy, 512 masked pieces; eval/nll 4.06) after 1,000
          steps (docs/family.md). data/synthetic.py draws each
          sentence's nouns, adjectives and verbs at random from a lexicon of ~1,200 words, so a masked
          content word can rarely be told from its context; the grammar's words can. eval/accuracy is
          the masked-token accuracy: the share of the
          masked positions whose original piece gets the highest logit; eval/nll is over the same
          positions. data.task=mlm masks 15% of the real pieces of every batch (80% -> MASK, 10% -> a
          random piece, 10% kept; data/lm.py), the same masks again on a resume (seeded by the batch's
          position) and at every dev eval; --config.data.text_side=target reads the German-like side.
Smoke:    python -m train --config experiments/mlm.py:smoke --workdir /tmp/mlm_smoke  (seconds)

Why these settings: the default experiment's width, optimizer, schedule and 1,000 steps, the paper's
layers; four encoder layers: 1,841,856 parameters with the 8,000-piece vocabulary (the MLM head's
transform, norm and output bias included), against the default's 1,949,696 (five: 2,040,128). Batches
pack up to 2,048 source tokens (slots; the real count is logged), as the default's sources.
"""
from experiments._family import family_config

ARGS = (None, "smoke")


def get_config(arg=None):
  if arg not in ARGS:
    raise ValueError(f"experiments/mlm.py: unknown arg {arg!r}; use '' or 'smoke'")
  config = family_config(arg, workdir="runs/mlm", task="mlm", arch="encoder_only")
  config.model.num_decoder_layers = 0
  if arg != "smoke":
    config.model.num_encoder_layers = 4
  return config
