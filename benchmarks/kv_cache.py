"""KV-cache memory and decoding tokens/s for MHA, GQA and MQA, side by side (issue 14).

    python -m benchmarks.kv_cache [--length 512] [--rows 8] [--smoke]

A decoder-only model with random weights (what it says does not matter for speed) greedily decodes
`length` tokens after a one-token prompt, for num_kv_heads = num_heads (MHA), num_heads / 4 (GQA) and
1 (MQA). Prints the cache's bytes (exact: the sum of its arrays) and tokens/s (after one compile run).
Not yet measured on a quiet machine (docs/family.md).
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from decode.prompt import prompt_sample
from model import Transformer, TransformerConfig, init_cache


def run(length: int, rows: int, d_model: int, num_heads: int, layers: int) -> list[dict]:
  results = []
  for name, kv_heads in (("MHA", num_heads), ("GQA", max(1, num_heads // 4)), ("MQA", 1)):
    cfg = TransformerConfig(vocab_size=8000, d_model=d_model, d_ff=4 * d_model, num_heads=num_heads,
                            num_decoder_layers=layers, arch="decoder_only", num_kv_heads=kv_heads,
                            max_len=length + 2, dropout_rate=0.0)
    model = Transformer(cfg)
    params = model.init(jax.random.key(0), None, jnp.ones((1, 2), jnp.int32))["params"]
    cache = init_cache(cfg, rows, length + 1)
    cache_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))
    prompt = jnp.full((rows, 1), 2, jnp.int32)
    decode = lambda: jax.block_until_ready(prompt_sample(model, params, prompt, jax.random.key(0),
                                                         max_len=length, temperature=0.0))
    decode()                                        # compile
    start = time.perf_counter()
    decode()
    seconds = time.perf_counter() - start
    results.append(dict(attention=name, num_kv_heads=kv_heads, cache_mib=cache_bytes / 2 ** 20,
                        tokens_per_s=rows * length / seconds))
  return results


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_cache", description=__doc__.split("\n")[0])
  parser.add_argument("--length", type=int, default=512, help="tokens decoded per row")
  parser.add_argument("--rows", type=int, default=8, help="rows decoded together")
  parser.add_argument("--smoke", action="store_true", help="a tiny model and 8 tokens (seconds)")
  args = parser.parse_args(argv)
  shape = dict(d_model=32, num_heads=4, layers=1) if args.smoke else dict(d_model=512, num_heads=8, layers=6)
  length = 8 if args.smoke else args.length
  print(f"{'attention':>9} {'kv heads':>8} {'cache MiB':>10} {'tokens/s':>10}   ({length} tokens x {args.rows} rows)")
  for r in run(length, args.rows, **shape):
    print(f"{r['attention']:>9} {r['num_kv_heads']:>8} {r['cache_mib']:>10.2f} {r['tokens_per_s']:>10.0f}")


if __name__ == "__main__":
  main()
