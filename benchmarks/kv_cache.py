"""KV-cache memory and decoding tokens/s for MHA, GQA and MQA, side by side (issue 14).

    python -m benchmarks.kv_cache [--length 512] [--rows 8] [--repeats 5] [--note TEXT] [--smoke]

A decoder-only model with random weights (what it says does not matter for speed) greedily decodes
`length` tokens after a one-token prompt, for num_kv_heads = num_heads (MHA), num_heads / 4 (GQA) and
1 (MQA), all in one process (one library, nothing else loaded). Prints the cache's bytes (exact: the sum
of its arrays) and tokens/s, median and spread of --repeats round-robin rounds after one compile run, and
writes them to benchmarks/results/kv_cache.json (not with --smoke).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from decode.prompt import prompt_sample
from benchmarks import harness
from model import Transformer, TransformerConfig, init_cache

OUT = pathlib.Path(__file__).resolve().parent / "results" / "kv_cache.json"


def _decoder(kv_heads: int, length: int, rows: int, d_model: int, num_heads: int, layers: int):
  """(num_kv_heads, cache bytes, a function that decodes `length` tokens greedily and waits for them)."""
  cfg = TransformerConfig(vocab_size=8000, d_model=d_model, d_ff=4 * d_model, num_heads=num_heads,
                          num_decoder_layers=layers, arch="decoder_only", num_kv_heads=kv_heads,
                          max_len=length + 2, dropout_rate=0.0)
  model = Transformer(cfg)
  params = model.init(jax.random.key(0), None, jnp.ones((1, 2), jnp.int32))["params"]
  cache_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(init_cache(cfg, rows, length + 1)))
  prompt = jnp.full((rows, 1), 2, jnp.int32)
  return lambda: jax.block_until_ready(prompt_sample(model, params, prompt, jax.random.key(0),
                                                     max_len=length, temperature=0.0)), cache_bytes


def run(length: int, rows: int, d_model: int, num_heads: int, layers: int, repeats: int = 1) -> list[dict]:
  """MHA, GQA and MQA built and compiled first, then timed in turn for `repeats` rounds (the first of a
  round rotates, so that load from elsewhere hits all three alike); medians and spread per variant."""
  variants = [("MHA", num_heads), ("GQA", max(1, num_heads // 4)), ("MQA", 1)]
  decoders = [_decoder(kv, length, rows, d_model, num_heads, layers) for _, kv in variants]
  for decode, _ in decoders:
    decode()                                        # compile
  seconds = [[] for _ in variants]
  for r in range(repeats):
    for i in [(r + k) % len(variants) for k in range(len(variants))]:
      start = time.perf_counter()
      decoders[i][0]()
      seconds[i].append(time.perf_counter() - start)
  results = []
  for (name, kv_heads), (_, cache_bytes), runs in zip(variants, decoders, seconds):
    speeds = sorted(rows * length / s for s in runs)
    results.append(dict(attention=name, num_kv_heads=kv_heads, cache_mib=cache_bytes / 2 ** 20,
                        tokens_per_s=statistics.median(speeds), slowest=speeds[0], fastest=speeds[-1],
                        runs=speeds))
  return results


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_cache", description=__doc__.split("\n")[0])
  parser.add_argument("--length", type=int, default=512, help="tokens decoded per row")
  parser.add_argument("--rows", type=int, default=8, help="rows decoded together")
  parser.add_argument("--repeats", type=int, default=5, help="timed rounds (each variant once a round)")
  parser.add_argument("--smoke", action="store_true", help="a tiny model and 8 tokens (seconds); writes nothing")
  parser.add_argument("--note", default="", help="a line recorded with the results")
  parser.add_argument("--out", default=str(OUT))
  args = parser.parse_args(argv)
  shape = dict(d_model=32, num_heads=4, layers=1) if args.smoke else dict(d_model=512, num_heads=8, layers=6)
  length = 8 if args.smoke else args.length
  repeats = 1 if args.smoke else args.repeats
  results = run(length, args.rows, repeats=repeats, **shape)
  print(f"{'attention':>9} {'kv heads':>8} {'cache MiB':>10} {'tokens/s':>10} {'spread':>15}   "
        f"({length} tokens x {args.rows} rows, median of {repeats} rounds)")
  for r in results:
    print(f"{r['attention']:>9} {r['num_kv_heads']:>8} {r['cache_mib']:>10.2f} {r['tokens_per_s']:>10.0f} "
          f"{r['slowest']:>7.0f}-{r['fastest']:<7.0f}")
  mha = results[0]["tokens_per_s"]
  print("speed against MHA: " + ", ".join(f"{r['attention']} {r['tokens_per_s'] / mha:.2f}x" for r in results))
  if not args.smoke:
    record = dict(date=harness.now(), note=args.note, machine=harness.machine(), versions=harness.versions(),
                  command="python -m benchmarks.kv_cache " + " ".join(argv if argv is not None else sys.argv[1:]),
                  model=dict(shape, vocab_size=8000, d_ff=4 * shape["d_model"]), length=length, rows=args.rows,
                  repeats=repeats, results=results)
    pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
