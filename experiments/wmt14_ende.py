"""The paper's WMT14 English->German models (Table 2): Transformer base and big, with the paper's settings.

Commands (data prepared as in REPRODUCING.md; DIR = the TFDS data directory):
  python -m train --config experiments/wmt14_ende.py:base --workdir runs/ende_base \\
      --config.data.tfds_data_dir=DIR
  python -m train --config experiments/wmt14_ende.py:big --workdir runs/ende_big \\
      --config.data.tfds_data_dir=DIR --config.train.grad_accum_steps=2
(The end of training writes the average of the last 5 (big: 20) step checkpoints, 1,500 (big: 600) steps
apart as the paper's 10-minute checkpoints were, to RUN/averaged and prints test BLEU of both it and the
final parameters: config.train.average_last, average_every_steps.)
Smoke (seconds, offline, on the embedded corpus with a tiny model):
  python -m train --config experiments/wmt14_ende.py:base_smoke --workdir /tmp/ende_smoke
and on WMT14 as prepared in DIR (a check of the data and of the whole chain; REPRODUCING.md):
  python -m train --config experiments/wmt14_ende.py:smoke --workdir /tmp/ende_smoke_wmt \\
      --config.data.tfds_data_dir=DIR
Args: ARGS below. 'smoke' is 'base_smoke'; '<size>_smoke' keeps that size's training settings (dropout,
checkpoints kept) but swaps in default.py's smoke model, corpus and step counts.

Expected (newstest2014, average of the last 5 / 20 checkpoints, beam 4, alpha 0.6; the averaged line):
  base: paper 27.3 BLEU (tokenized, compounds split) ~ 26-26.5 sacreBLEU; dev (newstest2013) PPL 4.92.
  big:  paper 28.4 BLEU ~ 27-27.5 sacreBLEU; dev PPL 4.33.
  (The paper's BLEU reads 0.7-1.5 points above sacreBLEU's 13a on the same output; python -m decode
  prints both, the paper's computed as get_ende_bleu.sh does: decode/bleu.py.)
Cost (paper: 8 P100s; base 100K steps in 12 h, big 300K steps in 3.5 days). Model FLOPs, 6 * params *
  tokens with ~25k source + 25k target tokens per step: base ~9.5e12 / step, ~9.5e17 in all; big ~3.2e13 /
  step, ~9.6e18 in all. Projected from one H200's measured step (commit 74f30f5: 26.5% MFU for base,
  39.6% for big at 25k tokens a step; nothing measured on 8 GPUs or over a whole run), in bfloat16 as
  configured: base ~1.0 h on 1 H100/H200, ~3.2 h on 1 A100; big ~6.8 h on 1 H100/H200, ~22 h on 1
  A100. REPRODUCING.md derives these numbers and says what each assumes.

Batches: the paper's "approximately 25000 source tokens and 25000 target tokens" per step, counted as it
and fairseq's --max-tokens count them: config.data.batch_tokens=25,000 bounds the real (not padded)
source tokens and, separately, the real target tokens (+ EOS) of each batch of one length bucket
(data.batching.plan_buckets); metrics.jsonl reports both per batch (train/src_tokens_per_batch,
train/tgt_tokens_per_batch). A batch's fixed shape has room for its bucket's shortest pairs, so it holds
up to ~1.5x as many slots, the unused rows being padding. The batch is split over the devices and then
into config.train.grad_accum_steps micro-batches, so fewer or smaller devices keep the paper's batch by
raising grad_accum_steps: each device holds batch_tokens / (devices * grad_accum_steps) real tokens per
side at once. The models compute in bfloat16 (compute.dtype; float32 parameters, optimizer state,
softmax, norms and loss); --config.compute.dtype=float32 trains in float32 instead.

The TFDS splits of wmt14_translate/de-en (tensorflow_datasets/translate/wmt14.py, checked in the installed
4.9.10): 'train' = europarl_v7 + commoncrawl + newscommentary_v9 (4.5M pairs), 'validation' =
newstest2013 (3000 pairs; the newsdev2014 subset it lists exists only for hi-en), 'test' = newstest2014
(3003 pairs, the full set the paper and sacreBLEU's wmt14 use). data/ maps dev -> 'validation' and
test -> 'test'.
"""
import ml_collections

from experiments import default

ARGS = ("base", "big", "smoke", "base_smoke", "big_smoke")

# What the model sections of the paper's two sizes change from TransformerConfig's fields.
_SIZES = {
    "base": dict(d_model=512, d_ff=2048, num_heads=8, num_encoder_layers=6, num_decoder_layers=6),
    "big": dict(d_model=1024, d_ff=4096, num_heads=16, num_encoder_layers=6, num_decoder_layers=6),
}


def paper_config(size: str, *, tfds_name: str, src_lang: str, tgt_lang: str, vocab_size: int,
                 big_dropout: float, grad_accum_steps: int) -> ml_collections.ConfigDict:
  """default.get_config() with the paper's WMT14 settings for `size` ('base' or 'big')."""
  config = default.get_config()
  config.workdir = f"runs/wmt14_{src_lang}{tgt_lang}_{size}"

  config.model.update(**_SIZES[size], d_k=None, d_v=None,
                      dropout_rate=big_dropout if size == "big" else 0.1,
                      attention_dropout_rate=0.0, relu_dropout_rate=0.0,
                      max_len=512,           # positions for the longest newstest sentences plus 50
                      pre_norm=False, positions="sinusoidal", share_embeddings=True, param_dtype="float32")
  # An accelerator's settings: bfloat16 activations and matmul operands; parameters, optimizer state,
  # softmax, norms and the loss stay float32 (docs/accelerators.md).
  config.compute.dtype = "bfloat16"

  # Typed None: config_flags refuses to override a field whose value is plain None (Table 3 sets them).
  config.model.d_k = ml_collections.FieldReference(None, field_type=int)
  config.model.d_v = ml_collections.FieldReference(None, field_type=int)

  config.data.update(
      source="tfds", tfds_name=tfds_name, src_lang=src_lang, tgt_lang=tgt_lang,
      vocab_size=vocab_size,
      vocab_sample_sentences=2_000_000,    # SentencePiece on a seeded 2M-sentence sample (both sides)
      max_len=256,                         # training pairs longer than this (in pieces) are skipped
      batch_tokens=25_000,                 # the paper: ~25k real source and ~25k real target tokens a step
      source_eos=True,                     # sources end with EOS (tensor2tensor, fairseq)
      pack=False,                          # the paper groups by length; it does not pack
      fine_buckets=True,                   # 21% of target slots padding instead of 29% (docs/accelerators.md)
  )

  config.train.update(
      num_steps=100_000 if size == "base" else 300_000,
      schedule="paper", learning_rate=1.0, warmup_steps=4000,
      adam_b1=0.9, adam_b2=0.98, adam_eps=1e-9,
      label_smoothing=0.1, weight_decay=0.0, grad_clip_norm=0.0,
      grad_accum_steps=grad_accum_steps,
      loss_chunk_tokens=8192,              # per device: larger matmuls for a GPU's output layer
      log_every=100, eval_every=2000, bleu_every=10_000,
      checkpoint_every_steps=0,            # against preemption: by time, every 10 minutes, the last 2
      checkpoint_every_minutes=10.0,
      keep_checkpoints=2,
      # The paper's reported models: the average of the last 5 (big: 20) checkpoints, written every 10
      # minutes at 0.4 s (big: 1.0 s) a step on its P100s: 1,500 (600) steps apart, the last 7,500 of 100K
      # (12,000 of 300K) steps. Step checkpoints at that spacing, counted back from the last step, apart
      # from the wall-clock ones (which never join the average): RUN/checkpoints_to_average.
      average_last=5 if size == "base" else 20,
      average_every_steps=1500 if size == "base" else 600,
      dev_sentences=0,                     # all 3000 of newstest2013
      test_bleu=True,
  )
  config.decode.update(beam_size=4, alpha=0.6, max_extra_len=50)
  return config


def shrink_to_smoke(config: ml_collections.ConfigDict, prepared_wmt: bool = False) -> ml_collections.ConfigDict:
  """Swaps in default.py's smoke model, corpus and step counts (offline, seconds); keeps the rest.
  prepared_wmt: the corpus is config.data.tfds_name where --config.data.tfds_data_dir is given (data/sources.py's
  "tfds_or_synthetic"), the embedded one otherwise."""
  smoke = default.get_config("smoke")
  config.workdir = config.workdir + "_smoke"
  size_keys = ("d_model", "d_ff", "num_heads", "d_k", "d_v", "num_encoder_layers", "num_decoder_layers",
               "max_len")
  config.model.update(**{k: smoke.model[k] for k in size_keys})
  kept = {k: config.data[k] for k in ("source_eos", "tfds_name", "src_lang", "tgt_lang")}
  config.data.update(**smoke.data.to_dict())   # the embedded corpus, a tiny vocabulary and batches
  config.data.source_eos = kept["source_eos"]
  if prepared_wmt:   # --config.data.tfds_data_dir=DIR: the WMT dataset prepared there instead
    config.data.update(source="tfds_or_synthetic", tfds_name=kept["tfds_name"], src_lang=kept["src_lang"],
                       tgt_lang=kept["tgt_lang"])
  config.train.update(**{k: smoke.train[k] for k in (
      "num_steps", "warmup_steps", "log_every", "eval_every", "bleu_every", "checkpoint_every_steps")})
  config.train.grad_accum_steps = 1
  # Step checkpoints every step, the last few averaged: the spacing scaled down with the step count.
  config.train.update(average_every_steps=1, average_last=min(config.train.average_last, smoke.train.num_steps))
  return config


def get_config(arg=None):
  arg = arg or "base"
  if arg not in ARGS:
    raise ValueError(f"experiments/wmt14_ende.py: unknown arg {arg!r}; use one of {ARGS}")
  size = "base" if arg == "smoke" else arg.removesuffix("_smoke")
  config = paper_config(size, tfds_name="wmt14_translate/de-en", src_lang="en", tgt_lang="de",
                        vocab_size=37_000, big_dropout=0.3, grad_accum_steps=1)
  if arg.endswith("smoke"):
    config = shrink_to_smoke(config, prepared_wmt=True)
  return config
