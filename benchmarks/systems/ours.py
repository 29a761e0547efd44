"""Our model as a benchmark system (JAX): the matmul peak, train/step.py's step, decode/translate.py's search.

    python -m benchmarks.systems.ours SPEC_JSON      (started by benchmarks/harness.py; see worker.py)

spec: dir (benchmarks/files.py), tasks (a subset of peak, train, greedy, beam), model (TransformerConfig
fields), matmul_dtype (None, or "bfloat16": bfloat16 matmul operands accumulating in float32),
peak_dtype, train (label_smoothing), decode (len, beam_size, alpha). The harness sets the CPU device
count through XLA_FLAGS: one device for the peak and training (as `python -m train` runs), one device
per core for decoding (as `python -m decode` runs; the sentences are split over the devices).
"""
from __future__ import annotations

import json
import sys

from kernels import host_memory

# A training worker sets malloc up as `python -m train` does, first: before JAX starts a thread
# (kernels/host_memory.py). A decoding worker leaves it, as `python -m decode` does.
if __name__ == "__main__" and "train" in json.loads(sys.argv[1])["tasks"]:
  host_memory.keep_freed_memory()

import os
import pathlib
import time

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import files, worker
from decode import translate
from experiments.default import get_config
from kernels import cpu_decoding
from model import Compute, Transformer, TransformerConfig
from run.mesh import make_mesh
from train import optimizer, schedules
from train import step as step_lib

PEAK_N = 2048


def peak(dtype: str):
  """A large jitted jnp.dot in `dtype`, accumulating in float32: the machine's matmul peak."""
  a = jnp.asarray(np.random.default_rng(0).standard_normal((PEAK_N, PEAK_N)), dtype)
  compiled = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32)).lower(a).compile()
  return (lambda: compiled(a).block_until_ready()), {"flops": 2.0 * PEAK_N ** 3, "dtype": dtype}


def train(spec: dict, cfg: TransformerConfig, params):
  """One optimizer step of train/step.py (Adam and the default experiment's schedule, label smoothing,
  dropout as cfg says) on the shared batch, from the shared parameters, on one device."""
  config = get_config().train
  model = Transformer(cfg)
  schedule = schedules.make_schedule(config, cfg.d_model)
  tx = optimizer.make_optimizer(config, schedule)
  mesh = make_mesh(jax.devices()[:1])
  state, shardings = step_lib.create_state(model, tx, mesh, jax.random.key(0))
  state = state.replace(params=jax.device_put(params, shardings.params))
  step_fn = step_lib.jit_train_step(model, tx, schedule, mesh, shardings,
                                    label_smoothing=spec["train"]["label_smoothing"])
  batch = step_lib.place_batch(files.train_batch(spec["dir"]), mesh)
  key = jax.random.key(1)
  start = time.perf_counter()
  compiled = step_fn.lower(state, batch, key).compile()
  compile_s = time.perf_counter() - start
  holder = {"state": state}

  def run():
    holder["state"], metrics = compiled(holder["state"], batch, key)
    jax.block_until_ready(metrics["loss"])
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return run, {"compile_s": compile_s, "xla_flops": float(cost.get("flops", 0.0)) if cost else None}


def search(spec: dict, cfg: TransformerConfig, params, beam_size: int):
  """decode/translate.py's jitted encode + search (what `python -m decode` runs) on the shared sources,
  split over every local device: greedy (beam_size 1: sampling at temperature 0) or beam search, with
  exactly decode.len tokens per sentence (min_len = max_len)."""
  d = spec["decode"]
  n = d["len"]
  mesh = make_mesh(jax.local_devices())
  src = files.decode_src(spec["dir"])
  if src.shape[0] % mesh.devices.size:
    raise ValueError(f"--decode_batch {src.shape[0]} is not a multiple of the {mesh.devices.size} devices")
  src = jnp.asarray(src)
  limits = jnp.full((src.shape[0],), n, jnp.int32)
  params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  key = jax.random.key(0)
  sampling = (("temperature", 0.0),) if beam_size == 1 else ()
  fn = translate.search_fn(cfg, beam_size, d["alpha"], n, n, sampling, mesh)
  # What depends on the parameters alone (the kernels' panel layout) is computed once, as translate()
  # does for all its batches, not in every timed run.
  weights = jax.block_until_ready(translate.decoding_weights_fn(cfg, mesh)(params))
  start = time.perf_counter()
  compiled = fn.lower(params, src, limits, key, weights).compile()
  compile_s = time.perf_counter() - start
  run = lambda: jax.block_until_ready(compiled(params, src, limits, key, weights))
  return run, {"compile_s": compile_s, "devices": int(mesh.devices.size),
               "search": "greedy (sampling at temperature 0)" if beam_size == 1 else "beam_search"}


def setup(spec: dict):
  tasks, info = {}, {"devices": len(jax.devices()), "code": str(pathlib.Path(__file__).resolve().parents[2]),
                     "xla_flags": os.environ.get("XLA_FLAGS", "")}
  if cpu_decoding.available():   # its vector width: 32 floats a panel with AVX-512, 16 with AVX2
    info["panel_width"] = cpu_decoding.panel_width()
  if "peak" in spec["tasks"]:
    tasks["peak"], info["peak"] = peak(spec["peak_dtype"])
  wanted = [t for t in spec["tasks"] if t != "peak"]
  if wanted:
    compute = Compute(**{**spec["model"].get("compute", {}), "matmul_dtype": spec.get("matmul_dtype")})
    cfg = TransformerConfig(**{**spec["model"], "compute": compute})
    params = flax.serialization.msgpack_restore((pathlib.Path(spec["dir"]) / files.PARAMS).read_bytes())
    for task in wanted:
      if task == "train":
        tasks[task], info[task] = train(spec, cfg, params)
      else:
        tasks[task], info[task] = search(spec, cfg, params, worker.beam_size(spec, task))
  return tasks, info


if __name__ == "__main__":
  worker.serve(setup)
