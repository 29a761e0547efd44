"""Table 3 of the paper: variations on the base model, WMT14 EN-DE, scored on newstest2013 (dev).

Command (20 trials, each its own run directory under runs/table3/<trial>; see REPRODUCING.md):
  python -m train.sweep --config experiments/table3.py --workdir runs/table3 --parallel 1 \\
      --config.data.tfds_data_dir=DIR
  One trial alone:   python -m train --config experiments/table3.py --workdir runs/table3/A_h1 \\
      --config.model.num_heads=1 --config.model.d_k=512 --config.model.d_v=512 ...
Smoke (two tiny trials on the embedded corpus, ~1 minute on 2 CPU cores):
  python -m train.sweep --config experiments/table3.py:smoke --workdir /tmp/table3_smoke --parallel 2
Args: ARGS below ('base' is the default: the base model, which every trial overrides).

Expected: each trial's dev PPL and BLEU near PAPER[trial] below (per-piece PPL of the final checkpoint,
  beam 4, no checkpoint averaging). Our PPL is per SentencePiece piece with a 37k vocabulary, the paper's
  per word-piece of its own 37k BPE, so absolute PPL can differ by a few percent; the differences
  between rows are what the sweep reproduces. Our BLEU is sacreBLEU (13a, detokenized), ~0.7-1.5 below
  the paper's tokenized BLEU (PAPER.md). The train loop measures dev BLEU every bleu_every steps but not
  at the last step (the end of a run scores the test set), so results.md gives the last dev BLEU and
  its step.
Cost: 19 base-sized trials of 100K steps (~9.5e17 model FLOPs each; the C rows range from 0.4x to 2.6x
  that) plus the big model (300K steps, ~9.6e18): ~2.8e19 FLOPs in all, ~10.5 h on one 8-A100 machine
  at 30% of bf16 peak, one trial at a time on all 8 devices (REPRODUCING.md).
"""
import ml_collections

from experiments import wmt14_ende

ARGS = ("base", "smoke")

# The paper's Table 3: dev (newstest2013) perplexity, BLEU, and parameters in millions where given.
PAPER = {
    "base":       dict(ppl=4.92, bleu=25.8, params_m=65),
    "A_h1":       dict(ppl=5.29, bleu=24.9, params_m=None),
    "A_h4":       dict(ppl=5.00, bleu=25.5, params_m=None),
    "A_h16":      dict(ppl=4.91, bleu=25.8, params_m=None),
    "A_h32":      dict(ppl=5.01, bleu=25.4, params_m=None),
    "B_dk16":     dict(ppl=5.16, bleu=25.1, params_m=58),
    "B_dk32":     dict(ppl=5.01, bleu=25.4, params_m=60),
    "C_N2":       dict(ppl=6.11, bleu=23.7, params_m=36),
    "C_N4":       dict(ppl=5.19, bleu=25.3, params_m=50),
    "C_N8":       dict(ppl=4.88, bleu=25.5, params_m=80),
    "C_d256":     dict(ppl=5.75, bleu=24.5, params_m=28),
    "C_d1024":    dict(ppl=4.66, bleu=26.0, params_m=168),
    "C_dff1024":  dict(ppl=5.12, bleu=25.4, params_m=53),
    "C_dff4096":  dict(ppl=4.75, bleu=26.2, params_m=90),
    "D_drop0.0":  dict(ppl=5.77, bleu=24.6, params_m=None),
    "D_drop0.2":  dict(ppl=4.95, bleu=25.5, params_m=None),
    "D_ls0.0":    dict(ppl=4.67, bleu=25.3, params_m=None),
    "D_ls0.2":    dict(ppl=5.47, bleu=25.7, params_m=None),
    "E_learned":  dict(ppl=4.92, bleu=25.7, params_m=None),
    "big":        dict(ppl=4.33, bleu=26.4, params_m=213),
}


def get_config(arg=None):
  arg = arg or "base"
  if arg not in ARGS:
    raise ValueError(f"experiments/table3.py: unknown arg {arg!r}; use one of {ARGS}")
  config = wmt14_ende.paper_config("base", tfds_name="wmt14_translate/de-en", src_lang="en",
                                   tgt_lang="de", vocab_size=37_000, big_dropout=0.3,
                                   grad_accum_steps=1)
  config.workdir = "runs/table3"
  # Dev BLEU often enough that the last measurement is close to the end (it is skipped at the last step).
  config.train.update(eval_every=5000, bleu_every=5000)
  if arg == "smoke":
    config = wmt14_ende.shrink_to_smoke(config)
    config.workdir = "runs/table3_smoke"
    # Enough steps for the loss to move, a dev BLEU at step 4, a 32-sentence dev set: ~20 s a trial.
    config.train.update(num_steps=8, warmup_steps=4, learning_rate=2.0, log_every=2, eval_every=4,
                        bleu_every=4, checkpoint_every_steps=4, dev_sentences=32, test_bleu=False,
                        tensorboard=False)
  return config


def sweep(add, arg=None):
  """Calls add(name=..., **overrides) once per trial: the rows of Table 3 (A to E, and big)."""
  if arg == "smoke":
    add(name="base")
    add(name="C_N2", **{"model.num_encoder_layers": 2, "model.num_decoder_layers": 2})
    return

  add(name="base")
  # (A) attention heads at constant computation: h * d_k = 512.
  for h in (1, 4, 16, 32):
    add(name=f"A_h{h}", **{"model.num_heads": h, "model.d_k": 512 // h, "model.d_v": 512 // h})
  # (B) smaller keys only; values keep d_v = 64.
  for d_k in (16, 32):
    add(name=f"B_dk{d_k}", **{"model.d_k": d_k, "model.d_v": 64})
  # (C) model size.
  for n in (2, 4, 8):
    add(name=f"C_N{n}", **{"model.num_encoder_layers": n, "model.num_decoder_layers": n})
  add(name="C_d256", **{"model.d_model": 256, "model.d_k": 32, "model.d_v": 32})
  add(name="C_d1024", **{"model.d_model": 1024, "model.d_k": 128, "model.d_v": 128})
  for d_ff in (1024, 4096):
    add(name=f"C_dff{d_ff}", **{"model.d_ff": d_ff})
  # (D) regularization.
  for rate in (0.0, 0.2):
    add(name=f"D_drop{rate}", **{"model.dropout_rate": rate})
  for eps in (0.0, 0.2):
    add(name=f"D_ls{eps}", **{"train.label_smoothing": eps})
  # (E) learned positional embeddings instead of sinusoids.
  add(name="E_learned", **{"model.learned_positions": True})
  # The big model (300K steps; dropout 0.3 as for EN-DE in Table 2).
  add(name="big", **{"model.d_model": 1024, "model.d_ff": 4096, "model.num_heads": 16,
                     "model.dropout_rate": 0.3, "train.num_steps": 300_000,
                     "train.keep_checkpoints": 20})
  # Settings that did not help go here as comments, with the numbers they got, e.g.
  #   add(name="pre_norm", **{"model.pre_norm": True})   # not run yet
