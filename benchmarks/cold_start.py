"""How long a cold start's data takes as the processes grow: the vocabulary, the shards, the assembly.

    python -m benchmarks.cold_start [--pairs 1000000,8000000] [--processes 1,2] [--cpus_per_process 1]
                                    [--dir DIR] [--project 36000000:16]

For each size, a TSV of that many pairs (the embedded corpus's training pairs, repeated to size, as
benchmarks/input_pipeline.py writes them), and for each process count a fresh cache made by that many
processes started at once, each in its own fresh interpreter and pinned to --cpus_per_process CPUs of its
own (round robin over this machine's), with the default experiment's data settings (8,000 pieces from a
50,000-sentence sample). Every process does what a training process does first (train/train.py): the
vocabulary (one trains it, the others wait on its lock), its share of the shards (data/shards.py, a
worker per CPU), then the cache (one assembles it, the others wait). Each reports when the vocabulary
was ready, when every shard was whole and when the cache was, from the common start; the caches of one
size are checked to be the same bytes whatever the process count.

Prints a table and the projection for --project PAIRS:PROCESSES from a straight-line fit over the sizes:
the vocabulary and the assembly are one process's work each (seconds a + b * pairs), the shards are
shared (core-seconds a pair, from the one-process runs, divided by processes x CPUs). Writes
benchmarks/results/cold_start.json; docs/data_at_scale.md quotes it.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import harness
from benchmarks.input_pipeline import write_corpus

OUT = pathlib.Path(__file__).resolve().parent / "results" / "cold_start.json"
ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = dict(vocab_size=8000, vocab_sample_sentences=50_000)   # the default experiment's, as input_pipeline's


def child(spec: dict) -> None:
  """One process of a cold start: pinned, vocabulary, shards, cache; prints its times as JSON."""
  if spec["cpus"]:
    os.sched_setaffinity(0, spec["cpus"])
  import ml_collections
  from data import cache
  from data.vocab import open_vocab
  config, start = ml_collections.ConfigDict(spec["config"]), spec["start"]
  imported = time.time() - start
  cpu = _cpu_s()
  model, _ = cache.train_vocab_cached(config)
  vocab_ready, vocab_cpu = time.time() - start, _cpu_s() - cpu
  vocab = open_vocab(model)
  reader = cache.open_split(config, "train")
  path = cache.split_dir(config, vocab, "train", reader)
  cpu = _cpu_s()
  report = cache.build(config, reader, vocab, path, "train", progress=False)
  build_cpu = _cpu_s() - cpu
  pairs = len(cache.tokenized(config, vocab, "train", progress=False))
  print(json.dumps({"imported_s": imported, "vocab_ready_s": vocab_ready, "cache_ready_s": time.time() - start,
                    "vocab_s": vocab_ready - imported, "vocab_cpu_s": vocab_cpu, "build_cpu_s": build_cpu,
                    "parts_s": report["parts_s"],
                    "assembly_s": report["assembly_s"] if report["assembled"] else 0.0,
                    "assembled": report["assembled"], "built": report["built"], "shards": report["shards"],
                    "pairs": pairs, "cpus": sorted(os.sched_getaffinity(0)), "cache": str(path)}), flush=True)


def _cpu_s() -> float:
  """CPU seconds (user + system) of this process and of its ended children (the tokenizing workers)."""
  own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_config(corpus: pathlib.Path, cache_dir: pathlib.Path, processes: int, cpus_per_process: int,
               log: pathlib.Path) -> dict:
  """`processes` fresh processes making one cold cache together. -> their reports and the wall time."""
  shutil.rmtree(cache_dir, ignore_errors=True)
  config = dict(source="files", train_path=str(corpus / "train.tsv"), dev_path=str(corpus / "dev.tsv"),
                test_path=str(corpus / "test.tsv"), src_lang="en", tgt_lang="de", vocab_model_type="bpe",
                vocab_seed=0, cache_dir=str(cache_dir), **DATA)
  machine = sorted(os.sched_getaffinity(0))
  env = harness._child_env({"AIAYN_TOKENIZE_WORKERS": ""})
  start, procs = time.time(), []
  with open(log, "w") as out:
    for p in range(processes):
      cpus = ([machine[(p * cpus_per_process + i) % len(machine)] for i in range(cpus_per_process)]
              if cpus_per_process else [])
      spec = {"config": config, "start": start, "cpus": cpus}
      command = [sys.executable, "-m", "benchmarks.cold_start", "--child", json.dumps(spec)]
      procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=out, text=True))
    reports = []
    for process in procs:
      stdout, _ = process.communicate()
      if process.returncode:
        raise RuntimeError(f"a cold-start process failed ({process.returncode}); see {log}")
      reports.append(json.loads(stdout.strip().splitlines()[-1]))
  wall = time.time() - start
  return {"processes": processes, "cpus_per_process": cpus_per_process, "wall_s": wall,
          "vocab_s": max(r["vocab_ready_s"] - r["imported_s"] for r in reports),
          "parts_s": max(r["parts_s"] for r in reports),
          "assembly_s": max(r["assembly_s"] for r in reports),
          "imported_s": max(r["imported_s"] for r in reports),
          "vocab_cpu_s": sum(r["vocab_cpu_s"] for r in reports),
          "build_cpu_s_by_process": [r["build_cpu_s"] for r in reports],
          "shards": reports[0]["shards"], "built_by_process": [r["built"] for r in reports],
          "pairs": reports[0]["pairs"], "cache": reports[0]["cache"]}


def _files(path: pathlib.Path) -> dict:
  return {f.name: f.read_bytes() for f in sorted(pathlib.Path(path).iterdir())}


def _fit(points) -> tuple[float, float]:
  """(a, b) of seconds = a + b * pairs through (pairs, seconds) points (through 0 with one point)."""
  xs, ys = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
  if len(set(xs.tolist())) < 2:
    return 0.0, float(ys.mean() / xs.mean())
  b, a = np.polyfit(xs, ys, 1)
  if a < 0 or b < 0:   # noise on a small part: proportional instead
    return 0.0, float(ys.sum() / xs.sum())
  return float(a), float(b)


def project(rows: list[dict], pairs: int, processes: int, cpus: tuple[int, ...]) -> dict:
  """The cold start of `pairs` on `processes` processes of each of `cpus` CPUs of their own, from CPU
  seconds (which a shared machine's load does not inflate as it does wall time): the vocabulary's
  (one process's work) fitted over the sizes, the shards' CPU seconds a pair over every run (all
  processes together), and the assembly's wall seconds fitted over the sizes (file work)."""
  vocab = _fit([(r["pairs"], r["vocab_cpu_s"]) for r in rows if r["processes"] == 1])
  assembly = _fit([(r["pairs"], r["assembly_s"]) for r in rows])
  per_pair = float(np.mean([sum(r["build_cpu_s_by_process"]) / r["pairs"] for r in rows]))   # CPU-s a pair
  out = {"pairs": pairs, "processes": processes, "vocab_s": vocab[0] + vocab[1] * pairs,
         "assembly_s": assembly[0] + assembly[1] * pairs, "cpu_seconds_a_pair": per_pair, "by_cpus": {}}
  for c in cpus:
    parts = pairs * per_pair / (processes * c)
    out["by_cpus"][str(c)] = {"parts_s": parts, "total_s": out["vocab_s"] + parts + out["assembly_s"],
                              "one_process_total_s": out["vocab_s"] + pairs * per_pair / c + out["assembly_s"]}
  return out


def render(result: dict) -> str:
  lines = ["| pairs | processes x CPUs | wall s | vocabulary s (CPU s) | shards s | assembly s "
           "| shards made by each | shards' CPU s, each |", "|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    lines.append(f"| {r['pairs']:,} | {r['processes']} x {r['cpus_per_process']} | {r['wall_s']:.0f} "
                 f"| {r['vocab_s']:.1f} ({r['vocab_cpu_s']:.1f}) | {r['parts_s']:.0f} | {r['assembly_s']:.1f} "
                 f"| {' / '.join(str(len(b)) for b in r['built_by_process'])} of {r['shards']} "
                 f"| {' / '.join(f'{c:.0f}' for c in r['build_cpu_s_by_process'])} |")
  p = result["projection"]
  lines += ["", f"Projected for {p['pairs']:,} pairs on {p['processes']} processes, each with CPUs of its own "
                f"({p['cpu_seconds_a_pair'] * 1e6:.0f} CPU-us a pair for the shards; vocabulary "
                f"{p['vocab_s']:.0f} s, assembly {p['assembly_s']:.0f} s):", "",
            "| CPUs a process | shards s | cold start s | one process alone s |", "|---|---|---|---|"]
  for c, v in p["by_cpus"].items():
    lines.append(f"| {c} | {v['parts_s']:.0f} | {v['total_s']:.0f} | {v['one_process_total_s']:.0f} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.cold_start", description=__doc__.split("\n")[0])
  parser.add_argument("--pairs", default="1000000,8000000", help="comma-separated corpus sizes")
  parser.add_argument("--processes", default="1,2", help="comma-separated process counts")
  parser.add_argument("--cpus_per_process", type=int, default=1,
                      help="CPUs each process is pinned to (0: not pinned, every CPU of this machine)")
  parser.add_argument("--project", default="36000000:16", help="PAIRS:PROCESSES to project to")
  parser.add_argument("--project_cpus", default="1,4,8", help="CPUs a process, for the projection")
  parser.add_argument("--dir", default="", help="where corpora and caches go (default: a temporary folder)")
  parser.add_argument("--out", default=str(OUT))
  parser.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    return child(json.loads(args.child))
  from data import synthetic
  sizes = [int(n) for n in args.pairs.split(",")]
  counts = [int(n) for n in args.processes.split(",")]
  root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="aiayn_cold_start_"))
  base = synthetic.generate(0, {"train": min(200_000, max(sizes))})
  result = {"date": harness.now(), "machine": harness.machine(), "commit": harness.commit_of(),
            "command": "python -m benchmarks.cold_start " + " ".join(sys.argv[1:] if argv is None else argv),
            "data": DATA, "load_average": {"start": os.getloadavg()[0]}, "rows": []}
  for pairs in sizes:
    corpus = root / str(pairs) / "corpus"
    write_corpus(corpus, pairs, base)
    caches = {}
    for count in counts:
      row = run_config(corpus, root / str(pairs) / f"cache_{count}", count, args.cpus_per_process,
                       root / str(pairs) / f"{count}.log")
      row["corpus_mib"] = (corpus / "train.tsv").stat().st_size / 2 ** 20
      row["load_average"] = os.getloadavg()[0]
      caches[count] = _files(pathlib.Path(row.pop("cache")))
      row["same_bytes_as_first"] = caches[count] == caches[counts[0]]
      if not row["same_bytes_as_first"]:
        raise RuntimeError(f"{pairs:,} pairs: the cache of {count} processes differs from {counts[0]}'s")
      print(json.dumps(row), flush=True)
      result["rows"].append(row)
    shutil.rmtree(root / str(pairs), ignore_errors=True)
  total, processes = (int(x) for x in args.project.split(":"))
  result["projection"] = project(result["rows"], total, processes,
                                 tuple(int(c) for c in args.project_cpus.split(",")))
  harness.finish(result, args.out, render)


if __name__ == "__main__":
  main()
