"""CTranslate2 on the exported model as a benchmark system (decoding only).

    python -m benchmarks.systems.ct2 SPEC_JSON        (started by benchmarks/harness.py; see worker.py)

spec: dir (benchmarks/files.py), tasks (greedy, beam), threads (intra_threads), compute_type
("float32", or "int8_float32": weights quantized to int8 when loaded, the rest in float32), decode (len,
beam_size, alpha). The model is our random init exported by export/ (prepare.py).
"""
from __future__ import annotations

import os
import pathlib

import ctranslate2

from benchmarks import files, worker


def search(spec: dict, translator, tokens, beam_size: int):
  n = spec["decode"]["len"]

  def run():
    out = translator.translate_batch(tokens, beam_size=beam_size, length_penalty=spec["decode"]["alpha"],
                                     min_decoding_length=n, max_decoding_length=n, max_batch_size=0)
    if len(out[0].hypotheses[0]) != n:
      raise RuntimeError(f"CTranslate2 returned {len(out[0].hypotheses[0])} tokens, expected {n}")
  return run, {"first_run_s": worker.first_run(run)}


def setup(spec: dict):
  translator = ctranslate2.Translator(str(pathlib.Path(spec["dir"]) / files.CT2), device="cpu",
                                      compute_type=spec["compute_type"], intra_threads=spec["threads"],
                                      inter_threads=1)
  src = files.decode_src(spec["dir"])
  vocab = files.pieces(spec["model"]["vocab_size"])
  tokens = [[vocab[i] for i in row] for row in src]
  tasks, info = {}, {"compute_type": translator.compute_type, "threads": spec["threads"],
                     "isa": os.environ.get("CT2_FORCE_CPU_ISA", "native"),
                     "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "native")}
  for task in spec["tasks"]:
    tasks[task], info[task] = search(spec, translator, tokens, worker.beam_size(spec, task))
  return tasks, info


if __name__ == "__main__":
  worker.serve(setup)
