"""Your own small parallel corpus (20k-100k pairs) on a 2-core CPU, in about 10 minutes.

Command (your files: TSV "source<TAB>target", or two line-aligned files joined by a comma):
  python -m train --config experiments/small_corpus.py --workdir runs/mine \\
      --config.data.train_path=train.tsv --config.data.dev_path=dev.tsv --config.data.test_path=test.tsv \\
      --config.data.src_lang=en --config.data.tgt_lang=de
(src_lang/tgt_lang only label the run: the files give the direction.) Then:
  python -m decode --workdir runs/mine --checkpoint averaged --input FILE --output FILE
With bfloat16 matmuls, where they measured faster than float32 (docs/small_corpus.md): the same command
with --config experiments/small_corpus.py:bf16. The run's config.json records either.
Smoke (seconds, offline, on the embedded corpus): python -m train --config experiments/small_corpus.py:smoke
  --workdir /tmp/small_smoke

Expected (docs/small_corpus.md, which has the measured runs), with :bf16 on a CPU with AVX512-BF16,
test sacreBLEU of the final parameters (whole test split) against the default settings on the same files,
on the software-message corpora of scripts/build_po_corpus.py: English->German (--lang de, 75k pairs)
27.8 against 13.3, 2.08x; English->Romanian (--lang ro, 35k pairs) 38.9 against 22.3, 1.75x
(Romanian's second seed 38.4, 1.72x; without weight decay 35.2, 1.58x).
Alone on 2 cores a run takes about 9 minutes (the default settings about 5). The float32 default's 1,190
steps have not been run on these corpora.

What it changes from the default experiment (each setting's reason: docs/small_corpus.md; the tuning
runs behind it: docs/small_corpus_results/README.md): pre-norm layers at a peak learning rate of 8e-3;
12,000 vocabulary pieces; 1,600 steps with :bf16 (1,190 in float32, the same wall-clock); EOS ending every
source; max_len from the corpus; AdamW weight decay 0.2 and no dropout; beam search with GNMT's length penalty
((5 + length) / 6) ** alpha at alpha 1.0 (not fairseq's --lenpen 1.0); a
checkpoint every 50 steps and the average of the last 5.
"""
from experiments import default

ARGS = (None, "bf16", "smoke")
STEPS_BF16 = 1600          # about 10 minutes on 2 cores of the tuning CPU, with bfloat16 matmuls
BF16_SPEEDUP = 1.35        # their steps/s over float32's at d_model 128 on that CPU (1.37 measured)
VOCAB_SIZE = 12_000        # best at 75k pairs (German) and at 35k (Romanian); docs/small_corpus.md
WEIGHT_DECAY = 0.2         # AdamW's, on weight matrices: the regularizer that pays in 1,600 steps


def get_config(arg=None):
  """arg: None or '' (float32 matmuls), 'bf16' (bfloat16 matmuls, more steps) or 'smoke' (float32)."""
  if arg not in ARGS + ("",):
    raise ValueError(f"experiments/small_corpus.py: unknown arg {arg!r}; use '', 'bf16' or 'smoke'")
  bf16 = arg == "bf16"
  config = default.get_config()
  config.workdir = "runs/small_corpus"
  config.model.update(pre_norm=True)
  config.compute.matmul_dtype = "bfloat16" if bf16 else None
  config.data.update(source="files", src_lang="en", tgt_lang="de",
                     vocab_size=VOCAB_SIZE,
                     max_len=0,                 # by the corpus's lengths (data.max_len.derive_max_len)
                     source_eos=True)
  config.train.update(num_steps=STEPS_BF16 if bf16 else int(round(STEPS_BF16 / BF16_SPEEDUP, -1)),
                      learning_rate=8e-3, weight_decay=WEIGHT_DECAY, early_stop_evals=3,
                      checkpoint_every_steps=50, keep_checkpoints=5, average_last=5)
  config.decode.alpha = 1.0

  if arg == "smoke":
    smoke = default.get_config("smoke")
    config.workdir = "runs/small_corpus_smoke"
    config.model.update(**{k: smoke.model[k] for k in ("d_model", "d_ff", "num_heads", "num_encoder_layers",
                                                       "num_decoder_layers")})
    config.data.update(**smoke.data.to_dict())   # the embedded corpus (offline)
    config.data.update(source_eos=True, max_len=0)
    config.train.update(num_steps=4, warmup_steps=2, log_every=1, eval_every=1, checkpoint_every_steps=1,
                        keep_checkpoints=2, average_last=2, dev_sentences=64, test_sentences=64)
  return config


def search_space(trial):
  """`python -m jobs.search --config experiments/small_corpus.py --workdir runs/search --trials 24
  --config.data.train_path=... (dev_path, test_path)`: the keys tuned by hand above, each named by its
  config key (jobs/search_trial.py); steps and model size stay, so every trial costs the same."""
  return {
      "train.learning_rate": trial.suggest_float("train.learning_rate", 2e-3, 2e-2, log=True),
      "train.warmup_steps": trial.suggest_int("train.warmup_steps", 100, 400, step=50),
      "train.label_smoothing": trial.suggest_float("train.label_smoothing", 0.0, 0.2),
      "model.dropout_rate": trial.suggest_float("model.dropout_rate", 0.0, 0.2),
      "model.pre_norm": trial.suggest_categorical("model.pre_norm", [True, False]),
      "data.vocab_size": trial.suggest_categorical("data.vocab_size", [0, 8000, 16000]),   # 0: by corpus size
  }
