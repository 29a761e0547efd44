"""Bulk decoding at corpus scale: flat memory in the input's size, and no loss of speed to the parts.

    python -m benchmarks.bulk_decode [--small 100000] [--large 2000000] [--repeats 2]

On a small random model (the speed of the search is not what is measured here, the bookkeeping around
it is) saved as a run directory, every measurement is one `python -m decode` command in a fresh process
of its own, greedy (--temperature 0), with one CPU device per core:
- in-memory: today's path, `--input FILE --output -` (stdout to a file): the input read whole and
  translated in one `translate` call;
- bulk: `--input FILE --output FILE`, in parts of --shard_lines lines (default: the command's, 64
  batches of the shortest bucket: 32,768 lines here), joined at the end.
At --small lines the two run in turn, `--repeats` rounds, the first rotating, so that load from
elsewhere on the machine hits both alike; their outputs must be byte-identical. At --large lines the
bulk path runs once. Lines/s is input lines over the command's wall time (start-up included, the same
for both); the ratio is the median over rounds of bulk lines/s over in-memory lines/s in the same round.
CPU seconds (user + system, of the child) are recorded beside: on a machine others share, they vary
less than wall time. Peak RSS is the child's (os.wait4). The criteria: peak RSS at --large within 1.3x
of that at --small, and bulk lines/s at --small at least 0.95x the in-memory path's.
Writes benchmarks/results/bulk_decode.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import harness

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MODEL = dict(d_model=64, d_ff=128, num_heads=2, num_encoder_layers=2, num_decoder_layers=2, max_len=64)
DISTINCT = 20_000     # distinct source sentences, repeated to make the inputs
WORDS = 4            # words per source sentence: short, so that the search is cheap and the bookkeeping shows
# Greedy, in beam-1 batches of the default batch_tokens (4,096 per CPU device).
FLAGS = ["--temperature", "0", "--beam_size", "1", "--max_extra_len", "4", "--no_progress"]


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks.bulk_decode", description=__doc__.split("\n")[0])
  p.add_argument("--small", type=int, default=100_000, help="input lines of the side-by-side runs")
  p.add_argument("--large", type=int, default=2_000_000, help="input lines of the memory run")
  p.add_argument("--repeats", type=int, default=4, help="runs of each path at --small")
  p.add_argument("--shard_lines", type=int, default=None, help="default: python -m decode's")
  p.add_argument("--dir", default=None, help="where the run and the inputs go (default: a temporary dir)")
  p.add_argument("--out", default=str(RESULTS / "bulk_decode.json"))
  return p.parse_args(argv)


def make_run(workdir: pathlib.Path, sources: list[str]) -> None:
  """A run directory as training writes one: config, vocabulary, one checkpoint of random weights."""
  import jax
  import jax.numpy as jnp

  from data.vocab import Vocab, train_vocab
  from experiments import default
  from model import Transformer, TransformerConfig
  from run import checkpoint as ckpt
  from run import config as config_io
  vocab = Vocab(train_vocab(sources, 1000, seed=0, sample_sentences=len(sources)))
  config = default.get_config()
  config.model.update(MODEL)
  config.model.dropout_rate = 0.0
  config_io.save_config(config, workdir)
  (workdir / "vocab.model").write_bytes(vocab.model_bytes)
  model = Transformer(TransformerConfig(vocab_size=vocab.size, **MODEL))
  params = model.init({"params": jax.random.key(0)}, jnp.ones((1, 4), jnp.int32),
                      jnp.ones((1, 4), jnp.int32))["params"]
  manager = ckpt.make_manager(workdir, async_save=False)
  ckpt.save(manager, 1, params, None, {"step": 1, "vocab_fingerprint": vocab.fingerprint})
  manager.wait_until_finished()
  manager.close()


def write_input(path: pathlib.Path, sources: list[str], lines: int) -> None:
  """`lines` lines cycling through `sources`, written as they go (the benchmark's own memory stays flat)."""
  with open(path, "w", encoding="utf-8") as f:
    for i in range(lines):
      f.write(sources[i % len(sources)] + "\n")


def timed(command: list[str], stdout_path=None) -> dict:
  """Runs a command in a fresh process; its wall seconds and peak RSS (MiB)."""
  env = harness._child_env({})
  stdout = open(stdout_path, "wb") if stdout_path else subprocess.DEVNULL
  start = time.perf_counter()
  child = subprocess.Popen(command, env=env, stdout=stdout, stderr=subprocess.PIPE)
  err = child.stderr.read()
  _, status, usage = os.wait4(child.pid, 0)
  seconds = time.perf_counter() - start
  child.returncode = os.waitstatus_to_exitcode(status)
  if stdout_path:
    stdout.close()
  if child.returncode != 0:
    raise RuntimeError(f"{' '.join(command)} exited with {child.returncode}: {err.decode()[-2000:]}")
  return dict(seconds=seconds, cpu_seconds=usage.ru_utime + usage.ru_stime,
              peak_rss_mib=usage.ru_maxrss / 1024)


def main(argv=None):
  args = parse_args(argv)
  commit = harness.commit_of()   # of the code the commands below run
  from data import synthetic
  root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="bulk_decode_"))
  root.mkdir(parents=True, exist_ok=True)
  pairs = synthetic.generate(0, {"train": DISTINCT, "dev": 0, "test": 0})["train"]
  sources = [" ".join(s.split()[:WORDS]) for s, _ in pairs]
  workdir = root / "run"
  if not (workdir / "config.json").exists():
    workdir.mkdir(exist_ok=True)
    make_run(workdir, sources)
  small, large = root / f"in_{args.small}.txt", root / f"in_{args.large}.txt"
  for path, lines in ((small, args.small), (large, args.large)):
    if not path.exists():
      write_input(path, sources, lines)
  decode = [sys.executable, "-m", "decode", "--workdir", str(workdir), *FLAGS]
  bulk = decode + (["--shard_lines", str(args.shard_lines)] if args.shard_lines else [])

  def run_bulk(path, name):
    out = root / name
    for old in (out, out.with_name(out.name + ".parts")):
      subprocess.run(["rm", "-rf", str(old)], check=True)
    return timed(bulk + ["--input", str(path), "--output", str(out)]), out

  runs = {"in_memory": [], "bulk": []}
  for r in range(args.repeats):
    order = ["in_memory", "bulk"] if r % 2 == 0 else ["bulk", "in_memory"]
    for name in order:
      if name == "in_memory":
        runs[name].append(timed(decode + ["--input", str(small), "--output", "-"], root / "in_memory.txt"))
      else:
        result, bulk_out = run_bulk(small, "bulk.txt")
        runs[name].append(result)
      print(f"[bulk_decode] {args.small} lines, {name}: {runs[name][-1]}", flush=True)
  identical = (root / "in_memory.txt").read_bytes() == bulk_out.read_bytes()
  large_run, large_out = run_bulk(large, "bulk_large.txt")
  print(f"[bulk_decode] {args.large} lines, bulk: {large_run}", flush=True)
  large_lines = sum(1 for _ in open(large_out, "rb"))

  rate = {name: statistics.median(args.small / r["seconds"] for r in rs) for name, rs in runs.items()}
  ratios = [m["seconds"] / b["seconds"] for m, b in zip(runs["in_memory"], runs["bulk"])]
  cpu_ratios = [m["cpu_seconds"] / b["cpu_seconds"] for m, b in zip(runs["in_memory"], runs["bulk"])]
  rss_small = max(r["peak_rss_mib"] for r in runs["bulk"])
  result = dict(
      what="python -m decode greedy, in-memory vs bulk (parts joined); lines/s of the whole command",
      model=MODEL, small_lines=args.small, large_lines=args.large, shard_lines=args.shard_lines,
      runs=runs, large_bulk=large_run, outputs_identical_at_small=identical,
      large_output_lines=large_lines,
      lines_per_s=rate, speed_ratios_per_round=ratios,
      speed_ratio_bulk_over_in_memory=statistics.median(ratios),
      cpu_speed_ratio_bulk_over_in_memory=statistics.median(cpu_ratios),
      peak_rss_mib=dict(bulk_small=rss_small, bulk_large=large_run["peak_rss_mib"],
                        in_memory_small=max(r["peak_rss_mib"] for r in runs["in_memory"])),
      rss_ratio_large_over_small=large_run["peak_rss_mib"] / rss_small,
      machine=harness.machine(), versions=harness.versions(),
      command="python -m benchmarks.bulk_decode " + " ".join(sys.argv[1:] if argv is None else argv),
      commit=commit, date=harness.now())
  pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
  print(render(result))
  return result


def render(r: dict) -> str:
  s, big = r["small_lines"], r["large_lines"]
  rss = r["peak_rss_mib"]
  return "\n".join([
      f"greedy, {s} lines: in-memory {r['lines_per_s']['in_memory']:.0f} lines/s, bulk "
      f"{r['lines_per_s']['bulk']:.0f} lines/s (medians); bulk/in-memory per round "
      f"{' '.join(f'{x:.3f}' for x in r['speed_ratios_per_round'])}, median "
      f"{r['speed_ratio_bulk_over_in_memory']:.3f} (need >= 0.95); by CPU seconds "
      f"{r['cpu_speed_ratio_bulk_over_in_memory']:.3f}; outputs identical: {r['outputs_identical_at_small']}",
      f"peak RSS: bulk {s} lines {rss['bulk_small']:.0f} MiB, bulk {big} lines {rss['bulk_large']:.0f} MiB: "
      f"ratio {r['rss_ratio_large_over_small']:.3f} (need <= 1.3); in-memory {s} lines "
      f"{rss['in_memory_small']:.0f} MiB; {big}-line output has {r['large_output_lines']} lines",
  ])


if __name__ == "__main__":
  main()
