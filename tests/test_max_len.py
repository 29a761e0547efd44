"""data/max_len.py: max_len from the corpus keeps at least the share asked for, is the shortest such
multiple of 8, never passes the cap, agrees with the length filter, and says what it drops."""
import numpy as np
import pytest

from data.batching import fitting
from data.max_len import derive_max_len, needed


def test_keeps_the_share_asked_for_with_the_shortest_multiple_of_8():
  rng = np.random.default_rng(0)
  src = rng.integers(1, 60, 2000)
  tgt = rng.integers(1, 60, 2000)
  src[:7] = 300                                      # 7 very long pairs: 0.35% of the corpus
  choice = derive_max_len(src, tgt)
  need = needed(src, tgt)
  assert choice.max_len % 8 == 0 and choice.max_len < 300
  assert (need <= choice.max_len).mean() >= 0.995
  assert (need <= choice.max_len - 8).mean() < 0.995   # 8 shorter would keep too few
  assert choice.dropped == (need > choice.max_len).sum() >= 7 and choice.longest == 300
  # The length filter (data.batching.fitting) keeps exactly the pairs counted as kept, and reports them.
  with pytest.warns(UserWarning, match=f"skipped {choice.dropped} pairs"):
    assert len(fitting(src, tgt, choice.max_len)) == choice.pairs - choice.dropped


def test_the_target_needs_room_for_bos_and_eos():
  assert derive_max_len([8], [8]).max_len == 16      # target 8 pieces + 1 does not fit 8
  assert derive_max_len([8], [7]).max_len == 8
  assert derive_max_len([1, 1], [0, 0]).max_len == 8  # never below one multiple


def test_the_cap_wins_and_says_so():
  src = np.full(100, 400)
  choice = derive_max_len(src, np.zeros(100, int), cap=256)
  assert (choice.max_len, choice.dropped, choice.kept_share) == (256, 100, 0.0)
  assert "capped" in choice.describe() and "drops 100 longer pairs" in choice.describe()
  ok = derive_max_len([10] * 1000, [10] * 1000)
  assert ok.dropped == 0 and "capped" not in ok.describe() and "keeps 1,000 of 1,000 pairs" in ok.describe()


def test_coverage_one_keeps_every_pair_and_bad_inputs_are_errors():
  src = np.arange(1, 201)
  assert derive_max_len(src, src, coverage=1.0).max_len == 208 and derive_max_len(src, src, coverage=1.0).dropped == 0
  with pytest.raises(ValueError, match="non-empty"):
    derive_max_len([], [])
  with pytest.raises(ValueError, match="coverage"):
    derive_max_len([1], [1], coverage=0.0)
