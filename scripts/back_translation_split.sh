#!/usr/bin/env bash
# Simulates a low-resource setting on a corpus of scripts/build_po_corpus.py: half of the training split
# stays parallel, the other half gives only its target side ("monolingual" text), as
# experiments/back_translation.py needs them.
#
#   scripts/back_translation_split.sh corpus/po_enro corpus/po_enro_bt
#
# Writes line-aligned text files into OUT (the data source "files" reads "a,b" as source,target):
#   parallel.src parallel.tgt   odd lines of train.tsv: the parallel half
#   mono.tgt                    even lines' target side: the monolingual half
#   mono.src                    even lines' real source side, for reference only (never trained on)
#   dev.src dev.tgt test.src test.tgt   the corpus's dev and test splits, unchanged
# Alternate lines rather than the first half: the builder writes pairs grouped by application, and both
# halves should see every application. Same input, same files.
set -euo pipefail
if [[ $# -ne 2 ]]; then
  echo "usage: $0 CORPUS_DIR OUT_DIR   (CORPUS_DIR holds train.tsv, dev.tsv, test.tsv)" >&2
  exit 2
fi
corpus=$1 out=$2
for split in train dev test; do
  [[ -r "$corpus/$split.tsv" ]] || { echo "error: $corpus/$split.tsv is missing or unreadable" >&2; exit 1; }
done
mkdir -p "$out"
awk -F'\t' -v out="$out" '
  NF != 2 { next }
  NR % 2 == 1 { print $1 > (out "/parallel.src"); print $2 > (out "/parallel.tgt") }
  NR % 2 == 0 { print $1 > (out "/mono.src");     print $2 > (out "/mono.tgt") }' "$corpus/train.tsv"
for split in dev test; do
  cut -f1 "$corpus/$split.tsv" > "$out/$split.src"
  cut -f2 "$corpus/$split.tsv" > "$out/$split.tgt"
done
wc -l "$out"/parallel.src "$out"/mono.tgt "$out"/dev.src "$out"/test.src
