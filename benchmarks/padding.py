"""Padding of the WMT experiments' batches on a WMT-shaped length distribution (docs/accelerators.md,
"Padding"): the share of batch slots that hold no token, for length buckets (today's, and finer ones)
and for packed rows, at the paper's ~25k real source and target tokens a batch.

    python -m benchmarks.padding [--pairs 400000] [--max_len 256] [--batch_tokens 25000]

The lengths are drawn, not read from WMT14 (which this machine cannot download): source lengths in
subword pieces from a log-normal with WMT14 en-de's shape under a 37k BPE vocabulary (median 24 pieces,
a tail past 100), the target 1.1x the source with 15% noise; the seed is fixed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib

import numpy as np

from data import batching

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "padding.json"


def wmt_shaped_lengths(pairs: int, max_len: int, seed: int = 0):
  """(source lengths, target lengths without EOS) int64 [pairs], each fitting max_len."""
  rng = np.random.default_rng(seed)
  src = np.clip(np.round(rng.lognormal(np.log(24), 0.65, pairs)), 1, max_len).astype(np.int64)
  tgt = np.clip(np.round(src * 1.1 * rng.normal(1.0, 0.15, pairs)), 1, max_len - 1).astype(np.int64)
  return src, tgt


def padding_of(plan, src, tgt, max_len: int, batch_tokens: int, packed: bool, fine: bool = False) -> dict:
  """Slots, real tokens and their shares over one epoch's plan (target side: target + EOS)."""
  slots = real_src = real_tgt = 0
  for b in range(len(plan)):
    length, members, _ = plan.batch(b)
    rows = (batching.rows_for(length, batch_tokens, 1) if packed
            else batching.bucket_rows(length, max_len, batch_tokens, fine=fine))
    slots += rows * length
    real_src += int(src[members].sum())
    real_tgt += int((tgt[members] + 1).sum())
  batches = len(plan)
  return {"batches": batches, "padding_src": 1 - real_src / slots, "padding_tgt": 1 - real_tgt / slots,
          "real_tgt_tokens_per_batch": real_tgt / batches, "slots_per_batch": slots / batches}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python -m benchmarks.padding", description=__doc__.split("\n")[0])
  p.add_argument("--pairs", type=int, default=400_000)
  p.add_argument("--max_len", type=int, default=256)
  p.add_argument("--batch_tokens", type=int, default=25_000)
  args = p.parse_args(argv)
  src, tgt = wmt_shaped_lengths(args.pairs, args.max_len)
  rng = lambda: np.random.default_rng(0)
  result = {"benchmark": "padding",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "pairs": args.pairs, "max_len": args.max_len, "batch_tokens": args.batch_tokens,
            "median_src": float(np.median(src)), "mean_src": float(src.mean()), "layouts": {}}
  for name in ("buckets", "fine_buckets", "packed"):
    if name == "packed":
      plan = batching.plan_packed(src, tgt, args.max_len, args.batch_tokens, rng())
    else:
      plan = batching.plan_buckets(src, tgt, args.max_len, args.batch_tokens, rng(), fine=name == "fine_buckets")
    out = padding_of(plan, src, tgt, args.max_len, args.batch_tokens, name == "packed", name == "fine_buckets")
    out["shapes"] = 1 if name == "packed" else len(batching.bucket_lengths(args.max_len, name == "fine_buckets"))
    result["layouts"][name] = out
    print(f"{name:13s} padding: target {out['padding_tgt']:.1%}, source {out['padding_src']:.1%}; "
          f"{out['real_tgt_tokens_per_batch']:,.0f} real target tokens in {out['slots_per_batch']:,.0f} "
          f"slots a batch ({out['batches']} batches, {out['shapes']} batch shapes)")
  RESULTS.write_text(json.dumps(result, indent=1) + "\n")
  print(f"wrote {RESULTS}")
  return result


if __name__ == "__main__":
  main()
