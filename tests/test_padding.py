"""config.data.fine_buckets: finer length buckets waste fewer batch slots on a WMT-shaped length
distribution (benchmarks/padding.py) while every pair is still trained once an epoch, within the
budget of real tokens."""
import numpy as np

from benchmarks.padding import padding_of, wmt_shaped_lengths
from data import batching


def test_fine_buckets_pad_less_and_keep_every_pair_within_the_budget():
  src, tgt = wmt_shaped_lengths(200_000, 256)
  shares = {}
  for fine in (False, True):
    plan = batching.plan_buckets(src, tgt, 256, 25_000, np.random.default_rng(0), fine=fine)
    shares[fine] = padding_of(plan, src, tgt, 256, 25_000, packed=False, fine=fine)["padding_tgt"]
    seen = []
    for b in range(len(plan)):
      length, members, _ = plan.batch(b)
      assert length in batching.bucket_lengths(256, fine)
      assert np.maximum(src[members], tgt[members] + 1).max() <= length
      assert src[members].sum() <= 25_000 and (tgt[members] + 1).sum() <= 25_000
      assert len(members) <= batching.bucket_rows(length, 256, 25_000, fine=fine)
      seen.append(members)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(len(src)))
  assert shares[True] < shares[False] - 0.04, shares
  assert batching.bucket_lengths(256, fine=True)[:3] == [8, 16, 24] and batching.bucket_lengths(256, True)[-1] == 256
  packed = batching.plan_packed(src, tgt, 256, 25_000, np.random.default_rng(0))
  assert padding_of(packed, src, tgt, 256, 25_000, packed=True)["padding_tgt"] < shares[True]
