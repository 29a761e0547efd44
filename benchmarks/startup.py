"""How long `python -m train` takes to start and finish a smoke run, checkout against checkout.

    python -m benchmarks.startup [--trees OLD,NEW] [--runs 5] [--beside 2] [--command "..."]

For each checkout (a path; default: this one) a compilation cache of its own under --dir (JAX's, and
run/programs.py's programs in it where the checkout keeps them), filled by one run that is not counted; then --runs runs of each, taking turns (old, new, old, new, ...), each in a
fresh interpreter with a fresh run directory, while --beside busy jobs run next to them the whole time
(each a process of its own looping a jitted 512x512 matmul, as another user's job would; 0 for none).
Each run's wall-clock and CPU seconds (user + system of the trainer and its children) are measured from
here, and its own `[train] time:` line is read back (its total, and compile's split into tracing,
lowering, cache reads and backend compile where the checkout prints it). "outside" is the wall-clock
less the time line: imports, the corpus and vocabulary checks, initialization, the end's report.

Prints a table of medians and the ratios of the last checkout to the first; writes
benchmarks/results/startup.json (docs/performance.md shows every such file; tests/TIMES.md quotes them).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import harness

OUT = pathlib.Path(__file__).resolve().parent / "results" / "startup.json"
COMMAND = "python -m train --config experiments/default.py:smoke --config.train.progress=False"
BUSY = """
import sys, time
import jax, jax.numpy as jnp
x, f = jnp.ones((512, 512)), jax.jit(lambda a: (a @ a) / 512.0)
end = time.time() + float(sys.argv[1])
while time.time() < end:
  x = f(x).block_until_ready()
"""
TIME_LINE = re.compile(r"\[train\] time: ([\d.]+) s .*compile ([\d.]+) s \(")
SPLIT = re.compile(r"tracing ([\d.]+) s, lowering ([\d.]+) s, cache reads ([\d.]+) s, backend compile ([\d.]+) s")


def _children_cpu() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def one_run(tree: pathlib.Path, command: str, cache: pathlib.Path, workdir: pathlib.Path) -> dict:
  """One run of `command` in `tree`: wall-clock, CPU, and its time line's parts."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
  env.update(JAX_COMPILATION_CACHE_DIR=str(cache), PYTHONPATH=str(tree))
  argv = [sys.executable if a == "python" else a for a in shlex.split(command)] + [f"--workdir={workdir}"]
  cpu, start = _children_cpu(), time.perf_counter()
  done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
  wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
  if done.returncode:
    sys.exit(f"benchmarks/startup.py: {command!r} in {tree} failed (exit {done.returncode}):\n"
             + (done.stdout + done.stderr)[-3000:])
  run = {"wall_s": wall, "cpu_s": cpu}
  line = TIME_LINE.search(done.stdout + done.stderr)
  if line:
    run.update(time_line_s=float(line[1]), compile_s=float(line[2]), outside_s=wall - float(line[1]))
  split = SPLIT.search(done.stdout + done.stderr)
  if split:
    run.update(zip(("tracing_s", "lowering_s", "cache_reads_s", "backend_compile_s"), map(float, split.groups())))
  return run


KEYS = ("wall_s", "cpu_s", "time_line_s", "outside_s", "compile_s", "tracing_s", "lowering_s", "cache_reads_s",
        "backend_compile_s")
HEADER = ["checkout", *(k.removesuffix("_s").replace("_", " ") for k in KEYS)]


def rows(result: dict) -> list[list[str]]:
  """One table row per checkout: its medians, seconds."""
  return [[tree["commit"], *(f"{tree['medians'][k]:.1f}" if k in tree["medians"] else "" for k in KEYS)]
          for tree in result["trees"]]


def describe(result: dict) -> str:
  """What was run, how often and beside what, and the last checkout over the first."""
  text = (f"`{result['command']}`, cache filled, {result['runs']} runs each taking turns, "
          f"{result['beside']} busy jobs beside, load {result['load_average']['start']:.1f}-"
          f"{result['load_average']['end']:.1f}")
  first, last = result["trees"][0]["medians"], result["trees"][-1]["medians"]
  if len(result["trees"]) > 1:
    text += (f"; last / first: wall {last['wall_s'] / first['wall_s']:.2f}, "
             f"CPU {last['cpu_s'] / first['cpu_s']:.2f}")
  return text


def render(result: dict) -> str:
  table = ["| " + " | ".join(HEADER) + " |", "|---" * len(HEADER) + "|"]
  table += ["| " + " | ".join(row) + " |" for row in rows(result)]
  return describe(result) + "; medians, seconds:\n\n" + "\n".join(table)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--trees", default=str(harness.REPO), help="checkouts to compare, comma-separated")
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--beside", type=int, default=0, help="busy jobs running beside the measurement")
  parser.add_argument("--command", default=COMMAND)
  parser.add_argument("--dir", default=None, help="where the caches and run directories go (default: a temp dir)")
  parser.add_argument("--out", default=str(OUT))
  args = parser.parse_args(argv)
  trees = [pathlib.Path(t).resolve() for t in args.trees.split(",")]
  root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="aiayn_startup_"))
  busy = [subprocess.Popen([sys.executable, "-c", BUSY, "86400"], env={**os.environ, "JAX_PLATFORMS": "cpu"})
          for _ in range(args.beside)]
  result = {"benchmark": "startup", "command": args.command, "runs": args.runs, "beside": args.beside, "date": harness.now(),
            "machine": harness.machine(), "versions": harness.versions(),
            "load_average": {},
            "trees": [{"path": str(t), "commit": harness.commit_of(t), "runs": []} for t in trees]}
  try:
    for i, tree in enumerate(trees):   # fill each checkout's cache; not counted
      print(f"filling the cache of {result['trees'][i]['commit']} ...", flush=True)
      one_run(tree, args.command, root / f"cache{i}", root / f"fill{i}")
    result["load_average"]["start"] = os.getloadavg()[0]   # once the busy jobs and the fills have run
    for r in range(args.runs):
      for i, tree in enumerate(trees):
        run = one_run(tree, args.command, root / f"cache{i}", root / f"run{i}_{r}")
        result["trees"][i]["runs"].append(run)
        print(f"run {r + 1}/{args.runs} {result['trees'][i]['commit']}: " +
              ", ".join(f"{k} {v:.1f}" for k, v in run.items()), flush=True)
  finally:
    for job in busy:
      job.kill()
  for tree in result["trees"]:
    tree["medians"] = {k: statistics.median(run[k] for run in tree["runs"]) for k in tree["runs"][0]}
  return harness.finish(result, args.out, render)


if __name__ == "__main__":
  main()
