"""The default experiment: a small Transformer on the embedded synthetic corpus, on CPU.

Command:  python -m train            (same as: python -m train --config experiments/default.py)
Expected: test sacreBLEU about 98 after 1,000 steps, in a few minutes on 2 CPU cores (corpus, vocabulary,
          compiles and the final test-set beam search included); the measured runs: docs/training.md.
Smoke:    python -m train --config experiments/default.py:smoke --workdir /tmp/smoke  (seconds)

Why these settings: on 2 CPU cores the budget is about 1,000 optimizer steps, so the model is small
(d_model 128, 2+2 layers, 1.95M parameters with the 8,000-piece vocabulary) and learns fast: byte-pair
pieces that mostly keep words whole (12-13 pieces per sentence instead of 19-20 with a 4,000-piece
unigram model; dev BLEU 50 instead of 28 after 400 steps), packed batches of 2,048 target slots
(about 1,810 real target tokens a step; at the same step count they learn about as much as 4,096-token
bucketed batches, which reached dev BLEU 50 at step 400 and test BLEU 94.2 at step 1,000, in half the
time; and one batch shape compiles once), no
dropout (1,000 steps are under one pass over the corpus: nothing to regularise), and a cosine schedule
peaking at 2e-3 after 200 steps (6e-3 stalled). Sources carry no EOS (data.source_eos=False), as in
every measured run; it is kept off so that those numbers still describe this file (the synthetic
corpus's sentences end with a period, so the encoder sees the end anyway). The WMT experiments and
experiments/small_corpus.py turn it on, as tensor2tensor and fairseq do.
"""
import ml_collections

import decode


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.workdir = "runs/default"

  # Architecture: fields of model.config.TransformerConfig (vocab_size comes from the vocabulary).
  config.model = ml_collections.ConfigDict(dict(
      d_model=128, d_ff=512, num_heads=4, d_k=None, d_v=None,
      num_encoder_layers=2, num_decoder_layers=2,
      dropout_rate=0.0, attention_dropout_rate=0.0, relu_dropout_rate=0.0,
      max_len=256, param_dtype="float32",
      pre_norm=False, positions="sinusoidal", share_embeddings=True, attention_bias=True,
  ))

  # Typed None, so that --config.model.d_k=64 can override it (config_flags refuses a plain None field).
  config.model.d_k = ml_collections.FieldReference(None, field_type=int)
  config.model.d_v = ml_collections.FieldReference(None, field_type=int)

  # How the model is computed: fields of model.config.Compute. None of them changes the parameters, so a
  # run may resume with other values (scan_layers only after python -m run.convert).
  config.compute = ml_collections.ConfigDict(dict(
      dtype="float32",             # activations (logits, softmax, norms and the loss stay float32)
      kernels="auto",              # auto | reference | cpu: the XLA:CPU fast paths (docs/model.md)
      attention_impl="auto",       # auto | xla | cudnn | splash: the attention kernel (docs/accelerators.md)
      remat="none",                # none | minimal | full: recompute in the backward pass (docs/accelerators.md)
      scan_layers=False,           # one nn.scan per stack (docs/accelerators.md)
  ))
  # Matmul operands: None (the compute dtype) or "bfloat16", mixed precision with float32 accumulation
  # (docs/model.md): --config.compute.matmul_dtype=bfloat16.
  config.compute.matmul_dtype = ml_collections.FieldReference(None, field_type=str)

  # Data (owned by data/): see docs/data.md.
  config.data = ml_collections.ConfigDict(dict(
      source="synthetic",          # synthetic | tfds | files
      tfds_name="wmt14_translate/de-en",
      tfds_data_dir="",            # empty: tfds default (~/tensorflow_datasets)
      train_path="", dev_path="", test_path="",
      src_lang="en", tgt_lang="de",
      synthetic_seed=0,            # the embedded corpus: generator seed and training-split size
      synthetic_train_size=200_000,
      vocab_size=8000,             # shared SentencePiece pieces (the paper: ~37,000 for EN-DE)
      vocab_model_type="bpe",      # bpe (the paper's byte-pair encoding) | unigram
      vocab_sample_sentences=50_000,  # seeded random sample of training sentences for the vocabulary
      vocab_seed=0,
      max_len=64,                  # tokens per side; longer pairs are skipped and counted (0: the
                                   # length that keeps 99.5% of the corpus, data/max_len.py)
      source_eos=False,            # end sources with EOS (the WMT and small-corpus experiments do)
      batch_tokens=2048,           # real source and target tokens per batch, each (packed: an upper bound,
                                   # rows x max_len slots; ~1,810 real target tokens on this corpus)
      pack=True,                   # several pairs per row: one batch shape, one compile
      fine_buckets=False,          # not packed: buckets every 8 (16 past 128) positions instead of x1.5
  ))

  # Training (owned by train/).
  config.train = ml_collections.ConfigDict(dict(
      num_steps=1000,
      schedule="cosine",           # paper | inverse_sqrt | cosine
      learning_rate=2e-3,          # multiplier for "paper", peak lr for the others
      warmup_steps=200,
      adam_b1=0.9, adam_b2=0.98, adam_eps=1e-9,
      label_smoothing=0.1,
      loss_chunk_tokens=1024,      # fused output layer + loss, this many tokens at a time per device
                                   # (0: full logits)
      rng_impl="threefry",         # dropout's PRNG: threefry | rbg | unsafe_rbg (docs/accelerators.md)
      profile_steps="",            # "A-B": a jax.profiler trace of steps A+1..B in RUN/profile
      profile_python=False,        # the trace also holds every Python call (much bigger, slower to write)
      weight_decay=0.0,
      grad_clip_norm=0.0,          # 0: off
      grad_accum_steps=1,
      fsdp=False,
      log_every=50,
      eval_every=200,
      bleu_every=0,                # 0: no periodic dev BLEU (the end scores the test set)
      checkpoint_every_steps=500,
      checkpoint_every_minutes=10.0,
      keep_checkpoints=5,
      average_last=0,              # >0: at the end, average the last N checkpoints and score them too
      average_every_steps=0,       # >0: average step checkpoints this many steps apart, counted back from
                                   # num_steps (RUN/checkpoints_to_average), never the wall-clock or
                                   # preemption ones; 0: the newest of RUN/checkpoints
      average_allow_fewer=False,   # average what exists when fewer than average_last (else refused)
      early_stop_evals=0,          # >0: stop when the dev loss has not improved for this many evals
      init_checkpoint="",          # "RUN_DIR[:STEP|:averaged]": start from its parameters (if no checkpoint)
      reset_optimizer=False,       # resume with a fresh optimizer state (keeps params, step, data position)
      dev_sentences=300,           # dev pairs used by periodic evals (loss and BLEU; 0: all)
      test_bleu=True,              # at the end: test-set sacreBLEU and sample translations
      test_sentences=0,            # test pairs scored at the end (0: all)
      num_samples=3,               # sample translations printed at the end
      tensorboard=True,            # event files in workdir/tb
      progress=True,               # tqdm progress bar on the console
      peak_flops=0.0,              # per device, for MFU; 0: the data sheet's (GPU, TPU) or measured (CPU)
  ))

  # Decoding (owned by decode/).
  config.decode = ml_collections.ConfigDict(dict(decode.DEFAULTS))

  if arg == "smoke":
    config.model.update(d_model=32, d_ff=64, num_heads=2, num_encoder_layers=1, num_decoder_layers=1)
    config.data.update(synthetic_train_size=2000, vocab_size=300, vocab_sample_sentences=2000,
                       batch_tokens=256, max_len=32)
    config.train.update(num_steps=2, warmup_steps=10, log_every=1, eval_every=2, bleu_every=2,
                        checkpoint_every_steps=2, dev_sentences=64, test_sentences=64)
  elif arg not in (None, ""):
    raise ValueError(f"experiments/default.py: unknown arg {arg!r}; use '' or 'smoke'")
  return config


def search_space(trial):
  """`python -m jobs.search --config experiments/default.py --workdir runs/search --trials 24`: the
  training keys this file tunes by hand, each named by its config key (jobs/search_trial.py)."""
  return {
      "train.learning_rate": trial.suggest_float("train.learning_rate", 5e-4, 8e-3, log=True),
      "train.warmup_steps": trial.suggest_int("train.warmup_steps", 50, 400, step=50),
      "train.label_smoothing": trial.suggest_float("train.label_smoothing", 0.0, 0.2),
      "model.dropout_rate": trial.suggest_float("model.dropout_rate", 0.0, 0.3),
      "data.vocab_size": trial.suggest_categorical("data.vocab_size", [2000, 4000, 8000]),
  }
