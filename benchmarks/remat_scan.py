"""What compute.remat and compute.scan_layers buy, measured on this machine's backend (issue 40).

    python -m benchmarks.remat_scan [--part memory,time,scan,mfu] [--note TEXT] [--smoke]

- memory: Transformer-big's train step at 25,000 target tokens per batch (100 rows of 250), float32,
  the accelerator path (kernels="reference", full logits): temp bytes of the compiled step's
  memory_analysis() for remat none, minimal and full, unrolled and scanned; compiled, never run.
- time: the base model's step time for each remat setting at a batch this CPU runs in seconds (4 rows of
  128), all compiled first, then timed round-robin so that load from elsewhere hits them alike.
- scan: compile time of a 24-layer model (base widths, 12+12 layers), unrolled against scanned, in turn.
- mfu: the default experiment (`python -m train`) run for a few hundred steps; its metrics.jsonl's MFU.

Prints each number and writes benchmarks/results/accelerators/remat_scan-<platform>.json (not with
--smoke, which shrinks everything for a test). docs/accelerators.md quotes the JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from benchmarks.accelerator import RESULTS, Step
from model import Compute, base, big
from train import flops as flops_lib
from train import step as step_lib

REMATS = ("none", "minimal", "full")
ROOT = pathlib.Path(__file__).resolve().parent.parent


def memory(smoke: bool) -> dict:
  rows, seq_len = (4, 16) if smoke else (100, 250)
  size = dict(d_model=64, d_ff=128, num_heads=4, num_encoder_layers=2, num_decoder_layers=2) if smoke else {}
  out = {"model": "big", "rows": rows, "seq_len": seq_len, "tokens_per_batch": rows * seq_len}
  for scan in (False, True):
    for remat in REMATS:
      cfg = big(vocab_size=37000 if not smoke else 500, max_len=256, **size,
                compute=Compute(kernels="reference", remat=remat, scan_layers=scan))
      analysis = Step(cfg, rows, seq_len, devices=jax.devices()[:1], loss_chunk_tokens=0).memory()
      out[f"{'scanned' if scan else 'unrolled'}/{remat}"] = analysis
      print(f"memory: big, {rows * seq_len} tokens, {'scanned' if scan else 'unrolled'}, remat {remat}: "
            f"temp {analysis['temp'] / 2**30:.2f} GiB", flush=True)
  for layout in ("unrolled", "scanned"):
    none = out[f"{layout}/none"]["temp"]
    out[f"{layout}/ratios"] = {r: out[f"{layout}/{r}"]["temp"] / none for r in REMATS}
    print(f"memory ratios ({layout}): " + ", ".join(f"{r} {v:.2f}x" for r, v in out[f"{layout}/ratios"].items()))
  return out


def step_time(smoke: bool, rounds: int) -> dict:
  rows, seq_len = (2, 16) if smoke else (4, 128)
  size = dict(d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1, num_decoder_layers=1) if smoke else {}
  steps = {}
  for remat in REMATS:
    cfg = base(vocab_size=37000 if not smoke else 500, max_len=256, **size,
               compute=Compute(kernels="reference", remat=remat))
    steps[remat] = Step(cfg, rows, seq_len, devices=jax.devices()[:1], loss_chunk_tokens=0)
  runners = {}
  for remat, step in steps.items():   # compile and run once each before any timing
    state, _ = step_lib.create_state(step.model, step.tx, step.mesh, jax.random.key(0))
    batch = step_lib.place_batch(step.batch, step.mesh)
    compiled = step.compile()
    state, metrics = compiled(state, batch, jax.random.key(1))
    jax.block_until_ready(metrics)
    runners[remat] = [compiled, state, batch]
  seconds = {r: [] for r in REMATS}
  for i in range(rounds):
    order = REMATS[i % 3:] + REMATS[:i % 3]   # the first of a round rotates
    for remat in order:
      compiled, state, batch = runners[remat]
      start = time.perf_counter()
      state, metrics = compiled(state, batch, jax.random.key(1))
      jax.block_until_ready(metrics)
      seconds[remat].append(time.perf_counter() - start)
      runners[remat][1] = state
  out = {"model": "base", "rows": rows, "seq_len": seq_len, "rounds": rounds, "seconds": seconds,
         "median_s": {r: float(np.median(s)) for r, s in seconds.items()}}
  # Ratios within each round, then their median: load that changes between rounds cancels.
  out["ratios"] = {r: float(np.median([a / b for a, b in zip(seconds[r], seconds["none"])])) for r in REMATS}
  out["ratio_range"] = {r: [float(min(a / b for a, b in zip(seconds[r], seconds["none"]))),
                            float(max(a / b for a, b in zip(seconds[r], seconds["none"])))] for r in REMATS}
  for r in REMATS:
    print(f"time: base, {rows * seq_len} tokens, remat {r}: median {out['median_s'][r]:.2f} s, "
          f"{out['ratios'][r]:.2f}x none ({out['ratio_range'][r][0]:.2f}-{out['ratio_range'][r][1]:.2f})",
          flush=True)
  return out


def scan_compile(smoke: bool, rounds: int) -> dict:
  layers = 2 if smoke else 12
  size = dict(d_model=32, d_ff=64, num_heads=4) if smoke else {}
  seconds = {"unrolled": [], "scanned": []}
  for i in range(rounds):
    for layout in (("unrolled", "scanned") if i % 2 == 0 else ("scanned", "unrolled")):
      cfg = base(vocab_size=37000 if not smoke else 500, max_len=256, num_encoder_layers=layers,
                 num_decoder_layers=layers, **size,
                 compute=Compute(kernels="reference", scan_layers=layout == "scanned"))
      step = Step(cfg, 8, 64, devices=jax.devices()[:1], loss_chunk_tokens=0)
      step.compile()
      seconds[layout].append(step.compile_s)
      print(f"scan: {2 * layers}-layer model, {layout}: compiled in {step.compile_s:.1f} s", flush=True)
  ratios = [s / u for s, u in zip(seconds["scanned"], seconds["unrolled"])]
  out = {"layers": 2 * layers, "rounds": rounds, "compile_s": seconds, "ratio": float(np.median(ratios)),
         "ratio_range": [float(min(ratios)), float(max(ratios))]}
  print(f"scan: scanned / unrolled compile time {out['ratio']:.2f}x", flush=True)
  return out


def default_mfu(smoke: bool) -> dict:
  steps = 4 if smoke else 300
  with tempfile.TemporaryDirectory() as workdir:
    command = [sys.executable, "-m", "train", "--workdir", workdir, f"--config.train.num_steps={steps}",
               f"--config.train.log_every={steps // 2}", "--config.train.test_bleu=False",
               f"--config.train.eval_every={steps}", "--config.train.progress=False",
               "--config.train.tensorboard=False"]
    if smoke:
      command.insert(3, "--config=experiments/default.py:smoke")
    subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   stdout=subprocess.DEVNULL)
    lines = [json.loads(line) for line in open(pathlib.Path(workdir) / "metrics.jsonl")]
  last = [line for line in lines if "train/mfu" in line][-1]   # the second window: no compile in it
  peak = flops_lib.measured_peak("float32") if jax.devices()[0].platform == "cpu" else None
  out = {"steps": steps, "window": f"steps {steps // 2 + 1}-{steps}", "mfu": last["train/mfu"],
         "tokens_per_sec": last["train/tokens_per_sec"], "model_flops_per_step": last["train/model_flops_per_step"],
         "model_flops_per_sec": last["train/model_flops_per_sec"], "peak_flops": peak,
         "fresh_probe_flops": flops_lib.probe_peak("float32")}
  print(f"mfu: default experiment, {out['window']}: MFU {out['mfu']:.1%}, {out['tokens_per_sec']:,.0f} "
        f"tokens/s, {out['model_flops_per_sec'] / 1e9:.1f} GFLOP/s of a cached peak "
        f"{(peak or 0) / 1e9:.1f} GFLOP/s (a fresh probe now: {out['fresh_probe_flops'] / 1e9:.1f})", flush=True)
  return out


def render(result: dict) -> str:
  """The markdown table docs/accelerators.md quotes, from a results file of this benchmark."""
  gib = lambda b: f"{b / 2**30:.2f} GiB"
  rows = []
  memory, timing, scan, mfu = (result.get(k) for k in ("memory", "time", "scan", "mfu"))
  if memory:
    for layout in ("unrolled", "scanned"):
      cells = [f"{r} {gib(memory[f'{layout}/{r}']['temp'])} ({memory[f'{layout}/ratios'][r]:.2f}x)" for r in REMATS]
      rows.append([f"remat memory: big, {memory['tokens_per_batch']:,} tokens, {layout}, compiled temp",
                   ", ".join(cells), "full <= 0.5x none", memory["date"]])
  if timing:
    cells = [f"{r} {timing['median_s'][r]:.2f} s ({timing['ratios'][r]:.2f}x, {timing['ratio_range'][r][0]:.2f}-"
             f"{timing['ratio_range'][r][1]:.2f})" for r in REMATS]
    rows.append([f"remat time: base, {timing['rows'] * timing['seq_len']} tokens, {timing['rounds']} rounds",
                 ", ".join(cells), "full <= 1.4x none", timing["date"]])
  if scan:
    rows.append([f"scan: compile time, {scan['layers']}-layer model (base widths)",
                 f"unrolled {np.median(scan['compile_s']['unrolled']):.1f} s, scanned "
                 f"{np.median(scan['compile_s']['scanned']):.1f} s ({scan['ratio']:.2f}x, "
                 f"{scan['ratio_range'][0]:.2f}-{scan['ratio_range'][1]:.2f})", "scanned <= 0.35x", scan["date"]])
  if mfu:
    rows.append([f"MFU: default experiment ({mfu['window']})",
                 f"{mfu['mfu']:.1%} as logged: {mfu['model_flops_per_sec'] / 1e9:.1f} GFLOP/s of a cached peak "
                 f"{mfu['peak_flops'] / 1e9:.1f}; {mfu['model_flops_per_sec'] / mfu['fresh_probe_flops']:.1%} of a "
                 f"probe after the run ({mfu['fresh_probe_flops'] / 1e9:.1f}); {mfu['tokens_per_sec']:,.0f} "
                 f"tokens/s", "printed", mfu["date"]])
  lines = ["| measurement | result | target | date |", "|---|---|---|---|"]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python -m benchmarks.remat_scan", description=__doc__.split("\n")[0])
  p.add_argument("--part", default="memory,time,scan,mfu", help="comma-separated: memory,time,scan,mfu")
  p.add_argument("--rounds", type=int, default=5, help="timed rounds of the remat step times")
  p.add_argument("--scan_rounds", type=int, default=2, help="compiles of each layout")
  p.add_argument("--note", default="", help="recorded with the results (e.g. the machine's load)")
  p.add_argument("--smoke", action="store_true", help="tiny sizes, nothing written (for the tests)")
  args = p.parse_args(argv)
  parts = args.part.split(",")
  now = lambda: datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  result = {"benchmark": "remat_scan", "backend": jax.devices()[0].platform,
            "device_kind": jax.devices()[0].device_kind, "cpus": os.cpu_count(), "jax": jax.__version__,
            "date": now(), "note": args.note}
  run = {"memory": lambda: memory(args.smoke),
         "time": lambda: step_time(args.smoke, args.rounds if not args.smoke else 2),
         "scan": lambda: scan_compile(args.smoke, args.scan_rounds if not args.smoke else 1),
         "mfu": lambda: default_mfu(args.smoke)}
  for part in parts:
    result[part] = {**run[part](), "date": now(), "note": args.note}
  if args.smoke:
    return result
  out = RESULTS / f"remat_scan-{result['backend']}.json"
  if out.exists():   # parts run separately add up in one file
    result = {**json.loads(out.read_text()), **result}
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + "\n")
  print(f"wrote {out}\n\n{render(result)}")
  return result


if __name__ == "__main__":
  main()
