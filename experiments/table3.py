"""Table 3 of the paper: variations on the base model, WMT14 EN-DE, scored on newstest2013 (dev).

Command (20 trials, each its own run directory under runs/table3/<trial>; see REPRODUCING.md):
  python -m jobs.sweep --config experiments/table3.py --workdir runs/table3 --parallel 1 \\
      --config.data.tfds_data_dir=DIR
  One trial alone:   python -m train --config experiments/table3.py --workdir runs/table3/A_h1 \\
      --config.model.num_heads=1 --config.model.d_k=512 --config.model.d_v=512 ...
Smoke (two tiny trials on the embedded corpus, ~1 minute on 2 CPU cores):
  python -m jobs.sweep --config experiments/table3.py:smoke --workdir /tmp/table3_smoke --parallel 2
Args: ARGS below ('base' is the default: the base model, which every trial overrides).

CPU variant ('cpu', or 'cpu,corpus=DIR'; docs/table3.md): every row plus a second seed of base, shrunk
  by one rule (scale_to_cpu): d_model, d_ff, d_k and d_v divided by CPU_SCALE=8 (base: 64, 256, 8, 8),
  layer counts by CPU_LAYER_SCALE=2 (base: 3 + 3); heads, dropout, label smoothing and positions as in
  the paper; big trains 3x the base row's CPU_STEPS=600, as 300K is 3x 100K; peak learning rate
  d_model^-0.5 * 4000^-0.5 as the paper's schedule, warmup a tenth of the steps, cosine decay. Corpus: DIR (default corpus/po_ende) made by
  `python scripts/build_po_corpus.py --lang de --out corpus/po_ende` (81k en-de software messages), read
  through the 'files' source; the embedded corpus is too easy for regularisation or capacity to matter.
  python -m jobs.sweep --config experiments/table3.py:cpu --workdir runs/table3_cpu
  Expected (docs/table3.md, docs/table3_cpu/results.md): base dev PPL 270.7 and 277.6 (two
  seeds); by perplexity 10 rows agree with the paper's direction, 7 disagree, 2 tie: the effects of width
  (d_model, d_ff, big) and of d_k and label smoothing reproduce; dropout, depth, heads and learned
  positions do not (600 steps, one pass over the corpus, reward whatever learns fastest early). Test
  BLEU is 0.2-1.5 on every row: it cannot tell rows apart at this scale.
  Cost: docs/table3.md gives the measured wall-clock, two trials at a time through the local SLURM.

Past one pass ('cpu_overfit', or 'cpu_overfit,corpus=DIR'; docs/table3.md): the cpu rule (widths /
  OVERFIT_SCALE=8, layers / 2) on a slice of OVERFIT_PAIRS=24,000 training pairs (every k-th pair of DIR/train.tsv, written
  once to DIR/train_slice24000.tsv) with a vocabulary by its size (OVERFIT_VOCAB=0: 7,000 pieces),
  OVERFIT_STEPS=2,000 steps for the base row (about 12 passes; big 3x), peak learning rate
  OVERFIT_LR_SCALE=2 x the cpu variant's, dev loss every 200 steps and dev BLEU at step 1,800, both on
  the first OVERFIT_DEV_PAIRS=500 dev pairs. Two passes (the issue asks for two seeds of base and of
  every row that disagrees or ties): the first trains every row once and base twice (21 trials); then
  jobs.sweep_directions.second_seed_rows(DIR/results.csv, rows, BASELINE) names the rows whose
  perplexity verdict is a tie or a disagreement, they go into OVERFIT_SECOND_SEED (the seven that
  disagreed), and the same command trains their <row>_seed1.
  python -m jobs.sweep --config experiments/table3.py:cpu_overfit,corpus=$PWD/corpus/po_ende \
      --workdir runs/table3_overfit --launcher slurm --cpus_per_task 4 --time 180
  (the local cluster's node claims 8 CPUs, so --cpus_per_task 4 runs two trials at a time, 8 one.)
  Expected (docs/table3.md, docs/table3_overfit/results.md): the base row's dev BLEU 10.3 and 11.6 at
  step 1,800 (seeds 0 and 1), test BLEU 10.7 and 11.1 at 2,000 (500 pairs each), dev perplexity 37.7 and
  38.8 at the end, the dev loss flat over the last 400 steps and ~0.4 nats above the training loss. By
  perplexity, each row by the mean of its seeds: 11 of 19 rows agree with the paper's direction (width,
  d_ff, d_k, N = 2, dropout 0, label smoothing), 7 disagree (heads 1, 4, 16: key width d_k, not head
  count, sets quality at d_model 64; N = 4, 8; dropout 0.2; learned positions) and big ties (dropout 0.3
  underfits at d_model 128). Not the issue's 15 of 19; docs/table3.md says what would settle each row.
  At 4,000 steps (--config.train.num_steps=4000, warmup/eval scaled; docs/table3_overfit/steps4000):
  base dev perplexity 22.4 and 23.1, dev BLEU 16.1 and 15.9; 12 of 19 agree (A_h32, C_d256 and big
  counted at 2,000): depth and learned positions settle, heads and dropout 0.2 still disagree, and
  label smoothing 0 turns worse as the slice starts to overfit. About 3.7 hours two at a time here.
  Cost (measured): the first pass's 21 trials ran 3.9 trial-hours (base 7-8 minutes, big 56);
  two at a time on 2 cores, about 2 hours of wall-clock, and the seven second seeds ~0.4 more.

Expected: each trial's dev PPL and BLEU near PAPER[trial] below (per-piece PPL of the final checkpoint,
  beam 4, no checkpoint averaging). Our PPL is per SentencePiece piece with a 37k vocabulary, the paper's
  per word-piece of its own 37k BPE, so absolute PPL can differ by a few percent; the differences
  between rows are what the sweep reproduces. Our BLEU is sacreBLEU (13a, detokenized), ~0.7-1.5 below
  the paper's tokenized BLEU (decode/bleu.py). The train loop measures dev BLEU every bleu_every steps but not
  at the last step (the end of a run scores the test set), so results.md gives the last dev BLEU and
  its step.
Cost: 19 base-sized trials of 100K steps (~9.5e17 model FLOPs each; the C rows range from 0.4x to 2.6x
  that) plus the big model (300K steps, ~9.6e18): ~2.8e19 FLOPs in all, projected ~7.6 h on one 8-H100
  machine, ~24 h on 8 A100s, one trial at a time on all 8 devices (REPRODUCING.md: from one H200's
  measured step; nothing measured on 8 GPUs).
"""
import os
import pathlib

import ml_collections

from experiments import default, wmt14_ende

ARGS = ("base", "smoke", "cpu", "cpu_overfit")

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


# The rows whose mean is the reference each row's effect is measured against, and whose spread (max - min)
# is the noise: a difference within it is a tie (jobs/sweep_directions.py). The cpu variant trains base
# twice; the full-size sweep trains it once (no spread: every difference counts).
BASELINE = ("base", "base_seed1")

# ------------------------------------------------------------------------------------------------------
# The cpu variant: every row shrunk by one rule (see the module docstring).
# ------------------------------------------------------------------------------------------------------
CPU_SCALE = 8                  # every width divided by this: d_model 512 -> 64, d_ff, d_k, d_v alike
CPU_LAYER_SCALE = 2            # every layer count divided by this: N 6 -> 3 (rows C: 2, 4, 8 -> 1, 2, 4)
CPU_STEPS = 600                # the base row's optimizer steps (the paper: 100K); big trains 3x as long
CPU_CORPUS = "corpus/po_ende"  # scripts/build_po_corpus.py --lang de --out corpus/po_ende
CPU_VARIANTS = ("cpu", "cpu_overfit")
_WIDTHS = ("model.d_model", "model.d_ff", "model.d_k", "model.d_v")
_LAYERS = ("model.num_encoder_layers", "model.num_decoder_layers")


def cpu_peak_lr(d_model: int) -> float:
  """The peak of the paper's schedule for d_model (d_model^-0.5 * warmup^-0.5, warmup 4000 steps).

  The cpu variant decays it by a cosine instead, but keeps its peak and its d_model^-0.5 ratio between
  rows: 1.98e-3 at d_model 64 (base), 2.80e-3 at 32, 1.40e-3 at 128.
  """
  return round(d_model ** -0.5 * 4000 ** -0.5, 6)


def scale_to_cpu(overrides: dict, steps: int = CPU_STEPS, lr_scale: float = 1.0,
                 width_scale: int = CPU_SCALE) -> dict:
  """A full-size row's overrides -> the cpu variant's: widths / `width_scale`, layers / CPU_LAYER_SCALE,
  steps * `steps` / 100K (cpu_overfit passes its OVERFIT_SCALE, OVERFIT_STEPS and OVERFIT_LR_SCALE).

  Head counts, dropout, label smoothing and positions are ratios already and stay as they are.
  A row that changes d_model also gets that d_model's peak learning rate (cpu_peak_lr).
  """
  out = {}
  for key, value in overrides.items():
    if key in _WIDTHS:
      if value % width_scale:
        raise ValueError(f"scale_to_cpu: {key}={value} is not divisible by {width_scale}")
      out[key] = value // width_scale
    elif key in _LAYERS:
      if value % CPU_LAYER_SCALE:
        raise ValueError(f"scale_to_cpu: {key}={value} is not divisible by {CPU_LAYER_SCALE}")
      out[key] = value // CPU_LAYER_SCALE
    elif key == "train.num_steps":
      out[key] = value * steps // 100_000
    else:
      out[key] = value
  if "model.d_model" in out:
    out["train.learning_rate"] = round(lr_scale * cpu_peak_lr(out["model.d_model"]), 6)
  return out


def _parse_arg(arg):
  """'cpu[,corpus=DIR]' or 'cpu_overfit[,corpus=DIR]' -> (name, DIR); other args -> (arg, None)."""
  name, _, rest = (arg or "base").partition(",")
  if name not in CPU_VARIANTS:
    if rest:
      raise ValueError(f"experiments/table3.py: arg {arg!r}: only {' and '.join(CPU_VARIANTS)} take "
                       f"options (cpu,corpus=DIR)")
    return name, None
  corpus = CPU_CORPUS
  for option in filter(None, rest.split(",")):
    key, eq, value = option.partition("=")
    if key != "corpus" or not eq or not value:
      raise ValueError(f"experiments/table3.py: arg {arg!r}: unknown option {option!r}; the cpu variants "
                       f"take only corpus=DIR, e.g. 'cpu,corpus=corpus/po_ende'")
    corpus = value
  return name, corpus


def check_corpus(corpus_dir: str) -> None:
  """Raises FileNotFoundError naming the missing split and the command that builds the corpus."""
  for split in ("train", "dev", "test"):
    path = pathlib.Path(corpus_dir) / f"{split}.tsv"
    if not path.is_file():
      raise FileNotFoundError(
          f"experiments/table3.py:cpu: corpus file {str(path)!r} does not exist. Build the corpus with "
          f"`python scripts/build_po_corpus.py --lang de --out {corpus_dir}` (~2 min, needs apt), or "
          f"point the variant at yours: --config experiments/table3.py:cpu,corpus=DIR (DIR/train.tsv, "
          f"dev.tsv, test.tsv)")


def _cpu_config(corpus_dir: str, width_scale: int = CPU_SCALE) -> ml_collections.ConfigDict:
  config = default.get_config()
  config.workdir = "runs/table3_cpu"
  full = wmt14_ende.paper_config("base", tfds_name="wmt14_translate/de-en", src_lang="en", tgt_lang="de",
                                 vocab_size=37_000, big_dropout=0.3, grad_accum_steps=1).model
  config.model.update(**full.to_dict())
  config.model.update(d_model=full.d_model // width_scale, d_ff=full.d_ff // width_scale,
                      num_encoder_layers=full.num_encoder_layers // CPU_LAYER_SCALE,
                      num_decoder_layers=full.num_decoder_layers // CPU_LAYER_SCALE,
                      max_len=256)   # positions: the corpus's pairs are short (max_len 64 pieces + 50)
  config.compute.dtype = "float32"   # a CPU experiment: the full-size rows' bfloat16 is an accelerator's
  config.model.d_k = ml_collections.FieldReference(None, field_type=int)   # None: d_model / num_heads
  config.model.d_v = ml_collections.FieldReference(None, field_type=int)
  corpus = os.path.abspath(corpus_dir)
  config.data.update(source="files", src_lang="en", tgt_lang="de",
                     train_path=f"{corpus}/train.tsv", dev_path=f"{corpus}/dev.tsv",
                     test_path=f"{corpus}/test.tsv",
                     vocab_size=4000,            # BPE, fixed (an earlier 16 * sqrt(pairs) rule of thumb for 75k)
                     vocab_sample_sentences=50_000, max_len=64, batch_tokens=2048, pack=True,
                     source_eos=True)            # as the full-size rows (wmt14_ende.py)
  config.train.update(num_steps=CPU_STEPS, schedule="cosine", learning_rate=cpu_peak_lr(full.d_model // width_scale),
                      warmup_steps=CPU_STEPS // 10, label_smoothing=0.1,
                      log_every=50, eval_every=CPU_STEPS // 4, bleu_every=0,
                      checkpoint_every_steps=CPU_STEPS // 2, checkpoint_every_minutes=10.0,
                      keep_checkpoints=1,
                      dev_sentences=0,           # dev PPL over all 2,507 dev pairs
                      test_bleu=True, test_sentences=500, num_samples=3, tensorboard=False)
  config.decode.update(beam_size=4, alpha=0.6, max_extra_len=50)
  return config


# ------------------------------------------------------------------------------------------------------
# The cpu_overfit variant: the cpu rule on a slice of the corpus, trained for several passes, so that
# the base row's dev loss turns (regularisation and capacity can matter) and it translates (docs/table3.md).
# ------------------------------------------------------------------------------------------------------
OVERFIT_SCALE = CPU_SCALE      # widths / 8 (d_model 64), as the cpu rule: /4 cost twice the time a step
                               # and learned no faster per step (docs/table3.md)
OVERFIT_PAIRS = 24_000         # the training slice: every k-th pair of train.tsv (spans every package)
OVERFIT_VOCAB = 0              # pieces by the slice's size (data.vocab.auto_vocab_size: 7,000 for 24k pairs)
OVERFIT_STEPS = 2_000          # the base row's steps: ~12 passes over the slice's ~270k target pieces
OVERFIT_LR_SCALE = 2.0         # x the paper's peak (cpu_peak_lr); 4x learned no faster, 6x stalled
OVERFIT_DEV_PAIRS = 500        # dev loss and BLEU on the first 500 (shuffled) dev pairs: a decode of all
                               # 2,511 costs minutes on 2 shared cores
# The rows that train a second seed (<row>_seed1): those whose perplexity verdict in the first pass (every
# row once, base twice) is a tie or a disagreement, as jobs.sweep_directions.second_seed_rows reads them
# from its results.csv. A row's verdict depends only on its own first seed and the base rows, so rows can be
# added as their first seeds finish: these seven disagreed by perplexity in the first pass (docs/table3.md).
OVERFIT_SECOND_SEED = ("A_h1", "A_h4", "A_h16", "C_N4", "C_N8", "D_drop0.2", "E_learned")


def slice_lines(lines: list, pairs: int) -> list:
  """Every k-th line (k = len(lines) // pairs, at least 1), the first `pairs` of them: a slice that
  spans the whole file, whose order is by package."""
  step = max(1, len(lines) // pairs)
  return lines[::step][:pairs]


def overfit_slice(corpus_dir: str, pairs: int = OVERFIT_PAIRS) -> str:
  """Writes corpus_dir/train_slice{pairs}.tsv (slice_lines of train.tsv) unless it exists, atomically;
  returns its path. Raises FileNotFoundError as check_corpus does when the corpus is missing."""
  path = pathlib.Path(corpus_dir) / f"train_slice{pairs}.tsv"
  if not path.is_file():
    check_corpus(corpus_dir)
    lines = (pathlib.Path(corpus_dir) / "train.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(slice_lines(lines, pairs)), encoding="utf-8")
    os.replace(tmp, path)
  return str(path)


def _overfit_config(corpus_dir: str) -> ml_collections.ConfigDict:
  config = _cpu_config(corpus_dir, width_scale=OVERFIT_SCALE)
  config.workdir = "runs/table3_overfit"
  # The slice is written once the corpus exists; before that the config names train.tsv, so that a run
  # fails on the missing corpus file, as the cpu variant does.
  train_tsv = pathlib.Path(corpus_dir) / "train.tsv"
  config.data.train_path = os.path.abspath(overfit_slice(corpus_dir) if train_tsv.is_file() else train_tsv)
  config.data.vocab_size = OVERFIT_VOCAB
  config.train.update(num_steps=OVERFIT_STEPS, learning_rate=round(OVERFIT_LR_SCALE * config.train.learning_rate, 6),
                      warmup_steps=OVERFIT_STEPS // 10, eval_every=OVERFIT_STEPS // 10,
                      # dev BLEU once, at 9/10 of the steps: the trainer measures it only at eval steps,
                      # not at the last one (it scores the test set there)
                      bleu_every=9 * (OVERFIT_STEPS // 10),
                      checkpoint_every_steps=OVERFIT_STEPS // 2, dev_sentences=OVERFIT_DEV_PAIRS)
  return config


def get_config(arg=None):
  name, corpus = _parse_arg(arg)
  if name not in ARGS:
    raise ValueError(f"experiments/table3.py: unknown arg {arg!r}; use one of {ARGS} "
                     f"(the cpu variants take an option: cpu,corpus=DIR)")
  if name == "cpu":
    return _cpu_config(corpus)
  if name == "cpu_overfit":
    return _overfit_config(corpus)
  config = wmt14_ende.paper_config("base", tfds_name="wmt14_translate/de-en", src_lang="en",
                                   tgt_lang="de", vocab_size=37_000, big_dropout=0.3,
                                   grad_accum_steps=1)
  config.workdir = "runs/table3"
  # Dev BLEU often enough that the last measurement is close to the end (it is skipped at the last step).
  config.train.update(eval_every=5000, bleu_every=5000)
  if name == "smoke":
    config = wmt14_ende.shrink_to_smoke(config)
    config.workdir = "runs/table3_smoke"
    # Enough steps for the loss to move, a dev BLEU at step 4, a 32-sentence dev set: ~20 s a trial.
    config.train.update(num_steps=8, warmup_steps=4, learning_rate=2.0, log_every=2, eval_every=4,
                        bleu_every=4, checkpoint_every_steps=4, dev_sentences=32, test_bleu=False,
                        tensorboard=False)
  return config


def full_size_rows():
  """[(name, overrides)]: the rows of Table 3 (A to E, and big) as changes to the full-size base."""
  rows = [("base", {})]
  # (A) attention heads at constant computation: h * d_k = 512.
  for h in (1, 4, 16, 32):
    rows.append((f"A_h{h}", {"model.num_heads": h, "model.d_k": 512 // h, "model.d_v": 512 // h}))
  # (B) smaller keys only; values keep d_v = 64.
  for d_k in (16, 32):
    rows.append((f"B_dk{d_k}", {"model.d_k": d_k, "model.d_v": 64}))
  # (C) model size.
  for n in (2, 4, 8):
    rows.append((f"C_N{n}", {"model.num_encoder_layers": n, "model.num_decoder_layers": n}))
  rows.append(("C_d256", {"model.d_model": 256, "model.d_k": 32, "model.d_v": 32}))
  rows.append(("C_d1024", {"model.d_model": 1024, "model.d_k": 128, "model.d_v": 128}))
  for d_ff in (1024, 4096):
    rows.append((f"C_dff{d_ff}", {"model.d_ff": d_ff}))
  # (D) regularization.
  for rate in (0.0, 0.2):
    rows.append((f"D_drop{rate}", {"model.dropout_rate": rate}))
  for eps in (0.0, 0.2):
    rows.append((f"D_ls{eps}", {"train.label_smoothing": eps}))
  # (E) learned positional embeddings instead of sinusoids.
  rows.append(("E_learned", {"model.positions": "learned"}))
  # The big model (300K steps; dropout 0.3 as for EN-DE in Table 2). Its checkpoints are kept as every
  # row's: the last 2 to resume from, and the 5 parameter-only step checkpoints its end averages
  # (RUN/checkpoints_to_average); Table 3 reports the final checkpoint, not the average.
  rows.append(("big", {"model.d_model": 1024, "model.d_ff": 4096, "model.num_heads": 16,
                       "model.dropout_rate": 0.3, "train.num_steps": 300_000}))
  return rows


def _scaled(variant: str, overrides: dict) -> dict:
  """A full-size row's overrides as `variant` ('base', 'cpu' or 'cpu_overfit') trains them."""
  if variant == "cpu":
    return scale_to_cpu(overrides)
  if variant == "cpu_overfit":
    return scale_to_cpu(overrides, steps=OVERFIT_STEPS, lr_scale=OVERFIT_LR_SCALE, width_scale=OVERFIT_SCALE)
  return overrides


def sweep(add, arg=None):
  """Calls add(name=..., **overrides) once per trial: the rows of Table 3 (A to E, and big).

  'cpu': the same rows through scale_to_cpu, plus base_seed1 (base with seed 1) for the noise.
  'cpu_overfit': the same, shrunk by the overfit rule, then <row>_seed1 for each row in
  OVERFIT_SECOND_SEED (chosen by jobs.sweep_directions.second_seed_rows from the first pass's verdicts).
  """
  name, corpus = _parse_arg(arg)
  if name == "smoke":
    add(name="base")
    add(name="C_N2", **{"model.num_encoder_layers": 2, "model.num_decoder_layers": 2})
    return
  if name in CPU_VARIANTS:
    check_corpus(corpus)   # before any trial starts, not once per trial
  if name == "cpu_overfit":
    overfit_slice(corpus)  # written once here, before the trials that read it
  rows = full_size_rows()
  for row, overrides in rows:
    add(name=row, **_scaled(name, overrides))
  if name in CPU_VARIANTS:
    add(name="base_seed1", seed=1)
  if name == "cpu_overfit":
    for row, overrides in rows:
      if row in OVERFIT_SECOND_SEED:
        add(name=f"{row}_seed1", seed=1, **_scaled(name, overrides))
  # Settings that did not help go here as comments, with the numbers they got, e.g.
  #   add(name="pre_norm", **{"model.pre_norm": True})   # not run yet
