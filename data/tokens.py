"""Tokenized pairs as flat arrays: every source's ids end to end in one array, with offsets into it.

    pairs = TokenPairs.from_ids(src_ids, tgt_ids)       # in memory (dev and test sets, tests)
    pairs = data.cache.open_split(...)                  # the same, memory-mapped from the on-disk cache
    flat, lengths = pairs.src.gather(indices)           # the ids of some pairs, end to end

Nothing here holds a Python object per pair: a corpus of N pairs is a few arrays of N (+1) integers, so
planning batches reads lengths only and each process reads only the pairs of its own rows.
"""
from __future__ import annotations

import numpy as np


def ranges(starts, lengths):
  """Indices start_0 .. start_0+len_0-1, start_1 .. (one flat int64 array): what a gather of several
  variable-length pieces reads, and where a scatter of them writes."""
  lengths = np.asarray(lengths, np.int64)
  total = int(lengths.sum())
  firsts = np.cumsum(lengths) - lengths                            # [pieces] where each starts in the output
  return np.repeat(np.asarray(starts, np.int64) - firsts, lengths) + np.arange(total, dtype=np.int64)


def join(pieces):
  """Per item, the concatenation of `pieces`: each (ids end to end, lengths [k]) or one constant id.
  Returns (ids end to end int32, lengths [k] int64)."""
  count = next(len(p[1]) for p in pieces if isinstance(p, tuple))
  sizes = [np.asarray(p[1], np.int64) if isinstance(p, tuple) else np.ones(count, np.int64) for p in pieces]
  total = np.sum(sizes, axis=0) if sizes else np.zeros(count, np.int64)
  out = np.zeros(int(total.sum()), np.int32)
  start = np.cumsum(total) - total                                 # [k] where each item starts in out
  for piece, size in zip(pieces, sizes):
    if isinstance(piece, tuple):
      out[ranges(start, size)] = piece[0]
    else:
      out[start] = piece
    start = start + size
  return out, total


class Side:
  """One side of a corpus: ids [total tokens] end to end and offsets [pairs + 1] (int64) into them."""

  def __init__(self, ids, offsets, lengths=None):
    self.ids, self.offsets = ids, offsets
    # [pairs] (uint16 where every length fits, else int32): what batch planning reads.
    self.lengths = np.diff(offsets).astype(length_dtype(offsets)) if lengths is None else lengths

  def __len__(self) -> int:
    return len(self.offsets) - 1

  def gather(self, indices):
    """(ids of pairs `indices` end to end [sum of their lengths] int32, their lengths [k] int64)."""
    indices = np.asarray(indices, np.int64)
    lengths = self.lengths[indices].astype(np.int64)
    flat = np.asarray(self.ids[ranges(self.offsets[indices], lengths)], np.int32)
    return flat, lengths

  def __getitem__(self, i: int) -> np.ndarray:
    return np.asarray(self.ids[int(self.offsets[i]):int(self.offsets[i + 1])], np.int32)


def length_dtype(offsets):
  longest = int(np.diff(offsets).max(initial=0)) if len(offsets) > 1 else 0
  return np.uint16 if longest < 2 ** 16 - 8 else np.int32   # room for the few ids a task adds


class TokenPairs:
  """Tokenized (source, target) pairs: .src and .tgt (Side), and origin(i), where pair i came from.

  Sources hold the plain encoding (no EOS: config.data.source_eos adds it when batches are made)."""

  def __init__(self, src: Side, tgt: Side, origin=None):
    if len(src) != len(tgt):
      raise ValueError(f"{len(src)} sources but {len(tgt)} targets")
    self.src, self.tgt = src, tgt
    self._origin = origin or (lambda i: f"pair {i}")

  def __len__(self) -> int:
    return len(self.src)

  def origin(self, i: int) -> str:
    return self._origin(int(i))

  @classmethod
  def from_ids(cls, src_ids, tgt_ids, origins=None) -> "TokenPairs":
    """From per-pair id sequences (lists or arrays), e.g. a tokenized dev set."""
    def side(seqs):
      lengths = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
      offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
      ids = np.concatenate([np.asarray(s, np.int32) for s in seqs]) if len(seqs) else np.zeros(0, np.int32)
      return Side(ids.astype(np.int32), offsets)
    return cls(side(src_ids), side(tgt_ids), (lambda i: origins[i]) if origins is not None else None)
