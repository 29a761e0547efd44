"""config.data.max_len from the corpus: the shortest length that keeps nearly every pair, within a cap.

A fixed max_len (the default experiment's 64 pieces) silently drops a corpus's long pairs; on a corpus of
long sentences that is real data. `derive_max_len` takes the pairs' lengths in pieces and returns the
smallest multiple of 8 that keeps at least `coverage` of them (99.5% by default), capped at `cap`, and
what it drops:

    choice = derive_max_len(src_len, tgt_len)      # int arrays [pairs], pieces per side
    print(choice.describe())                       # the line a run prints
    config.data.max_len = choice.max_len

A pair fits max_len as data.batching.fitting decides: its source has at most max_len pieces and its
target at most max_len - 1 (room for BOS / EOS). Pure numpy: no vocabulary, no files.
"""
from __future__ import annotations

import dataclasses

import numpy as np

COVERAGE = 0.995     # the share of the training pairs max_len keeps, at least
CAP = 256            # the longest max_len chosen (the model's positions, and the cost of long rows)
MULTIPLE = 8         # max_len is rounded up to this (bucket and packed-row shapes)


@dataclasses.dataclass(frozen=True)
class MaxLenChoice:
  max_len: int        # the chosen config.data.max_len
  pairs: int          # pairs measured
  dropped: int        # pairs longer than max_len (skipped by the length filter)
  longest: int        # the longest pair's need (max_len that would keep every pair)
  coverage: float     # the share asked for
  cap: int

  @property
  def kept_share(self) -> float:
    return 1.0 - self.dropped / self.pairs

  def describe(self) -> str:
    """One line for the run's log: the choice, what it keeps and what it drops."""
    capped = " (capped: fewer than asked fit)" if self.kept_share < self.coverage else ""
    return (f"data.max_len={self.max_len} from the corpus: keeps {self.pairs - self.dropped:,} of "
            f"{self.pairs:,} pairs ({100 * self.kept_share:.2f}%, asked {100 * self.coverage:g}%, cap "
            f"{self.cap}){capped}; drops {self.dropped:,} longer pairs (the longest needs {self.longest})")


def needed(src_len, tgt_len) -> np.ndarray:
  """int [pairs]: the smallest max_len each pair fits (source <= max_len, target <= max_len - 1)."""
  return np.maximum(np.asarray(src_len, np.int64), np.asarray(tgt_len, np.int64) + 1)


def derive_max_len(src_len, tgt_len, *, coverage: float = COVERAGE, cap: int = CAP,
                   multiple: int = MULTIPLE) -> MaxLenChoice:
  """The smallest multiple of `multiple` that keeps at least `coverage` of the pairs, at most `cap`.

  src_len, tgt_len: int [pairs], pieces per side without specials (a decoder-only task passes its
  whole sequence as the target and 0 as the source). Raises ValueError for no pairs or a bad argument.
  """
  need = needed(src_len, tgt_len)
  if need.ndim != 1 or not len(need):
    raise ValueError(f"derive_max_len: needs a non-empty 1-d array of pair lengths, got shape {need.shape}")
  if not 0 < coverage <= 1 or cap < multiple or multiple < 1:
    raise ValueError(f"derive_max_len: coverage {coverage} must be in (0, 1], cap {cap} >= multiple "
                     f"{multiple} >= 1")
  keep = int(np.ceil(coverage * len(need)))                          # pairs that must fit
  shortest = int(np.partition(need, keep - 1)[keep - 1])             # the keep-th smallest need
  max_len = min(cap, max(multiple, -(-shortest // multiple) * multiple))
  return MaxLenChoice(max_len=max_len, pairs=len(need), dropped=int((need > max_len).sum()),
                      longest=int(need.max()), coverage=coverage, cap=cap)
