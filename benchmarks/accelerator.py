"""The first command to run on a GPU or TPU: what this machine gives the Transformer's training step.

    python -m benchmarks.accelerator [--steps 10] [--seq_len 256] [--sweep base:8,16,32,64 big:8,16,32]
                                     [--variants] [--search] [--profile DIR] [--note TEXT]

On whatever backend JAX finds, for the paper's base and big models in bfloat16 (shrunk on a CPU,
CPU_SIZES), it reports:
  - the sweep: each model at several thousands of target tokens per device (one sentence a row, as the
    WMT experiments batch them), each timed over --steps steps dispatched back to back and waited for
    once at the end, as training runs: step time, tokens/s and MFU (train/flops.py);
  - the fixed cost: a straight line through each model's (tokens, step time) points; its intercept is
    the time a step takes whatever its size (launches, small kernels, the optimizer);
  - --variants: the base model at the sweep's middle point with one setting changed each (a packed
    batch's dense attention mask, the rbg dropout RNG, scanned layers, a smaller loss chunk), with the
    number of kernels of each compiled program (the instructions of its entry computation);
  - --search: the largest tokens-per-device batch of the big model whose compiled step fits the device's
    memory, remat none and full (compiles only, so it cannot run out of memory);
  - --profile DIR: a jax.profiler trace of the base model's timed steps at the sweep's middle point.
Writes benchmarks/results/accelerators/check-<platform>.json after every measurement, whole or not at
all, so a check stopped at its time limit keeps what it measured (docs/accelerators.md).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import re
import time

import jax
import numpy as np
import optax

from model import Compute, Transformer, TransformerConfig, base, big
from run.mesh import make_mesh
from train import flops as flops_lib
from train import step as step_lib

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "accelerators"
VOCAB = 32768
# On a CPU: the two models at an eighth of the width and 2+2 layers, 1k tokens per step.
CPU_SIZES = {"base": dict(d_model=64, d_ff=256, num_heads=8, num_encoder_layers=2, num_decoder_layers=2),
             "big": dict(d_model=128, d_ff=512, num_heads=16, num_encoder_layers=2, num_decoder_layers=2)}
AUTO_ATTENTION = {"gpu": "cudnn", "tpu": "splash", "cpu": "xla"}   # kernels/fused_attention.py's `auto`
LOSS_CHUNK = 8192   # tokens per chunk and device of the loss: the WMT experiments' setting
SWEEP = {"base": (8, 16, 32, 64), "big": (8, 16, 32)}   # thousands of target tokens per device
CPU_SWEEP = {"base": (1, 2), "big": (1, 2)}


def model_config(name: str, platform: str, **compute) -> TransformerConfig:
  """The paper's `name` ('base' or 'big') in bfloat16, shrunk on a CPU; `compute`: Compute fields."""
  sizes = CPU_SIZES[name] if platform == "cpu" else {}
  return {"base": base, "big": big}[name](vocab_size=VOCAB if platform != "cpu" else 8000, max_len=512, **sizes,
                                          compute=Compute(**{"dtype": "bfloat16", **compute}))


def attention_impl(platform: str) -> str:
  """What compute.attention_impl picks on `platform` by default."""
  chosen = Compute().attention_impl
  return f"{AUTO_ATTENTION.get(platform, 'xla')} (auto)" if chosen == "auto" else chosen


def fake_batch(rows: int, seq_len: int, seed: int = 0) -> dict:
  """int32 [rows, seq_len] arrays: random pieces, one sentence filling each row."""
  ids = np.random.default_rng(seed).integers(4, 1000, (rows, seq_len)).astype(np.int32)
  ones, positions = np.ones_like(ids), np.broadcast_to(np.arange(seq_len, dtype=np.int32), ids.shape)
  return {"src": ids, "src_segments": ones, "src_positions": positions, "tgt_in": ids, "tgt_out": ids,
          "tgt_segments": ones, "tgt_positions": positions}


class Step:
  """One model's jitted train step on the mesh of `devices`, with its state and compiled program.

  packed: the model's promise about rows (Transformer.packed; False: one sentence a row, which a fused
  attention takes as lengths); rng_impl: the dropout key's PRNG implementation; loss_chunk_tokens: tokens
  per chunk and device of the chunked loss (the WMT experiments' 8192 by default)."""

  def __init__(self, cfg: TransformerConfig, rows: int, seq_len: int, devices=None, loss_chunk_tokens=None,
               packed: bool = False, rng_impl: str = "threefry2x32"):
    self.cfg, self.rows, self.seq_len, self.rng_impl = cfg, rows, seq_len, rng_impl
    self.mesh = make_mesh(devices)
    self.model, self.tx = Transformer(cfg, packed=packed), optax.adam(1e-4)
    self.abstract, self.shardings = step_lib.abstract_state(self.model, self.tx, self.mesh)
    chunk = LOSS_CHUNK if loss_chunk_tokens is None else loss_chunk_tokens
    self.fn = step_lib.jit_train_step(self.model, self.tx, lambda s: 1e-4, self.mesh, self.shardings,
                                      label_smoothing=0.1, loss_chunk_tokens=chunk)
    self.batch = fake_batch(rows, seq_len)
    self.compiled, self.compile_s = None, None

  def key(self):
    return jax.random.key(1, impl=self.rng_impl)

  def compile(self):
    """Lowers and compiles without running (once): the compiled step."""
    if self.compiled is None:
      sharding = step_lib.batch_sharding(self.mesh)
      batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in self.batch.items()}
      start = time.perf_counter()
      self.compiled = self.fn.lower(self.abstract, batch, self.key()).compile()
      self.compile_s = time.perf_counter() - start
    return self.compiled

  def kernels(self) -> int:
    """Instructions of the compiled program's entry computation: on a GPU about the kernels a step
    launches (fusions, library calls, copies), what scanned layers and fused optimizers reduce."""
    text = self.compile().as_text()
    entry = text[text.index("\nENTRY"):]
    body = entry[:entry.index("\n}")]
    return sum(1 for line in body.splitlines()[1:] if re.match(r"\s+(ROOT )?[%\w.-]+ = ", line))

  def memory(self) -> dict:
    """The compiled step's memory_analysis in bytes: temp, arguments, outputs, and their footprint."""
    analysis = self.compile().memory_analysis()
    out = {k: int(getattr(analysis, f"{k}_size_in_bytes")) for k in ("temp", "argument", "output", "alias")}
    out["footprint"] = out["temp"] + out["argument"] + out["output"] - out["alias"]
    return out

  def time(self, steps: int, profile_dir: str | None = None) -> dict:
    """One untimed step, then `steps` steps dispatched back to back and waited for once (as the trainer
    runs them): mean step seconds, tokens/s, MFU."""
    state, _ = step_lib.create_state(self.model, self.tx, self.mesh, jax.random.key(0))
    batch = step_lib.place_batch(self.batch, self.mesh)
    step, key = self.compile(), self.key()
    state, metrics = step(state, batch, key)
    jax.block_until_ready((state, metrics))
    trace = jax.profiler.trace(profile_dir) if profile_dir else contextlib.nullcontext()
    with trace:
      start = time.perf_counter()
      for _ in range(steps):
        state, metrics = step(state, batch, key)
      jax.block_until_ready((state, metrics))
      step_s = (time.perf_counter() - start) / steps
    tokens = self.rows * self.seq_len
    model_flops = flops_lib.train_step_flops(self.cfg, self.rows, self.seq_len, self.seq_len)
    peak, source = flops_lib.peak_flops(self.mesh.devices.flat, self.cfg)
    return {"compile_s": self.compile_s, "step_s": step_s, "tokens": tokens, "tokens_per_s": tokens / step_s,
            "model_flops_per_step": model_flops, "mfu": model_flops / step_s / peak if peak else None,
            "peak_flops": peak, "peak_source": source, "loss": float(metrics["loss"])}


def device_memory_limit(device) -> int | None:
  stats = device.memory_stats() or {}
  return stats.get("bytes_limit")


def peak_memory(device) -> int | None:
  stats = device.memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def largest_batch(cfg: TransformerConfig, seq_len: int, budget: int, start_tokens: int, max_tokens: int,
                  devices) -> dict:
  """The largest tokens per device (seq_len times a power of two, from start_tokens) whose compiled
  step's footprint fits `budget` bytes; compiles only. -> {'tokens_per_device', 'footprint'}."""
  n = len(devices)
  best = {"tokens_per_device": None, "footprint": None}
  tokens = start_tokens
  while tokens <= max_tokens:
    step = Step(cfg, rows=n * max(tokens // seq_len, 1), seq_len=seq_len, devices=devices)
    memory = step.memory()
    print(f"  {tokens} tokens per device: footprint {memory['footprint'] / 2**30:.2f} GiB "
          f"(compiled in {step.compile_s:.0f} s)", flush=True)
    if memory["footprint"] > budget:
      break
    best = {"tokens_per_device": tokens, "footprint": memory["footprint"]}
    tokens *= 2
  return best


def fit_fixed_cost(points: list) -> dict:
  """Least squares step_s = fixed + per_token * tokens over [(tokens, step_s)] (two points or more)."""
  tokens, seconds = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
  slope, intercept = np.polyfit(tokens, seconds, 1)
  return {"fixed_ms": float(intercept * 1e3), "ms_per_1k_tokens": float(slope * 1e6), "points": len(points)}


def render(result: dict) -> str:
  """The markdown table docs/accelerators.md quotes, from a results file of this check."""
  device = f"{result['devices']['count']} x {result['devices']['kind']}, jax {result['jax']}, {result['date']}"
  rows = ["| measured | step | tokens/s | MFU |", "|---|---|---|---|"]
  cell = lambda t: (f"{t['step_s'] * 1e3:.1f} ms | {t['tokens_per_s']:,.0f} | "
                    + (f"{t['mfu']:.1%}" if t.get("mfu") is not None else "?"))
  for name, points in result.get("sweep", {}).items():
    for k, t in points.items():
      rows.append(f"| {name}, {k} tokens | " + (cell(t) if "step_s" in t else f"failed: {t['error'][:60]} | | ") + " |")
    good = [(t["tokens"], t["step_s"]) for t in points.values() if "step_s" in t]
    if len(good) >= 2:   # the same fit as the check's, also for a check cut short before it
      fit = fit_fixed_cost(good)
      rows.append(f"| {name}: fixed cost (line through {fit['points']} points) | {fit['fixed_ms']:.2f} ms "
                  f"| {fit['ms_per_1k_tokens']:.3f} ms per 1k tokens | |")
  for label, t in result.get("variants", {}).items():
    rows.append(f"| base variant: {label} ({t['kernels']} kernels) | {cell(t)} |")
  return f"{device}; {result['seq_len']} positions a row, one sentence a row, bfloat16:\n\n" + "\n".join(rows)


def _line(name: str, timing: dict) -> str:
  mfu = f"{timing['mfu']:.1%}" if timing["mfu"] is not None else "?"
  return (f"{name}: {timing['tokens']:,} tokens, step {timing['step_s'] * 1e3:.1f} ms, "
          f"{timing['tokens_per_s']:,.0f} tokens/s, MFU {mfu} (compiled in {timing['compile_s']:.0f} s)")


def run(args, save=lambda result: None) -> dict:
  """The check (the module docstring); calls save(result) after each measurement."""
  devices = jax.devices()
  platform, n = devices[0].platform, len(devices)
  seq_len = min(args.seq_len, 128) if platform == "cpu" else args.seq_len
  sweep = CPU_SWEEP if platform == "cpu" else SWEEP
  if args.sweep:
    sweep = {name: tuple(int(k) for k in ks.split(",")) for name, _, ks in
             (item.partition(":") for item in args.sweep)}
  result = {"benchmark": "accelerator", "date": datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M UTC"),
            "backend": platform, "jax": jax.__version__,
            "devices": {"count": n, "kind": devices[0].device_kind,
                        "memory_limit_bytes": device_memory_limit(devices[0])},
            "attention_impl": attention_impl(platform), "seq_len": seq_len, "loss_chunk_tokens": LOSS_CHUNK,
            "sweep": {}, "fixed_cost": {}, "variants": {}}
  print(f"devices: {n} x {devices[0].device_kind} ({platform}, jax {jax.__version__})")
  print(f"attention: {result['attention_impl']}; one sentence a row; steps timed back to back", flush=True)
  rows_for = lambda k: n * max(k * 1000 // seq_len, 1)
  for name, ks in sweep.items():
    cfg = model_config(name, platform)
    points = result["sweep"][name] = {}
    for k in ks:
      try:
        timing = Step(cfg, rows_for(k), seq_len).time(args.steps)
      except Exception as error:   # out of memory at the largest sizes: recorded, the check goes on
        points[f"{k}k"] = {"error": str(error).splitlines()[0][:300]}
        print(f"{name} {k}k: failed: {points[f'{k}k']['error']}", flush=True)
        save(result)
        continue
      points[f"{k}k"] = timing
      print(_line(f"{name} {k}k", timing), flush=True)
      save(result)
    good = [(p["tokens"], p["step_s"]) for p in points.values() if "step_s" in p]
    if len(good) >= 2:
      result["fixed_cost"][name] = fit_fixed_cost(good)
      fit = result["fixed_cost"][name]
      print(f"{name}: fixed cost {fit['fixed_ms']:.2f} ms a step, {fit['ms_per_1k_tokens']:.3f} ms per "
            f"1k tokens", flush=True)
      save(result)
  middle = sorted(sweep.get("base", (8,)))[len(sweep.get("base", (8,))) // 2]
  if args.variants or args.profile:
    cfg = model_config("base", platform)
    variants = {"as_configured": dict(), "dense_mask": dict(packed=True), "rbg": dict(rng_impl="rbg"),
                "scan_layers": dict(cfg=cfg.with_compute(scan_layers=True)),
                "loss_chunk_2048": dict(loss_chunk_tokens=2048)}
    if not args.variants:
      variants = {"as_configured": {}}
    for label, change in variants.items():
      change = dict(change)
      step = Step(change.pop("cfg", cfg), rows_for(middle), seq_len, **change)
      profile = args.profile if (args.profile and label == "as_configured") else None
      timing = step.time(args.steps, profile_dir=profile)
      timing["kernels"] = step.kernels()
      result["variants"][label] = timing
      print(_line(f"base {middle}k {label}", timing) + f", {timing['kernels']} kernels", flush=True)
      save(result)
    if args.profile:
      print(f"profile of base {middle}k: {args.profile}")
  if args.search:
    limit = device_memory_limit(devices[0])
    budget = int(0.9 * limit) if limit else int(args.cpu_budget_gb * 2**30)
    result["largest_batch"] = {"model": "big", "budget_bytes": budget, "seq_len": seq_len, "scan_layers": True}
    for remat in ("none", "full"):
      cfg = model_config("big", platform, remat=remat, scan_layers=True)
      start = 1024 * (1 if platform == "cpu" else 8)
      found = largest_batch(cfg, seq_len, budget, start_tokens=start,
                            max_tokens=seq_len * (2 ** 14 if platform != "cpu" else 2 ** 6), devices=devices)
      result["largest_batch"][remat] = found
      print(f"largest batch (big, scanned, remat {remat}): {found['tokens_per_device']} tokens per device")
      save(result)
  return result


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.accelerator", description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=10, help="timed steps per point, after one untimed step")
  p.add_argument("--seq_len", type=int, default=256, help="positions per row, source and target (CPU: 128)")
  p.add_argument("--sweep", nargs="*", default=None,
                 help="MODEL:K1,K2,... thousands of target tokens per device (default base:8,16,32,64 "
                      "big:8,16,32; CPU: 1,2)")
  p.add_argument("--variants", action="store_true", help="the base model's one-setting variants")
  p.add_argument("--search", action="store_true", help="the largest batch that fits (big, compiles only)")
  p.add_argument("--profile", default=None, help="a jax.profiler trace of base's timed steps, into DIR")
  p.add_argument("--cpu_budget_gb", type=float, default=0.5, help="the 'device memory' of a CPU's search")
  p.add_argument("--note", default="", help="recorded with the results (e.g. the machine's load)")
  p.add_argument("--out", default=None, help="results file (default results/accelerators/check-<platform>.json)")
  args = p.parse_args(argv)
  out = pathlib.Path(args.out) if args.out else RESULTS / f"check-{jax.default_backend()}.json"

  def save(result: dict, complete: bool = False) -> None:
    """Writes what is measured so far; "complete" says whether the check reached its end."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps({**result, "note": args.note, "complete": complete}, indent=1) + "\n")
    partial.replace(out)   # whole or absent, never half-written

  result = run(args, save=save)
  save(result, complete=True)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
