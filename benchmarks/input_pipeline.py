"""How fast the input pipeline is, and how its memory and start-up grow with the corpus.

    python -m benchmarks.input_pipeline [--config experiments/default.py[:arg]] [--batches 500]
                                        [--config.data.KEY=VALUE ...]
    python -m benchmarks.input_pipeline --pairs 200000,2000000,8000000 [--dir DIR] [--steps 20]
    python -m benchmarks.input_pipeline --formats [--batches 200]

Without --pairs: each stage, timed in this process for the config's data section: the vocabulary (a
bounded sample of the training split), tokenizing the split into its on-disk cache (data/cache.py),
planning an epoch from the cache's length arrays, and assembling --batches batches (bucketed and
packed). Writes benchmarks/results/input_pipeline.json.

With --pairs: for each size, a TSV of that many pairs (the embedded corpus's training pairs, repeated
to size) and `python -m train` of the smoke model on it for --steps steps, run twice in processes of
their own: cold (no cache: the vocabulary and the tokenized corpus are made) and warm (a new run
directory, the cache present). Prints the seconds from the process's start to its first step, its peak
resident memory, and the source + target tokens per second one process assembles from the warm cache,
for one process of one and for each of two (every process assembles only its rows). Writes
benchmarks/results/input_pipeline_scale.json and prints the markdown table docs/data_at_scale.md shows.

With --formats: how fast the pairs of a batch are read from ArrayRecord (a record per pair, by index, as
Grain's and TFDS's data sources read) and from the cache's flat arrays, side by side. Writes
benchmarks/results/input_pipeline_formats.json, whose table docs/data.md quotes.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import experiments
from benchmarks import harness
from run.console import log_to_console

OUT = pathlib.Path(__file__).resolve().parent / "results" / "input_pipeline.json"
SCALE_OUT = OUT.with_name("input_pipeline_scale.json")
FORMATS_OUT = OUT.with_name("input_pipeline_formats.json")
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _time(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def _assembly_rate(iterator, batches: int) -> tuple[float, float, float]:
  """(source + target, target) tokens per second that `iterator` assembles (its own rows only), and the
  seconds `batches` batches took."""
  next(iterator)   # the epoch's plan
  src = tgt = 0
  start = time.perf_counter()
  for _ in range(batches):
    batch = next(iterator)
    src += int((batch["src_segments"] > 0).sum())
    tgt += int((batch["tgt_segments"] > 0).sum())
  seconds = time.perf_counter() - start
  return (src + tgt) / seconds, tgt / seconds, seconds


def stages(args, overrides) -> None:
  config = experiments.load_experiment(args.config)
  experiments.apply_overrides(config, [o.removeprefix("--config.") for o in overrides])
  from data import make_train_iterator, tokenized
  from run import get_vocab

  dc, rows = config.data, []
  with tempfile.TemporaryDirectory() as scratch:
    os.environ["AIAYN_DATA_CACHE"] = str(pathlib.Path(scratch) / "cache")   # cold: nothing cached
    vocab, seconds = _time(lambda: get_vocab(dc, scratch))
    rows.append((f"train vocabulary ({vocab.size} pieces, bounded sample)", seconds, None, None))
    pairs, seconds = _time(lambda: tokenized(dc, vocab, "train"))
    rows.append(("tokenize into the cache", seconds, len(pairs), float(pairs.tgt.offsets[-1]) / seconds))
    del pairs
    for pack in (False, True):
      dc.pack = pack
      mode = "packed" if pack else "bucketed"
      iterator, seconds = _time(lambda: make_train_iterator(dc, vocab, seed=0, row_multiple=1))
      batches, plan = _time(iterator.epoch_batches)
      rows.append((f"open the cache, plan an epoch ({mode})", seconds + plan, batches, None))
      _, rate, seconds = _assembly_rate(iterator, args.batches)
      rows.append((f"assemble {args.batches} batches ({mode})", seconds, args.batches, rate))
  print(f"input pipeline: {args.config}, source={dc.source}, batch_tokens={dc.batch_tokens}, "
        f"max_len={dc.max_len}")
  print(f"{'stage':<48} {'seconds':>9} {'items':>9} {'target tok/s':>14}")
  for name, seconds, items, rate in rows:
    print(f"{name:<48} {seconds:9.2f} {'' if items is None else f'{items:9d}':>9} "
          f"{'' if rate is None else f'{rate:14,.0f}':>14}")
  _write(args.out, {"config": args.config, "overrides": overrides, "stages": [
      dict(stage=n, seconds=s, items=i or 0, target_tokens_per_s=r) for n, s, i, r in rows]})


def _write(path, result: dict) -> None:
  out = pathlib.Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"date": harness.now(), "machine": harness.machine(), **result}, indent=2) + "\n")
  print(f"wrote {out}")


# ---------------------------------------------------------------------------------------------------
# --pairs: memory and start-up of `python -m train` as the corpus grows.
# ---------------------------------------------------------------------------------------------------

def write_corpus(folder: pathlib.Path, pairs: int, base: dict) -> None:
  """folder/train.tsv: `pairs` lines cycling through base['train']; dev.tsv, test.tsv: base's."""
  folder.mkdir(parents=True, exist_ok=True)
  lines = [f"{s}\t{t}\n" for s, t in base["train"]]
  with open(folder / "train.tsv", "w") as f:
    for start in range(0, pairs, len(lines)):
      f.writelines(lines[:min(len(lines), pairs - start)])
  for split in ("dev", "test"):
    (folder / f"{split}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in base[split]))


def train_command(corpus: pathlib.Path, workdir: pathlib.Path, steps: int) -> list[str]:
  """`python -m train` of the smoke model with the default experiment's data settings on corpus."""
  data = dict(source="files", train_path=corpus / "train.tsv", dev_path=corpus / "dev.tsv",
              test_path=corpus / "test.tsv", vocab_size=8000, vocab_sample_sentences=50_000,
              batch_tokens=2048, max_len=64)
  train = dict(num_steps=steps, log_every=1, eval_every=0, bleu_every=0, test_bleu=False,
               checkpoint_every_steps=0, checkpoint_every_minutes=0, tensorboard=False, progress=False)
  return ([sys.executable, "-m", "train", "--config", "experiments/default.py:smoke", "--workdir", str(workdir)]
          + [f"--config.data.{k}={v}" for k, v in data.items()]
          + [f"--config.train.{k}={v}" for k, v in train.items()])


def timed_run(command, workdir: pathlib.Path, cache: pathlib.Path, log: pathlib.Path) -> dict:
  """Runs command; returns the seconds from its start to its first step (metrics.jsonl's step 1) and to
  its end, its peak resident memory in MiB (the kernel's count for the process, from wait4), and the
  peaks of its anonymous and file-backed parts (sampled every 50 ms)."""
  env = dict(os.environ, AIAYN_DATA_CACHE=str(cache))
  metrics, first, peaks = workdir / "metrics.jsonl", None, {}
  start = time.monotonic()
  with open(log, "w") as out:
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    while True:
      pid, status, usage = os.wait4(process.pid, os.WNOHANG)   # reaped here, for its rusage
      if pid:
        break
      if first is None and metrics.exists() and '"step": 1,' in metrics.read_text():
        first = time.monotonic() - start
      for key, mib in _resident(process.pid).items():   # sampled: the kernel keeps only the total's peak
        peaks[key] = max(peaks.get(key, 0.0), mib)
      time.sleep(0.05)
  process.returncode = os.waitstatus_to_exitcode(status)
  if process.returncode:
    raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}); see {log}")
  if first is None:
    raise RuntimeError(f"no first step in {metrics}; see {log}")
  return {"first_step_s": first, "total_s": time.monotonic() - start, "peak_rss_mib": usage.ru_maxrss / 1024,
          **{f"peak_{key.lower()}_mib": mib for key, mib in peaks.items()}}


def _resident(pid: int) -> dict:
  """{'RssAnon': MiB, 'RssFile': MiB} of a running process: its own memory, and the pages of files it
  has mapped (the cache's, which the page cache holds once for every process of the host)."""
  try:
    lines = pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
  except OSError:
    return {}
  return {line.split(":")[0]: int(line.split()[1]) / 1024 for line in lines
          if line.startswith(("RssAnon:", "RssFile:"))}


def assembly(corpus: pathlib.Path, workdir: pathlib.Path, cache: pathlib.Path, batches: int) -> dict:
  """Source + target tokens/s one process assembles from the warm cache: alone, and as each of two
  processes (its own rows only), for the run's packed 2,048-token batches and the paper's bucketed
  25,000-token ones; `batches` batches a round, each process's best of 3 rounds."""
  os.environ["AIAYN_DATA_CACHE"] = str(cache)
  config = experiments.load_experiment("experiments/default.py:smoke")
  experiments.apply_overrides(config, [a.removeprefix("--config.") for a in train_command(corpus, workdir, 1)
                                       if a.startswith("--config.data.")])
  from data import make_train_iterator
  from run import get_vocab
  vocab, out = get_vocab(config.data, workdir), {}
  for name, pack, batch_tokens in (("packed_2048", True, 2048), ("bucketed_25000", False, 25_000)):
    config.data.update(pack=pack, batch_tokens=batch_tokens)
    for count in (1, 2):
      # Each process's best of 3 rounds (the machine may be shared), then the slower process.
      rates = [max(_assembly_rate(make_train_iterator(config.data, vocab, seed=0, row_multiple=8,
                                                      process_index=p, process_count=count), batches)[0]
                   for _ in range(3)) for p in range(count)]
      out[f"{name}_{count}p"] = min(rates)
  return out


def scale(args) -> None:
  from data import synthetic
  sizes = [int(n) for n in args.pairs.split(",")]
  root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="aiayn_input_scale_"))
  base = None if args.reuse else synthetic.generate(0, {"train": min(200_000, max(sizes))})
  results = []
  for pairs in sizes:
    folder = root / str(pairs)
    corpus, cache = folder / "corpus", folder / "cache"
    reuse = args.reuse and (corpus / "train.tsv").exists()   # --reuse: only the warm run, on what is there
    if not reuse:
      shutil.rmtree(folder, ignore_errors=True)
    _, seconds = _time(lambda: None if reuse else write_corpus(corpus, pairs, base))
    row = {"pairs": pairs, "corpus_mib": (corpus / "train.tsv").stat().st_size / 2 ** 20,
           "write_corpus_s": seconds}
    for run in ("warm",) if reuse else ("cold", "warm"):   # cold: nothing cached; warm: a new run directory
      workdir = folder / f"run_{run}"
      shutil.rmtree(workdir, ignore_errors=True)
      row[run] = timed_run(train_command(corpus, workdir, args.steps), workdir, cache, folder / f"{run}.log")
      print(f"{pairs:,} pairs, {run}: {row[run]}", flush=True)
    row["cache_mib"] = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) / 2 ** 20
    row["assembly"] = assembly(corpus, folder / "run_warm", cache, args.batches)
    print(f"{pairs:,} pairs, assembly (src+tgt tokens/s per process): {row['assembly']}", flush=True)
    results.append(row)
    if not args.keep:
      shutil.rmtree(folder, ignore_errors=True)
  table = markdown(results, args.steps)
  print(table)
  _write(args.out if args.out != str(OUT) else SCALE_OUT,
         {"command": "python -m benchmarks.input_pipeline " + " ".join(sys.argv[1:]), "steps": args.steps,
          "sizes": results, "table": table})


def markdown(results, steps: int) -> str:
  """The table docs/data_at_scale.md shows."""
  mib = lambda run, key: f"{run[key]:,.0f}" if run and key in run else "-"
  sec = lambda run: f"{run['first_step_s']:.1f}" if run else "-"
  rate = lambda x: f"{x / 1e6:.1f}M"
  head = ("| pairs | TSV MiB | cache MiB | cold start s | warm start s | peak RSS cold MiB | peak RSS warm MiB "
          "| of which anonymous / file pages | packed 2,048: 1 process | 2 processes, each "
          "| bucketed 25,000: 1 process | 2 processes, each |")
  lines = [head, "|" + "---|" * 12]
  for r in results:
    a, cold, warm = r["assembly"], r.get("cold"), r["warm"]
    lines.append(f"| {r['pairs']:,} | {r['corpus_mib']:,.0f} | {r['cache_mib']:,.0f} | {sec(cold)} | {sec(warm)} "
                 f"| {mib(cold, 'peak_rss_mib')} | {mib(warm, 'peak_rss_mib')} "
                 f"| {mib(warm, 'peak_rssanon_mib')} / {mib(warm, 'peak_rssfile_mib')} "
                 f"| {rate(a['packed_2048_1p'])} | {rate(a['packed_2048_2p'])} "
                 f"| {rate(a['bucketed_25000_1p'])} | {rate(a['bucketed_25000_2p'])} |")
  return "\n".join(lines)


def formats(args) -> None:
  """Reading the pairs of a batch: ArrayRecord, one record per pair read by index (as Grain's and TFDS's
  data sources read), against data/tokens.py's flat arrays (the cache's layout), side by side."""
  from array_record.python import array_record_module
  from array_record.python.array_record_data_source import ArrayRecordDataSource
  from data.tokens import TokenPairs
  rng, n = np.random.default_rng(0), 200_000
  src = [rng.integers(4, 8000, rng.integers(5, 40)).astype(np.uint16) for _ in range(n)]
  tgt = [rng.integers(4, 8000, rng.integers(5, 40)).astype(np.uint16) for _ in range(n)]
  with tempfile.TemporaryDirectory() as scratch:
    path = str(pathlib.Path(scratch) / "pairs.array_record")
    writer = array_record_module.ArrayRecordWriter(path, "group_size:1")   # random access: 1 per chunk
    for s, t in zip(src, tgt):
      writer.write(np.concatenate([[len(s)], s, t]).astype(np.uint16).tobytes())
    writer.close()
    source, pairs = ArrayRecordDataSource([path]), TokenPairs.from_ids(src, tgt)
    readers = {"array_record": lambda i: [np.frombuffer(r, np.uint16) for r in source.__getitems__(i.tolist())],
               "flat arrays": lambda i: (pairs.src.gather(i), pairs.tgt.gather(i))}
    reads = []
    for per_batch, about in ((80, 2048), (1000, 25000)):   # tokens a side, at 22.5 tokens a sentence
      batches = [rng.integers(0, n, per_batch) for _ in range(args.batches)]
      tokens = sum(int(pairs.src.lengths[i].sum()) + int(pairs.tgt.lengths[i].sum()) for i in batches)
      rates = {}
      for name, read in readers.items():
        _, seconds = _time(lambda: [read(i) for i in batches])
        rates[name.replace(" ", "_")] = tokens / seconds
        print(f"{per_batch} pairs a batch, {name}: {tokens / seconds / 1e6:.1f}M source + target tokens/s read")
      reads.append({"pairs_a_batch": per_batch, "about_tokens_a_side": about, "tokens": tokens,
                    "tokens_per_s": rates})
  _write(args.out if args.out != str(OUT) else FORMATS_OUT,
         {"command": "python -m benchmarks.input_pipeline " + " ".join(sys.argv[1:]), "pairs": n,
          "batches": args.batches, "reads": reads})


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.input_pipeline",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="experiments/default.py")
  parser.add_argument("--batches", type=int, default=500, help="batches assembled per mode")
  parser.add_argument("--pairs", default="", help="comma-separated corpus sizes: the memory and start-up "
                      "of `python -m train` at each (e.g. 200000,2000000,8000000)")
  parser.add_argument("--steps", type=int, default=20, help="--pairs: training steps per run")
  parser.add_argument("--dir", default="", help="--pairs: where corpora, caches and runs go (default: a "
                      "new temporary folder)")
  parser.add_argument("--keep", action="store_true", help="--pairs: keep each size's files")
  parser.add_argument("--reuse", action="store_true", help="--pairs: where --dir has a size's corpus and "
                      "cache (from --keep), measure only the warm run and the assembly")
  parser.add_argument("--formats", action="store_true", help="reading a batch's pairs from ArrayRecord "
                      "against the cache's flat arrays")
  parser.add_argument("--out", default=str(OUT))
  args, overrides = parser.parse_known_args(argv)
  log_to_console()   # data/'s lines ([data] tokenized ...), as python -m train shows them
  if args.formats:
    formats(args)
  elif args.pairs:
    scale(args)
  else:
    stages(args, overrides)


if __name__ == "__main__":
  main()
