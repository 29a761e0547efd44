"""BLEU as it should be reported (sacreBLEU with its signature) and as the paper computed it.

- `sacrebleu_score(hyps, refs)`: detokenized, cased sacreBLEU (13a) against raw references, with the
  signature that makes the number reproducible (Post 2018).
- `paper_bleu(hyps, refs, lang)`: the paper's tokenized BLEU with compounds split at hyphens, computed as
  tensor2tensor's get_ende_bleu.sh computes it, step for step: Moses' tokenizer.perl -l LANG on both sides
  (sacremoses, its Python port: default escaping, no aggressive dash splitting), then
  `perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'`, then multi-bleu.perl (cased, one reference, corpus
  n-gram counts, brevity penalty over the corpus). `paper_bleu_score` adds its signature. On WMT14 EN-DE
  it reads 0.7-1.5 points above sacreBLEU (REPRODUCING.md). Compare it with the paper, report sacreBLEU.
"""
from __future__ import annotations

import collections
import functools
import importlib.metadata
import math
import re

import sacrebleu

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


@functools.lru_cache(maxsize=8)
def _moses(lang: str):
  from sacremoses import MosesTokenizer
  return MosesTokenizer(lang=lang)


def moses_tokenize(text: str, lang: str) -> str:
  """tokenizer.perl -l LANG on one line, with its defaults: '"' -> '&quot;', "'" -> '&apos;', '&' ->
  '&amp;', and '|', '<', '>', '[', ']' escaped likewise; hyphens inside words kept (no -a)."""
  return _moses(lang).tokenize(text.strip(), return_str=True, escape=True, aggressive_dash_splits=False)


def split_compounds(tokenized: str) -> str:
  """'Rhein-Main' -> 'Rhein ##AT##-##AT## Main'; one non-overlapping pass from the left, as perl's s///g
  does ('a-b-c' -> 'a ##AT##-##AT## b-c')."""
  return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", tokenized)


def paper_tokenize(text: str, lang: str) -> str:
  """One line as get_ende_bleu.sh hands it to multi-bleu.perl: Moses-tokenized, compounds split."""
  return split_compounds(moses_tokenize(text, lang))


def _ngrams(words, n):
  return collections.Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))


def multi_bleu(hyps, refs) -> float:
  """multi-bleu.perl's BLEU (0-100, unrounded) of tokenized lines against one tokenized reference each:
  words split at whitespace; per n (1-4) the clipped n-gram matches and the hypothesis n-grams summed over
  the corpus; a zero precision makes BLEU 0; brevity penalty exp(1 - ref/hyp) when the hypotheses are
  shorter in all."""
  _check(hyps, refs)
  correct, total = [0] * 5, [0] * 5
  hyp_len = ref_len = 0
  for hyp, ref in zip(hyps, refs):
    words, ref_words = hyp.split(), ref.split()
    hyp_len, ref_len = hyp_len + len(words), ref_len + len(ref_words)
    for n in range(1, 5):
      ours, theirs = _ngrams(words, n), _ngrams(ref_words, n)
      total[n] += sum(ours.values())
      correct[n] += sum(min(count, theirs[gram]) for gram, count in ours.items())
  if ref_len == 0:
    return 0.0
  precisions = [correct[n] / total[n] if total[n] else 0.0 for n in range(1, 5)]
  if min(precisions) == 0.0 or hyp_len == 0:
    return 0.0
  brevity = math.exp(1 - ref_len / hyp_len) if hyp_len < ref_len else 1.0
  return 100.0 * brevity * math.exp(sum(math.log(p) for p in precisions) / 4)


def paper_bleu(hyps, refs, lang: str = "de") -> float:
  """The paper's tokenized, compound-split corpus BLEU (Table 2's convention); lang: the target language
  (tokenizer.perl -l LANG)."""
  _check(hyps, refs)
  return multi_bleu([paper_tokenize(h, lang) for h in hyps], [paper_tokenize(r, lang) for r in refs])


def paper_signature(lang: str) -> str:
  """What paper_bleu computed, as sacreBLEU's signature names its own settings."""
  return (f"tok:moses-{lang}+compound-split|sacremoses:{importlib.metadata.version('sacremoses')}"
          f"|metric:multi-bleu.perl|case:mixed|nrefs:1")


def paper_bleu_score(hyps, refs, lang: str = "de") -> tuple[float, str]:
  """(paper_bleu, paper_signature): the paper-style score and what it means."""
  return paper_bleu(hyps, refs, lang), paper_signature(lang)
