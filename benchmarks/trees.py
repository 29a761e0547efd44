"""Training speed of two checkouts of this repository, side by side: did a change slow the train loop?

    python -m benchmarks.trees --trees BEFORE_DIR AFTER_DIR [--rounds 3] [--steps 300] [--log_every 50]
                               [--note TEXT] [--out FILE] [--config=FILE[:ARG]] [--config.KEY=VALUE ...]

Each round runs `python -m train` once in every tree, in turn (the first of the round rotates), each in a
fresh process with its own PYTHONPATH, on the default experiment unless --config=FILE and --config.KEY=VALUE
flags say otherwise (passed to both trees alike). No evaluation, BLEU or checkpoint falls inside the timed steps:
a run logs target tokens/s every --log_every steps; the first interval (it compiles) is dropped and the
rest give the run's median. Prints, per tree, the median over rounds and the spread, and the ratio of
the second tree to the first within each round; writes the same as JSON (--out, default
benchmarks/results/trees.json).
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

OUT = pathlib.Path(__file__).resolve().parent / "results" / "trees.json"


def _speed(line: dict) -> float:
  """Target tokens per second of wall-clock in a log line, the same measure for trees before and after
  the time split (train/goodput.py): with the split, the interval's wall-clock less evaluation and
  checkpointing (its tokens/s counts step time alone); without it, train/tokens_per_sec, which was that."""
  if "time/wall_s" not in line:
    return line["train/tokens_per_sec"]
  return line["train/tokens"] / (line["time/wall_s"] - line["time/eval_s"] - line["time/checkpoint_s"])


def run_once(tree: pathlib.Path, workdir: pathlib.Path, steps: int, log_every: int, extra: list[str]) -> float:
  """Trains `steps` steps in `tree`; returns the median target tokens/s of its log intervals after the first."""
  flags = [f"--config.train.num_steps={steps}", f"--config.train.log_every={log_every}",
           f"--config.train.eval_every={steps + 1}", "--config.train.bleu_every=0",
           "--config.train.test_bleu=False", "--config.train.num_samples=0",
           "--config.train.tensorboard=False", "--config.train.progress=False",
           f"--config.train.checkpoint_every_steps={steps + 1}"]
  env = {**os.environ, "PYTHONPATH": str(tree)}
  cmd = [sys.executable, "-m", "train", "--workdir", str(workdir), *flags, *extra]
  done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
  if done.returncode:
    raise RuntimeError(f"{' '.join(cmd)} in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
  lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines() if l.strip()]
  speeds = [_speed(l) for l in lines if "train/tokens_per_sec" in l][1:]
  if not speeds:
    raise RuntimeError(f"{workdir}/metrics.jsonl: no log interval after the first; raise --steps")
  return statistics.median(speeds)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trees", nargs=2, required=True, metavar=("BEFORE", "AFTER"))
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--log_every", type=int, default=50)
  parser.add_argument("--note", default="")
  parser.add_argument("--out", default=str(OUT))
  args, extra = parser.parse_known_args(argv)
  bad = [f for f in extra if not f.startswith("--config")]
  if bad:
    parser.error(f"unknown arguments {bad}: only --config and --config.KEY=VALUE flags pass through to both trees")
  trees = [pathlib.Path(t).resolve() for t in args.trees]
  for tree in trees:
    if not (tree / "train" / "__main__.py").exists():
      parser.error(f"--trees: {tree} is not a checkout of this repository (no train/__main__.py)")
  speeds = [[] for _ in trees]      # by position: the two trees may be the same checkout
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.rounds):
      for i in ([0, 1] if r % 2 == 0 else [1, 0]):
        tree = trees[i]
        time.sleep(0.5)
        speed = run_once(tree, pathlib.Path(tmp) / f"round{r}_{i}", args.steps, args.log_every, extra)
        speeds[i].append(speed)
        print(f"[trees] round {r + 1}/{args.rounds} {tree} ({harness.commit_of(tree)}): {speed:,.0f} target tokens/s",
              flush=True)
  before, after = speeds
  ratios = [a / b for a, b in zip(after, before)]
  result = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "note": args.note, "machine": harness.machine(),
            "command": "python -m benchmarks.trees " + " ".join(argv if argv is not None else sys.argv[1:]),
            "steps": args.steps, "log_every": args.log_every, "overrides": extra,
            "trees": [{"path": str(t), "commit": harness.commit_of(t), "tokens_per_s": runs,
                       "median": statistics.median(runs)} for t, runs in zip(trees, speeds)],
            "ratio_after_over_before": {"median": statistics.median(ratios), "min": min(ratios),
                                        "max": max(ratios), "per_round": ratios}}
  for entry in result["trees"]:
    runs = entry["tokens_per_s"]
    print(f"{entry['commit']}: median {entry['median']:,.0f} target tokens/s "
          f"(spread {min(runs):,.0f}-{max(runs):,.0f}, {len(runs)} runs)")
  ratio = result["ratio_after_over_before"]
  print(f"after / before: {ratio['median']:.3f}x (per round {ratio['min']:.3f}-{ratio['max']:.3f})")
  pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
