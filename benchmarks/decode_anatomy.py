"""Where a decoding step's time goes, and what two cores give: the default model's search taken apart.

    python -m benchmarks.decode_anatomy [--task beam] [--repeats 7] [--preset default]

Every variant is our float32 search (benchmarks/systems/ours.py) in a fresh process of its own, timed
round-robin with the others (benchmarks/harness.py) on the same weights and sources as
`python -m benchmarks.throughput --preset default`:
- full: as the throughput benchmark runs it, the sentences split over one CPU device per core;
- no self-attention, no cross-attention, an eighth of the output layer: the same with one part's
  arithmetic taken out (benchmarks/systems/ours_parts.py); full minus it is that part's share;
- one device: every sentence on one device, as `python -m train`'s evaluation runs, with only the C++
  kernels' work shared over the cores (XLA's intra-op pool);
- one core alone: half the sentences on one device pinned to one core, the other core idle;
- two processes at once: that, twice, one process per core, both timed in the same round.
Two processes at once against one core alone says how much the two cores slow each other down when both
work (shared caches and memory, or a host that shares the cores); nothing in our code is shared there.
Writes benchmarks/results/decode_anatomy.json and prints a table.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

from benchmarks import harness, report, throughput
from run.devices import usable_cpus

PARTS = "benchmarks.systems.ours_parts"
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks.decode_anatomy", description=__doc__.split("\n")[0])
  p.add_argument("--preset", choices=sorted(throughput.PRESETS), default="default")
  p.add_argument("--task", choices=("greedy", "beam"), default="beam")
  p.add_argument("--beam_size", type=int, default=4)
  p.add_argument("--decode_batch", type=int, default=16)
  p.add_argument("--decode_len", type=int, default=64)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--pause", type=float, default=0.5)
  p.add_argument("--note", default="")
  p.add_argument("--out", default=str(RESULTS / "decode_anatomy.json"))
  args = p.parse_args(argv)
  sizes = throughput.parse_args(["--preset", args.preset])
  return args, sizes


def pair_round(pair, task: str, timeout: float = 900.0) -> list[float]:
  """Runs `task` on every worker of `pair` at the same moment; returns their times."""
  for w in pair:
    w.send(task)
  return [w.seconds(timeout) for w in pair]


def main(argv=None):
  args, sizes = parse_args(argv)
  cores = usable_cpus()
  half = args.decode_batch // cores
  if cores < 2 or args.decode_batch % cores:
    raise SystemExit(f"needs at least 2 cores and --decode_batch a multiple of them (have {cores} cores)")
  model = throughput.model_fields(sizes)
  result = {"benchmark": "decode_anatomy", "date": harness.now(), "note": args.note, "task": args.task,
            "steps": args.decode_len,
            "command": " ".join(["python", "-m", "benchmarks.decode_anatomy"] + (sys.argv[1:] if argv is None
                                                                                  else list(argv))),
            "machine": harness.machine(), "versions": harness.versions(), "commit": harness.commit_of(),
            "model": model, "load_average": {"start": os.getloadavg()[0]}}
  with tempfile.TemporaryDirectory(prefix="aiayn-anatomy-") as shared:
    harness.prepare(dict(dir=shared, model=model, exports=[], seed=0,
                         train=dict(rows=1, src_len=sizes.src_len, tgt_len=sizes.tgt_len, packed=False),
                         decode=dict(batch=args.decode_batch, src_len=sizes.src_len)), shared)
    base = {"dir": shared, "model": model, "matmul_dtype": None, "tasks": [args.task],
            "decode": {"len": args.decode_len, "beam_size": args.beam_size, "alpha": 0.6}}
    all_cores = throughput.xla_env(cores)
    variants = [  # name, what it is, spec options, XLA env
        ("full", f"{args.decode_batch} sentences over {cores} devices (the throughput benchmark)", {}, all_cores),
        ("no_self", "full without the self-attention arithmetic", {"ablate": "self"}, all_cores),
        ("no_cross", "full without the cross-attention arithmetic", {"ablate": "cross"}, all_cores),
        ("output_eighth", "full with an eighth of the output layer", {"ablate": "output"}, all_cores),
        ("one_device", f"{args.decode_batch} sentences on 1 device, its C++ kernels sharing the work over "
         f"the {cores} cores", {}, throughput.xla_env(1)),
        ("one_core", f"{half} sentences, 1 device pinned to CPU 0, the other cores idle",
         {"rows": half, "cpus": [0]}, throughput.xla_env(1))]
    workers = [harness.Worker(n, PARTS, dict(base, **o), env) for n, _, o, env in variants]
    pair = [harness.Worker(f"at_once_cpu{c}", PARTS, dict(base, rows=half, cpus=[c]), throughput.xla_env(1))
            for c in range(2)]
    harness.start(workers + pair, shared)
    broken = [w for w in workers + pair if w.status != "ready"]
    if broken:
      harness.close(workers + pair)
      raise SystemExit("; ".join(f"{w.name}: {w.reason}" for w in broken))
    try:
      for w in pair:
        for _ in range(args.warmup):
          pair_round([w], args.task)
      times = harness.round_robin(workers, args.task, warmup=args.warmup, repeats=0, pause=args.pause)
      at_once = []
      for _ in range(args.repeats):   # each round: the pair at once, then every variant in turn
        time.sleep(args.pause)
        at_once.append(statistics.mean(pair_round(pair, args.task)))
        more = harness.round_robin(workers, args.task, warmup=0, repeats=1, pause=args.pause)
        for name, seconds in more.items():
          times[name] += seconds
    finally:
      harness.close(workers + pair)
  times["two_at_once"] = at_once
  what = {n: w for n, w, _, _ in variants}
  what["two_at_once"] = "one_core's run in 2 processes at the same moment, on CPUs 0 and 1 (mean of the two)"
  info = {w.name: w.info for w in workers}
  info["two_at_once"] = [w.info for w in pair]
  result["variants"] = {n: dict(what=what[n], info=info[n], **harness.summary(times[n])) for n in times}
  med = {n: v["median_s"] for n, v in result["variants"].items()}
  result["derived"] = {
      "self_attention_share": 1 - med["no_self"] / med["full"],
      "cross_attention_share": 1 - med["no_cross"] / med["full"],
      "output_layer_share": (1 - med["output_eighth"] / med["full"]) * 8 / 7,   # the whole layer's, linearly
      "two_at_once_over_one_core": med["two_at_once"] / med["one_core"],
      "full_over_one_core": med["full"] / med["one_core"],
      "one_device_over_full": med["one_device"] / med["full"]}
  return harness.finish(result, args.out, report.render_anatomy)


if __name__ == "__main__":
  main()
