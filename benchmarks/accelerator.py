"""The first command to run on a GPU or TPU: what this machine gives the Transformer's training step.

    python -m benchmarks.accelerator [--steps 5] [--seq_len 256] [--tokens_per_device 8192] [--note TEXT]

On whatever backend JAX finds, it reports: the devices; the attention implementation model.attention_impl
chooses there; for the paper's base and big models in bfloat16, a few timed training steps (after one
that compiles): step time, tokens/s and MFU (train/flops.py); the peak device memory; and the largest
tokens-per-device batch whose compiled step fits the device's memory, with remat none and full. The
search compiles only (memory_analysis), so it cannot run out of memory. On a CPU the models and batches
are small ("base" and "big" shrunk, CPU_SIZES) so that it ends in a few minutes. Writes
benchmarks/results/accelerators/check-<platform>.json (docs/accelerators.md, "The check command").
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import time

import jax
import numpy as np
import optax

from model import Transformer, TransformerConfig, base, big
from run.mesh import make_mesh
from train import flops as flops_lib
from train import step as step_lib

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "accelerators"
VOCAB = 32768
# On a CPU: the two models at an eighth of the width and 2+2 layers, 1k tokens per step.
CPU_SIZES = {"base": dict(d_model=64, d_ff=256, num_heads=8, num_encoder_layers=2, num_decoder_layers=2),
             "big": dict(d_model=128, d_ff=512, num_heads=16, num_encoder_layers=2, num_decoder_layers=2)}
AUTO_ATTENTION = {"gpu": "cudnn", "tpu": "splash", "cpu": "xla"}   # model/fused_attention.py's `auto`


def model_config(name: str, platform: str, **overrides) -> TransformerConfig:
  """The paper's `name` ('base' or 'big') in bfloat16, shrunk on a CPU."""
  sizes = CPU_SIZES[name] if platform == "cpu" else {}
  return {"base": base, "big": big}[name](**{"vocab_size": VOCAB if platform != "cpu" else 8000,
                                            "dtype": "bfloat16", "max_len": 512, **sizes, **overrides})


def attention_impl(platform: str) -> str:
  """What model.attention_impl picks on `platform` ('xla' where the config has no such switch)."""
  chosen = getattr(TransformerConfig(), "attention_impl", None)
  if chosen is None:
    return "xla"
  return f"{AUTO_ATTENTION.get(platform, 'xla')} (auto)" if chosen == "auto" else chosen


def fake_batch(rows: int, seq_len: int, seed: int = 0) -> dict:
  """Packed-looking int32 [rows, seq_len] arrays: random pieces, one segment per row."""
  ids = np.random.default_rng(seed).integers(4, 1000, (rows, seq_len)).astype(np.int32)
  ones, positions = np.ones_like(ids), np.broadcast_to(np.arange(seq_len, dtype=np.int32), ids.shape)
  return {"src": ids, "src_segments": ones, "src_positions": positions, "tgt_in": ids, "tgt_out": ids,
          "tgt_segments": ones, "tgt_positions": positions}


class Step:
  """One model's jitted train step on the mesh of `devices`, with its state and compiled program."""

  def __init__(self, cfg: TransformerConfig, rows: int, seq_len: int, devices=None, loss_chunk_tokens=None):
    self.cfg, self.rows, self.seq_len = cfg, rows, seq_len
    self.mesh = make_mesh(devices)
    self.model, self.tx = Transformer(cfg), optax.adam(1e-4)
    self.abstract, self.shardings = step_lib.abstract_state(self.model, self.tx, self.mesh)
    chunk = step_lib.DEFAULT_LOSS_CHUNK if loss_chunk_tokens is None else loss_chunk_tokens
    self.fn = step_lib.jit_train_step(self.model, self.tx, lambda s: 1e-4, self.mesh, self.shardings,
                                      label_smoothing=0.1, loss_chunk_tokens=chunk)
    self.batch = fake_batch(rows, seq_len)
    self.compiled, self.compile_s = None, None

  def compile(self):
    """Lowers and compiles without running (once): the compiled step."""
    if self.compiled is None:
      sharding = step_lib.batch_sharding(self.mesh)
      batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in self.batch.items()}
      start = time.perf_counter()
      self.compiled = self.fn.lower(self.abstract, batch, jax.random.key(0)).compile()
      self.compile_s = time.perf_counter() - start
    return self.compiled

  def memory(self) -> dict:
    """The compiled step's memory_analysis in bytes: temp, arguments, outputs, and their footprint."""
    analysis = self.compile().memory_analysis()
    out = {k: int(getattr(analysis, f"{k}_size_in_bytes")) for k in ("temp", "argument", "output", "alias")}
    out["footprint"] = out["temp"] + out["argument"] + out["output"] - out["alias"]
    return out

  def time(self, steps: int) -> dict:
    """Runs one untimed step then `steps` timed ones: median step seconds, tokens/s, MFU."""
    state, _ = step_lib.create_state(self.model, self.tx, self.mesh, jax.random.key(0))
    batch = step_lib.place_batch(self.batch, self.mesh)
    step = self.compile()
    state, metrics = step(state, batch, jax.random.key(1))
    jax.block_until_ready(metrics)
    seconds = []
    for _ in range(steps):
      start = time.perf_counter()
      state, metrics = step(state, batch, jax.random.key(1))
      jax.block_until_ready(metrics)
      seconds.append(time.perf_counter() - start)
    step_s = float(np.median(seconds))
    model_flops = flops_lib.train_step_flops(self.cfg, self.rows, self.seq_len, self.seq_len)
    peak, source = flops_lib.peak_flops(self.mesh.devices.flat, self.cfg)
    return {"compile_s": self.compile_s, "step_s": step_s, "step_s_all": seconds, "tokens_per_s": self.rows * self.seq_len / step_s,
            "model_flops_per_step": model_flops, "mfu": model_flops / step_s / peak if peak else None,
            "peak_flops": peak, "peak_source": source}


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


def run(steps: int, seq_len: int, tokens_per_device: int, search_model: str, cpu_budget: int,
        save=lambda result: None) -> dict:
  """The check; calls save(result) after each model and each search, so a run cut short keeps its parts."""
  devices = jax.devices()
  platform = devices[0].platform
  n = len(devices)
  if platform == "cpu":
    seq_len, tokens_per_device = min(seq_len, 128), min(tokens_per_device, 1024)
  rows = n * max(tokens_per_device // seq_len, 1)
  result = {"benchmark": "accelerator", "date": datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M UTC"),
            "backend": platform, "jax": jax.__version__,
            "devices": {"count": n, "kind": devices[0].device_kind,
                        "memory_limit_bytes": device_memory_limit(devices[0])},
            "attention_impl": attention_impl(platform), "seq_len": seq_len, "rows": rows,
            "tokens_per_step": rows * seq_len, "models": {}}
  print(f"devices: {n} x {devices[0].device_kind} ({platform}, jax {jax.__version__})")
  print(f"attention: {result['attention_impl']}")
  for name in ("base", "big"):
    cfg = model_config(name, platform)
    step = Step(cfg, rows, seq_len)
    timing = step.time(steps)
    timing["compiled_memory"] = step.memory()
    timing["peak_device_memory_bytes"] = peak_memory(devices[0])
    timing["size"] = {k: getattr(cfg, k) for k in ("d_model", "d_ff", "num_heads", "num_encoder_layers",
                                                     "num_decoder_layers", "vocab_size", "dtype")}
    result["models"][name] = timing
    save(result)
    mfu = f"{timing['mfu']:.1%}" if timing["mfu"] is not None else "? (no peak for this device)"
    peak_mem = timing["peak_device_memory_bytes"]
    print(f"{name}: step {timing['step_s'] * 1e3:.1f} ms, {timing['tokens_per_s']:,.0f} tokens/s, MFU {mfu} "
          f"of {timing['peak_flops'] / 1e12:.3g} TFLOP/s ({timing['peak_source']}); peak memory "
          f"{peak_mem / 2**30 if peak_mem else timing['compiled_memory']['footprint'] / 2**30:.2f} GiB"
          f"{'' if peak_mem else ' (compiled footprint: this backend keeps no device statistics)'}")
  limit = device_memory_limit(devices[0])
  budget = int(0.9 * limit) if limit else cpu_budget
  # Scanned layers in the search: there the recomputation stays in the backward loop on every backend
  # (XLA:CPU schedules an unrolled stack's recomputation early, so that it saves nothing there).
  result["largest_batch"] = {"model": search_model, "budget_bytes": budget, "seq_len": seq_len,
                             "scan_layers": True}
  for remat in ("none", "full"):
    print(f"largest batch search ({search_model}, scanned, remat {remat}): from {tokens_per_device} tokens per "
          "device, doubling", flush=True)
    cfg = model_config(search_model, platform, remat=remat, scan_layers=True)
    found = largest_batch(cfg, seq_len, budget, start_tokens=tokens_per_device,
                          max_tokens=seq_len * (2 ** 14 if platform != "cpu" else 2 ** 6), devices=devices)
    result["largest_batch"][remat] = found
    save(result)
    print(f"largest batch that fits ({search_model}, scanned, remat {remat}, {budget / 2**30:.2f} GiB"
          f"{'' if limit else ' CPU budget'}): {found['tokens_per_device']} tokens per device")
  return result


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.accelerator", description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=5, help="timed steps per model after the compiling one")
  p.add_argument("--seq_len", type=int, default=256, help="positions per row, source and target (CPU: 128)")
  p.add_argument("--tokens_per_device", type=int, default=8192, help="target tokens per device (CPU: 1024)")
  p.add_argument("--search_model", choices=("base", "big"), default="big", help="model of the batch search")
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

  result = run(args.steps, args.seq_len, args.tokens_per_device, args.search_model,
               int(args.cpu_budget_gb * 2**30), save=save)
  save(result, complete=True)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
