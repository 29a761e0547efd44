"""BLEU as it should be reported (sacreBLEU with its signature) and as the paper computed it.

- `sacrebleu_score(hyps, refs)`: detokenized, cased sacreBLEU (13a) against raw references, with the
  signature that makes the number reproducible (Post 2018).
- `paper_bleu(hyps, refs)`: the paper's tokenized BLEU with compounds split at hyphens, as tensor2tensor's
  get_ende_bleu.sh computed it (Moses tokenizer, `a-b` -> `a ##AT##-##AT## b`, multi-bleu.perl). We tokenize
  with sacreBLEU's 13a tokenizer, which follows the Moses/mteval rules closely; the result reads about
  0.7-1.5 points above sacreBLEU on WMT14 EN-DE (REPRODUCING.md). Compare it with the paper, report
  sacreBLEU.
"""
from __future__ import annotations

import re

import sacrebleu
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

_COMPOUND = re.compile(r"(\S)-(\S)")


def _check(hyps, refs):
  if len(hyps) != len(refs):
    raise ValueError(f"BLEU needs one hypothesis per reference: got {len(hyps)} hypotheses and "
                     f"{len(refs)} references")


def sacrebleu_score(hyps, refs) -> tuple[float, str]:
  """(corpus sacreBLEU, its signature) for detokenized hypotheses against raw references."""
  _check(hyps, refs)
  metric = sacrebleu.BLEU()
  score = metric.corpus_score(list(hyps), [list(refs)])
  return float(score.score), str(metric.get_signature())


def split_compounds(tokenized: str) -> str:
  """'Rhein-Main' -> 'Rhein ##AT##-##AT## Main'; one non-overlapping pass, as the script's sed does."""
  return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", tokenized)


def paper_bleu(hyps, refs) -> float:
  """Tokenized, compound-split corpus BLEU (the paper's Table 2 convention)."""
  _check(hyps, refs)
  tokenize = Tokenizer13a()
  prep = lambda texts: [split_compounds(tokenize(t.strip())) for t in texts]
  return float(sacrebleu.corpus_bleu(prep(hyps), [prep(refs)], tokenize="none", force=True).score)
