"""Our decoding with one part taken out, or on fewer cores: the worker of benchmarks/decode_anatomy.py.

    python -m benchmarks.systems.ours_parts SPEC_JSON      (started by benchmarks/harness.py)

spec: as benchmarks/systems/ours.py's, plus
- ablate: None, "self" (no self-attention arithmetic: the keys and values are still written, the heads
  are the queries), "cross" (the same for cross-attention) or "output" (the output layer computes an
  eighth of the vocabulary's logits and repeats them: 8x fewer output-layer FLOPs);
- rows: decode only the first `rows` source sentences (None: all);
- cpus: pin the process to these CPUs (None: all), set before JAX starts its threads.
The ablated runs translate wrongly on purpose: they only say how much time a part takes.
"""
from __future__ import annotations

import json
import os
import sys


def ablate(part: str | None) -> None:
  import jax.numpy as jnp

  from kernels import decode_cache, output_layer
  if part is None:
    return
  if part == "self":
    def attend_self(self, attend, q, k_new, v_new, layer_cache, index, context, mask):
      k, v = self._write(layer_cache, k_new, v_new, index)
      return q, {"k": k, "v": v}
    decode_cache.HeadMajorCache.attend_self = attend_self
    decode_cache.BeamSlotCache.attend_self = attend_self
  elif part == "cross":
    decode_cache.HeadMajorCache.attend_cross = lambda self, attend, q, keys, values, mask: q
  elif part == "output":   # either layout of the table (model/ops.py picks one)
    full = output_layer.logits
    output_layer.logits = lambda y, kernel: jnp.tile(full(y, kernel[:, :kernel.shape[1] // 8]), (1, 8))
    panels = output_layer.panel_logits

    def eighth_of_the_panels(y, kernel, *, vocab):
      some = kernel[:max(1, kernel.shape[0] // 8)]
      logits = panels(y, some, vocab=some.shape[0] * some.shape[2])
      return jnp.tile(logits, (1, -(-vocab // logits.shape[1])))[:, :vocab]
    output_layer.panel_logits = eighth_of_the_panels
  else:
    raise ValueError(f"ablate={part!r}: expected None, 'self', 'cross' or 'output'")


def setup(spec: dict):
  from benchmarks import files
  from benchmarks.systems import ours
  ablate(spec.get("ablate"))
  rows = spec.get("rows")
  if rows:
    full = files.decode_src
    files.decode_src = lambda directory: full(directory)[:rows]
  tasks, info = ours.setup(spec)
  info.update(ablate=spec.get("ablate"), rows=rows, cpus=spec.get("cpus"))
  return tasks, info


def main() -> None:
  cpus = json.loads(sys.argv[1]).get("cpus")
  if cpus is not None:
    os.sched_setaffinity(0, set(cpus))
  from benchmarks import worker
  worker.serve(setup)


if __name__ == "__main__":
  main()
