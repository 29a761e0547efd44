"""Synthetic training pairs mixed with the parallel ones: back-translation, tagged (Caswell et al., 2019).

    config.data.synthetic_path = "synth.en,mono.ro"   # files in train_path's format (TSV, or two files)
    config.data.synthetic_ratio = 0.0                 # the synthetic share of the stream; 0: as they come
    config.data.synthetic_tag = "<BT>"                # prepended to every synthetic source; "" turns it off

(Not the embedded corpus of config.data.source="synthetic": these are pairs a model made, e.g. a reverse
model's translations of monolingual target text, docs/back_translation.md.)

The training stream is the parallel pairs and the synthetic pairs as one list of "slots" that
data.batching.BatchIterator shuffles and batches as it does one corpus. With synthetic_ratio=0 each pair
of either file fills one slot per pass. With a ratio r in (0, 1) the pass keeps its natural size N
(parallel + synthetic pairs) and r * N of its slots are synthetic: each side fills its slots with whole
copies of itself and a seeded sample (without replacement) for the rest, so the smaller side is upsampled
and a larger one subsampled. The slots depend only on the two files, the settings and the run's seed, so
a resumed run sees the same batches (its position is BatchIterator's).

The tag is one vocabulary piece, reserved when the vocabulary is trained (SentencePiece's
user_defined_symbols, data.cache.train_vocab_cached) and prepended to synthetic sources when batches are
made; the caches hold the plain encoding. The tag is read with a default, not declared in
experiments/default.py (see data/tasks.py on why): "<BT>" where synthetic_path is set, else "".
Translating with the trained model, sources are never tagged.
"""
from __future__ import annotations

import logging

import numpy as np

from data import tasks
from data.batching import fitting
from data.sources import DataError, synthetic_path, synthetic_tag
from data.tokens import join, ranges

_MIX_STREAM = 0x6d6978              # the slot sample's random stream, apart from the batch plan's
log = logging.getLogger(__name__)


def synthetic_ratio(data_config) -> float:
  """config.data.synthetic_ratio, 0.0 (natural proportions) where the config has no such key."""
  return float(data_config.get("synthetic_ratio", 0.0))


def holds_tag(vocab, tag: str) -> bool:
  """Whether `tag` is one piece of `vocab` (a SentencePiece vocabulary trained with it reserved). An
  imported pair of SentencePiece models (data.vocab.PairVocab, e.g. OPUS-MT's) never holds one: its
  pieces are the pretrained model's, each with its trained embedding row."""
  piece_id = vocab.piece_to_id(tag)
  return piece_id is not None and vocab.id_to_piece(piece_id) == tag


def tag_id(data_config, vocab) -> int | None:
  """The vocabulary id of config.data.synthetic_tag, or None when tagging is off. Raises DataError (one
  line) when the vocabulary has no such piece (it was trained before the tag was set)."""
  tag = synthetic_tag(data_config)
  if not tag:
    return None
  if not holds_tag(vocab, tag):
    fix = ("an imported vocabulary cannot hold a new piece (its ids are the pretrained model's)"
           if hasattr(vocab, "pieces") else
           "it was trained without it; start a new --workdir (the tag is reserved when the vocabulary is "
           "trained)")
    raise DataError(f"config.data.synthetic_tag={tag!r} is not a piece of the vocabulary {vocab.path}: "
                    f"{fix}; or set config.data.synthetic_tag='' to train on the synthetic pairs untagged")
  return vocab.piece_to_id(tag)


def slots(parallel: int, synthetic: int, ratio: float, seed: int):
  """(parallel indices [k_p], synthetic indices [k_s]) that fill one pass of the stream (module
  docstring). ratio 0: every pair once, in order."""
  if not 0.0 <= ratio < 1.0:
    raise DataError(f"config.data.synthetic_ratio={ratio!r}: use a share in [0, 1) of synthetic pairs in "
                    f"the training stream, or 0 for the files' own proportions")
  if not ratio:
    return np.arange(parallel), np.arange(synthetic)
  total = parallel + synthetic
  k_syn = int(round(ratio * total))
  rng = np.random.default_rng([seed, _MIX_STREAM])

  def fill(n, k):
    if not n or not k:
      return np.zeros(0, np.int64)
    rest = np.sort(rng.choice(n, k % n, replace=False))
    return np.concatenate([np.tile(np.arange(n), k // n), rest]).astype(np.int64)

  return fill(parallel, total - k_syn), fill(synthetic, k_syn)


def _interleave(is_syn, real, synth):
  """Two sides' (ids end to end, lengths) back into the order of the indices they were split from."""
  lengths = np.zeros(len(is_syn), np.int64)
  lengths[~is_syn], lengths[is_syn] = real[1], synth[1]
  starts = np.cumsum(lengths) - lengths                          # [k] where each pair starts in out
  out = np.zeros(int(lengths.sum()), np.int32)
  out[ranges(starts[~is_syn], real[1])] = real[0]
  out[ranges(starts[is_syn], synth[1])] = synth[0]
  return out, lengths


def mixed_sequences(data_config, vocab, parallel, synthetic, max_len: int, seed: int):
  """(src_len, tgt_len, get): what BatchIterator(sequences=...) reads, over the slots of `parallel` and
  `synthetic` (data.tokens.TokenPairs), synthetic sources tagged; pairs longer than max_len dropped
  (counted and reported per file) before the slots are drawn."""
  if tasks.task_of(data_config) != "translation":
    raise DataError(f"config.data.synthetic_path is for config.data.task='translation', not "
                    f"{tasks.task_of(data_config)!r}")
  tag = tag_id(data_config, vocab)
  get = {}
  lengths = {}
  for name, pairs, extra in (("train", parallel, 0), ("synthetic", synthetic, int(tag is not None))):
    src_len, tgt_len = tasks.lengths(data_config, pairs)
    src_len = src_len.astype(np.int32) + extra if extra else src_len
    keep = fitting(src_len, tgt_len, max_len, pairs.origin, f"config.data {name}")
    lengths[name] = (np.asarray(src_len)[keep], np.asarray(tgt_len)[keep], keep)
    get[name] = tasks.sequences(data_config, pairs)
  (p_src, p_tgt, p_keep), (s_src, s_tgt, s_keep) = lengths["train"], lengths["synthetic"]
  pick_par, pick_syn = slots(len(p_keep), len(s_keep), synthetic_ratio(data_config), seed)
  par_rows, syn_rows = p_keep[pick_par], s_keep[pick_syn]        # [slots of each] pair index in its file
  src_len = np.concatenate([p_src[pick_par], s_src[pick_syn]])   # [slots]
  tgt_len = np.concatenate([p_tgt[pick_par], s_tgt[pick_syn]])
  first_syn = len(par_rows)
  log.info(f"[data] training stream: {len(par_rows):,} parallel + {len(syn_rows):,} synthetic slots a pass "
           f"(of {len(p_keep):,} and {len(s_keep):,} pairs; synthetic_ratio={synthetic_ratio(data_config)}, "
           f"tag {synthetic_tag(data_config) or 'off'})")

  def sequences(indices):
    indices = np.asarray(indices, np.int64)
    is_syn = indices >= first_syn                                 # [k]
    p_src_ids, p_src_len, p_tgt_ids, p_tgt_len, _ = get["train"](par_rows[indices[~is_syn]])
    s_src_ids, s_src_len, s_tgt_ids, s_tgt_len, _ = get["synthetic"](syn_rows[indices[is_syn] - first_syn])
    if tag is not None:
      s_src_ids, s_src_len = join([tag, (s_src_ids, s_src_len)])
    src = _interleave(is_syn, (p_src_ids, p_src_len), (s_src_ids, s_src_len))
    tgt = _interleave(is_syn, (p_tgt_ids, p_tgt_len), (s_tgt_ids, s_tgt_len))
    return *src, *tgt, None

  return src_len, tgt_len, sequences
