"""How fast the input pipeline is, stage by stage, next to how fast the model consumes tokens.

    python -m benchmarks.input_pipeline [--config experiments/default.py[:arg]] [--batches 500]
                                        [--config.data.KEY=VALUE ...]

Stages, timed on this machine for the config's data section: read the training split (text), train the
shared vocabulary, tokenize, plan an epoch of batches, and assemble --batches batches (bucketed and packed).
Prints a table (seconds and target tokens/s per stage) and writes benchmarks/results/input_pipeline.json.
The batch stage must stay far above the train step's tokens/s (benchmarks/throughput.py), so that the
input never limits training.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import experiments

OUT = pathlib.Path(__file__).resolve().parent / "results" / "input_pipeline.json"


def _time(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.input_pipeline", description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="experiments/default.py")
  parser.add_argument("--batches", type=int, default=500, help="batches assembled per mode")
  parser.add_argument("--out", default=str(OUT))
  args, overrides = parser.parse_known_args(argv)
  config = experiments.load_experiment(args.config)
  experiments.apply_overrides(config, [o.removeprefix("--config.") for o in overrides])
  from data import load_pairs
  from run import get_vocab
  from data.batching import BatchIterator, tokenize

  dc = config.data
  rows = []
  pairs, seconds = _time(lambda: load_pairs(dc, "train"))
  rows.append(("read train split", seconds, len(pairs), None))
  with tempfile.TemporaryDirectory() as workdir:
    vocab, seconds = _time(lambda: get_vocab(dc, workdir))
  rows.append((f"train vocabulary ({vocab.size} pieces)", seconds, len(pairs), None))
  (src_ids, tgt_ids, _), seconds = _time(lambda: tokenize(vocab, pairs, max_len=int(dc.max_len)))
  target_tokens = sum(len(t) + 1 for t in tgt_ids)
  rows.append(("tokenize", seconds, len(pairs), target_tokens / seconds))
  for pack in (False, True):
    iterator = BatchIterator(src_ids, tgt_ids, max_len=int(dc.max_len), batch_tokens=int(dc.batch_tokens),
                             row_multiple=1, seed=0, pack=pack)
    _, seconds = _time(iterator.epoch_batches)
    rows.append((f"plan an epoch ({'packed' if pack else 'bucketed'})", seconds, len(src_ids), None))
    tokens = 0

    def run():
      nonlocal tokens
      for _ in range(args.batches):
        batch = next(iterator)
        tokens += int((batch["tgt_segments"] > 0).sum())
    _, seconds = _time(run)
    rows.append((f"assemble {args.batches} batches ({'packed' if pack else 'bucketed'})", seconds,
                 args.batches, tokens / seconds))

  print(f"input pipeline: {args.config}, source={dc.source}, batch_tokens={dc.batch_tokens}, "
        f"max_len={dc.max_len}")
  print(f"{'stage':<40} {'seconds':>9} {'items':>9} {'target tok/s':>14}")
  for name, seconds, items, rate in rows:
    print(f"{name:<40} {seconds:9.2f} {items:9d} {'' if rate is None else f'{rate:14,.0f}':>14}")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"config": args.config, "overrides": overrides, "stages": [
      dict(stage=n, seconds=s, items=i, target_tokens_per_s=r) for n, s, i, r in rows]}, indent=2) + "\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
