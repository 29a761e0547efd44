#!/usr/bin/env bash
# The pretrained-model pipeline on this machine, the closest we come to OPUS-MT without a download
# (docs/pretrained_pipeline/README.md has the numbers):
#   1. train a model on corpus A (the embedded synthetic corpus);
#   2. export it to Hugging Face (MarianMTModel);
#   3. import that directory back (python -m export.load_hf) and score it on corpus B's test set;
#   4. fine-tune it on corpus B (same language pair, only long sentences) with experiments/finetune.py;
#   5. train on corpus B from scratch for the same steps.
# Usage: scripts/pretrained_pipeline.sh OUT [PRETRAIN_STEPS] [FINETUNE_STEPS]
set -euo pipefail
OUT=${1:?usage: scripts/pretrained_pipeline.sh OUT [PRETRAIN_STEPS] [FINETUNE_STEPS]}
PRE=${2:-400}
STEPS=${3:-200}
mkdir -p "$OUT/corpus_b"
QUIET=(--config.train.progress=False --config.train.tensorboard=False)

# Corpus B: the synthetic language pair (seed 0's lexicon), sentences of 12 source words or more, none
# of them in corpus A's training split: 3,000 training pairs, 200 dev, 500 test.
python - "$OUT/corpus_b" <<'EOF'
import random, sys
from data import synthetic
out = sys.argv[1]
lex = synthetic.make_lexicon(0)
seen = {s for s, _ in synthetic.generate(0)["train"]}
rng, pairs = random.Random("aiayn-corpus-b"), []
while len(pairs) < 3700:
  src, tgt = synthetic.make_pair(rng, lex)
  if len(src.split()) >= 12 and src not in seen:
    seen.add(src)
    pairs.append((src, tgt))
for name, part in (("test", pairs[:500]), ("dev", pairs[500:700]), ("train", pairs[700:])):
  with open(f"{out}/{name}.tsv", "w") as f:
    f.writelines(f"{s}\t{t}\n" for s, t in part)
  with open(f"{out}/{name}.src", "w") as f:
    f.writelines(f"{s}\n" for s, _ in part)
  with open(f"{out}/{name}.tgt", "w") as f:
    f.writelines(f"{t}\n" for _, t in part)
EOF
B=(--config.data.train_path="$OUT/corpus_b/train.tsv" --config.data.dev_path="$OUT/corpus_b/dev.tsv"
   --config.data.test_path="$OUT/corpus_b/test.tsv")

# 1. Corpus A.
[ -f "$OUT/a/checkpoints/$PRE/meta/metadata" ] ||   # done already: a rerun goes on from step 2
  python -m train --config experiments/default.py --workdir "$OUT/a" --config.train.num_steps="$PRE" \
      --config.train.test_sentences=500 "${QUIET[@]}"
rm -rf "$OUT/a_hf" "$OUT/a_imported" "$OUT/finetuned" "$OUT/scratch"
# 2-3. Out to Hugging Face and back.
python -m export --workdir "$OUT/a" --format hf --out "$OUT/a_hf"
python -m export.load_hf --model "$OUT/a_hf" --workdir "$OUT/a_imported"
for run in a a_imported; do
  echo "== $run on corpus B's test set"
  python -m decode --workdir "$OUT/$run" --input "$OUT/corpus_b/test.src" --output "$OUT/$run.test_b.hyp" \
      --reference "$OUT/corpus_b/test.tgt"
done
# 4. Fine-tune on corpus B (the recipe's lr is for 74M-parameter OPUS-MT models; this 2M-parameter
# model takes the default experiment's).
python -m train --config "experiments/finetune.py:$OUT/a_imported" --workdir "$OUT/finetuned" "${B[@]}" \
    --config.train.num_steps="$STEPS" --config.train.learning_rate=1e-3 --config.train.warmup_steps=20 \
    --config.train.eval_every=50 --config.train.checkpoint_every_steps="$STEPS" "${QUIET[@]}"
# 5. Corpus B from scratch, the same steps.
python -m train --config experiments/default.py --workdir "$OUT/scratch" --config.data.source=files "${B[@]}" \
    --config.data.source_eos=True --config.data.vocab_size=0 --config.data.max_len=0 \
    --config.train.num_steps="$STEPS" --config.train.warmup_steps=20 --config.train.eval_every=50 \
    --config.train.checkpoint_every_steps="$STEPS" "${QUIET[@]}"
