"""PyTorch on the exported Hugging Face MarianMTModel as a benchmark system: eager or torch.compile.

    python -m benchmarks.systems.torch_hf SPEC_JSON   (started by benchmarks/harness.py; see worker.py)

spec: dir (benchmarks/files.py), tasks (a subset of train, greedy, beam), threads (torch intra-op
threads), autocast (the forward pass under torch.autocast("cpu", torch.bfloat16): PyTorch's mixed
precision), compile (torch.compile: the model for training; for greedy decoding, `generate` with a static
cache, which is how transformers compiles its decoding step), train (label_smoothing), decode (len,
beam_size, alpha). The weights are ours, exported by export/ (prepare.py).
"""
from __future__ import annotations

import contextlib
import pathlib

import torch
from transformers import MarianMTModel
from transformers.generation.configuration_utils import CompileConfig

from benchmarks import files, worker


def _precision(spec):
  return torch.autocast("cpu", dtype=torch.bfloat16) if spec["autocast"] else contextlib.nullcontext()


def _model(spec):
  return MarianMTModel.from_pretrained(pathlib.Path(spec["dir"]) / files.MARIAN)


def train(spec: dict):
  """One Adam step with label smoothing and dropout (as the exported config says) on the shared batch."""
  model = _model(spec).train()
  forward = torch.compile(model) if spec["compile"] else model
  opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
  loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=spec["train"]["label_smoothing"],
                                      ignore_index=files.PAD, reduction="sum")
  batch = files.train_batch(spec["dir"])
  src = torch.from_numpy(batch["src"]).long()
  tgt_in = torch.from_numpy(batch["tgt_in"]).long()
  tgt_out = torch.from_numpy(batch["tgt_out"]).long()
  mask = src != files.PAD

  def run():
    opt.zero_grad(set_to_none=True)
    with _precision(spec):
      logits = forward(input_ids=src, attention_mask=mask, decoder_input_ids=tgt_in).logits
    logits = logits.float()
    loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1)) / (tgt_out != files.PAD).sum()
    loss.backward()
    opt.step()
  return run, _first_run(run)


def _first_run(run) -> dict:
  """Runs once (with compile: compiles); records how many graphs TorchDynamo captured, if any."""
  info = {"first_run_s": worker.first_run(run)}
  graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
  if graphs:
    info["dynamo_graphs"] = int(graphs)
  return info


def search(spec: dict, beam_size: int):
  """`generate` on the shared sources: exactly decode.len new tokens per sentence (eos suppressed)."""
  model = _model(spec).eval()
  n = spec["decode"]["len"]
  ids = torch.from_numpy(files.decode_src(spec["dir"])).long()
  options = dict(input_ids=ids, attention_mask=ids != files.PAD, num_beams=beam_size, do_sample=False,
                 min_new_tokens=n, max_new_tokens=n, early_stopping=False,
                 length_penalty=spec["decode"]["alpha"])
  if spec["compile"]:
    if beam_size != 1:
      raise ValueError("torch.compile decoding is benchmarked for greedy only")
    compile_config = CompileConfig(mode="default")
    compile_config._compile_all_devices = True      # transformers compiles on GPUs only unless told
    options.update(cache_implementation="static", compile_config=compile_config)

  def run():
    with torch.inference_mode(), _precision(spec):
      out = model.generate(**options)
    if out.shape[1] != n + 1:                          # decoder start + n tokens
      raise RuntimeError(f"generate returned {out.shape[1]} positions, expected {n + 1}")
  return run, _first_run(run)


def setup(spec: dict):
  torch.set_num_threads(spec["threads"])
  torch.manual_seed(0)
  tasks, info = {}, {"threads": torch.get_num_threads(),
                     "cpu_capability": torch.backends.cpu.get_cpu_capability()}
  for task in spec["tasks"]:
    if task == "train":
      tasks[task], info[task] = train(spec)
    else:
      tasks[task], info[task] = search(spec, worker.beam_size(spec, task))
  return tasks, info


if __name__ == "__main__":
  worker.serve(setup)
