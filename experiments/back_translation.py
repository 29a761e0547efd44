"""Back-translation (Sennrich et al., 2016) with tagged synthetic sources (Caswell et al., 2019), on a
simulated low-resource English->Romanian corpus: half of the training pairs of scripts/build_po_corpus.py
stay parallel, the other half keeps only its Romanian side, as "monolingual" text.

Commands, in order (docs/back_translation.md explains each). Cost: each training about 6-8 minutes alone
on 2 cores (by its first steps' speed; the measured runs shared their 2 cores and took 19-28 minutes),
the bulk decoding of 17,536 lines about 9 minutes shared:
  python scripts/build_po_corpus.py --lang ro --out corpus/po_enro
  scripts/back_translation_split.sh corpus/po_enro corpus/po_enro_bt
  # 1. the reverse model, Romanian->English, on the parallel half
  python -m train --config experiments/back_translation.py:reverse --workdir runs/bt_reverse
  # 2. the monolingual Romanian translated into synthetic English sources by the bulk decoder
  python -m decode --workdir runs/bt_reverse --checkpoint averaged \\
      --input corpus/po_enro_bt/mono.tgt --output corpus/po_enro_bt/synth.src
  # 3. the forward model, English->Romanian, on the parallel half alone, and with the synthetic pairs
  python -m train --config experiments/back_translation.py:baseline --workdir runs/bt_baseline
  python -m train --config experiments/back_translation.py:bt --workdir runs/bt_tagged
  # (untagged, for comparison: the same with --config.data.synthetic_tag='' --workdir runs/bt_untagged;
  #  the upper bound: :baseline with --config.data.train_path=corpus/po_enro/train.tsv --workdir runs/bt_oracle)
Smoke (seconds, offline, no synthetic file): python -m train --config experiments/back_translation.py:smoke
  --workdir /tmp/bt_smoke

Expected (docs/back_translation_results/README.md has the measured runs, their commands and times):
test sacreBLEU on the corpus's whole test split (1,858 pairs), final parameters (averaged in brackets),
one seed each:
  reverse (Romanian->English, parallel half)         31.97 (32.04)
  baseline (parallel half)                           28.96 (29.36)
  bt (parallel + back-translated half, tagged)       31.71 (31.77)   +2.75 over the baseline
  bt, untagged (--config.data.synthetic_tag=)        31.29 (31.16)
  both halves with their real English (upper bound)  35.60 (35.63)   back-translation recovers ~40% of it
A second seed (--config.seed=1): tagged 31.07 (31.25), untagged 31.16 (31.06); over both seeds the tag
gains 0.16 (0.40 averaged), less than the two tagged seeds differ by (0.64): no measurable effect here.

Every training is experiments/small_corpus.py:bf16 (pre-norm, d_model 128, 2+2 layers, 12,000 pieces)
cut to STEPS steps, so that baseline and back-translation differ only in their training pairs. The
vocabulary of both forward models is trained on the parallel half alone and reserves the tag (the
baseline declares the tag and never uses it), so the two share the same vocabulary bytes.
"""
from experiments import small_corpus

ARGS = ("reverse", "baseline", "bt", "smoke")
SPLIT_DIR = "corpus/po_enro_bt"       # scripts/back_translation_split.sh's output
STEPS = 1200                          # every training: the same steps, model and schedule
SYNTHETIC_RATIO = 0.0                 # natural: each parallel and each synthetic pair once per pass
TAG = "<BT>"                          # Caswell et al.'s tag, one reserved vocabulary piece
WORKDIRS = {"reverse": "runs/bt_reverse", "baseline": "runs/bt_baseline", "bt": "runs/bt_tagged",
            "smoke": "runs/bt_smoke"}


def _files(config, src: str, tgt: str) -> None:
  """Train, dev and test as line-aligned files of SPLIT_DIR, `src` side first ('src' is English)."""
  config.data.update(**{f"{split}_path": f"{SPLIT_DIR}/{name}.{src},{SPLIT_DIR}/{name}.{tgt}"
                        for split, name in (("train", "parallel"), ("dev", "dev"), ("test", "test"))})


def get_config(arg=None):
  """arg: 'reverse' (Romanian->English on the parallel half), 'baseline' (English->Romanian on the
  parallel half), 'bt' (English->Romanian on the parallel half plus the back-translated half, tagged) or
  'smoke' (bt's settings on the embedded corpus, without a synthetic file)."""
  if arg not in ARGS:
    raise ValueError(f"experiments/back_translation.py: unknown arg {arg!r}; use one of {ARGS}")
  config = small_corpus.get_config("smoke" if arg == "smoke" else "bf16")
  config.workdir = WORKDIRS[arg]
  if arg == "reverse":
    config.train.num_steps = STEPS
    _files(config, "tgt", "src")
    config.data.update(src_lang="ro", tgt_lang="en")
    return config
  if arg != "smoke":
    config.train.num_steps = STEPS
    _files(config, "src", "tgt")
    config.data.update(src_lang="en", tgt_lang="ro")
  # Declared here, not in experiments/default.py (data/mixing.py): the forward models only.
  config.data.synthetic_path = f"{SPLIT_DIR}/synth.src,{SPLIT_DIR}/mono.tgt" if arg == "bt" else ""
  config.data.synthetic_ratio = SYNTHETIC_RATIO
  config.data.synthetic_tag = TAG
  return config
