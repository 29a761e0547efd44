"""Training and decoding throughput of our model beside PyTorch / Hugging Face and CTranslate2.

    python -m benchmarks.throughput [--d_model 256 --num_layers 3 --num_heads 4 --d_ff 1024 --vocab 8000
                                     --batch 32 --src_len 64 --tgt_len 64 --dtype float32|bfloat16]

Everything runs in one process on the same machine, each system using both cores (XLA's default thread
pool, torch.set_num_threads, CTranslate2 intra_threads). The systems of one part (training; greedy;
beam) are timed round-robin, one run of each in turn, so that load from elsewhere on the machine hits
them alike, with --pause seconds of idle before each run. PyTorch runs up to 2x slower in a process
where CTranslate2 has run, so decoding is timed in two phases: ours beside Hugging Face, then ours
beside CTranslate2; each peer's ratio comes from the series of our runs timed beside it. Times are
medians over --repeats runs after --warmup runs; compile time (XLA) is reported separately. Peers that
are not
installed are reported as absent. Prints a table and writes benchmarks/results/throughput.json.

- Training: target tokens/s of one optimizer step (Adam, label smoothing 0.1, dropout 0.1) on a batch of
  --batch rows x --src_len source and --tgt_len target tokens: ours is train/step.py's jitted train_step;
  the peer is the same step in PyTorch eager on the equivalent transformers.MarianMTModel. Each runs in
  float32 and with bfloat16 matmuls accumulating in float32 (ours_bf16: matmul_dtype="bfloat16";
  torch_bf16: torch.autocast). Our model FLOPs per step (matmuls only, 3x the forward) over the step
  time, as a fraction of the float32 (and bfloat16) matmul peak measured here (a large jnp.dot), is the
  utilisation.
- Decoding: target tokens/s for greedy and beam 4 on --decode_batch sentences of --src_len tokens, with
  exactly --decode_len generated tokens per sentence (eos suppressed by a minimum length), on one set of
  random weights exported to the peers by export/. Ours is decode/translate.py's search with
  the sentences split over one CPU device per core (as `python -m decode` runs it), in float32 and with
  bfloat16 matmuls (ours_bf16); Hugging Face also under torch.autocast (hf_bf16); CTranslate2 float32
  (its CPU build offers no bfloat16 here). CTranslate2 and PyTorch use --threads intra-op threads.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import time

if __name__ == "__main__":
  # One CPU device per core, as `python -m decode` sets up (before JAX starts): our decoding splits its
  # sentences over them (decode/translate.py). The training step and the matmul peak use one device
  # (which still runs its matmuls on every core).
  from decode.__main__ import use_cpu_devices
  use_cpu_devices(os.cpu_count() or 1)

import jax
import jax.numpy as jnp
import numpy as np

from model import Transformer, TransformerConfig

RESULTS = pathlib.Path(__file__).parent / "results" / "throughput.json"
PAD, UNK, BOS, EOS = 0, 1, 2, 3


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.split("\n")[0])
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--num_layers", type=int, default=3, help="encoder and decoder layers each")
  p.add_argument("--num_heads", type=int, default=4)
  p.add_argument("--d_ff", type=int, default=1024)
  p.add_argument("--vocab", type=int, default=8000)
  p.add_argument("--batch", type=int, default=32, help="training rows")
  p.add_argument("--src_len", type=int, default=64)
  p.add_argument("--tgt_len", type=int, default=64)
  p.add_argument("--decode_batch", type=int, default=16)
  p.add_argument("--decode_len", type=int, default=64, help="generated tokens per sentence")
  p.add_argument("--beam_size", type=int, default=4)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                 help="our compute dtype (parameters stay float32); peers always run float32")
  p.add_argument("--threads", type=int, default=2, help="PyTorch and CTranslate2 threads")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--skip", default="",
                 help="comma list of parts to skip: train,decode,ours,ours_bf16,torch,torch_bf16,hf,ct2")
  p.add_argument("--pause", type=float, default=0.5,
                 help="seconds of idle before each timed run (lets the previous system's threads settle)")
  p.add_argument("--out", default=str(RESULTS))
  return p.parse_args(argv)


def interleaved(fns: dict, warmup: int, repeats: int, pause: float = 0.0) -> dict:
  """Times several systems round-robin (so that load from other processes hits all of them alike).

  fns: {name: zero-argument callable}. pause: seconds of sleep before each timed run, so that every run
  starts with the worker threads of the system before it (OpenMP, XLA) idle.
  Returns {name: {'median_s', 'min_s', 'repeats'}}.
  """
  for fn in fns.values():
    for _ in range(warmup):
      fn()
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      time.sleep(pause)
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
  return {name: {"median_s": statistics.median(t), "min_s": min(t), "repeats": repeats}
          for name, t in times.items()}


def timed(fn, warmup: int, repeats: int) -> dict:
  """Runs fn() warmup times, then repeats times; returns median/min seconds of the timed runs."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return {"median_s": statistics.median(times), "min_s": min(times), "repeats": repeats}


def model_config(args, dtype=None) -> TransformerConfig:
  return TransformerConfig(vocab_size=args.vocab, d_model=args.d_model, d_ff=args.d_ff,
                           num_heads=args.num_heads, num_encoder_layers=args.num_layers,
                           num_decoder_layers=args.num_layers, dropout_rate=0.1,
                           max_len=max(256, args.src_len, args.tgt_len, args.decode_len + 1),
                           dtype=dtype or args.dtype)


def train_flops(cfg: TransformerConfig, batch: int, src_len: int, tgt_len: int) -> float:
  """Matmul FLOPs of one training step (forward + backward = 3x forward); elementwise work excluded."""
  d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
  enc_token = 8 * d * d + 4 * d * f + 4 * src_len * d               # QKV+O, FFN, scores + weighted sum
  dec_token = (8 * d * d + 4 * tgt_len * d                            # self-attention
               + 4 * d * d + 4 * src_len * d                          # cross: Q, O, scores, weighted sum
               + 4 * d * f)
  cross_kv = 4 * d * d                                                # cross K, V per source token
  forward = batch * (cfg.num_encoder_layers * enc_token * src_len
                     + cfg.num_decoder_layers * (dec_token * tgt_len + cross_kv * src_len)
                     + 2 * d * v * tgt_len)                           # output projection
  return 3.0 * forward


def random_batch(rng, rows: int, src_len: int, tgt_len: int, vocab: int) -> dict:
  """An unpacked batch without padding, in the data/ batch contract."""
  src = rng.integers(4, vocab, (rows, src_len)).astype(np.int32)
  tgt = rng.integers(4, vocab, (rows, tgt_len)).astype(np.int32)
  tgt_in = np.concatenate([np.full((rows, 1), BOS, np.int32), tgt[:, :-1]], axis=1)
  tgt_out = np.concatenate([tgt[:, :-1], np.full((rows, 1), EOS, np.int32)], axis=1)
  ones = lambda n: np.ones((rows, n), np.int32)
  positions = lambda n: np.broadcast_to(np.arange(n, dtype=np.int32), (rows, n)).copy()
  return {"src": src, "src_segments": ones(src_len), "src_positions": positions(src_len),
          "tgt_in": tgt_in, "tgt_out": tgt_out, "tgt_segments": ones(tgt_len),
          "tgt_positions": positions(tgt_len)}


# ----------------------------------------------------------------------------------------------------
# Matmul peak.
# ----------------------------------------------------------------------------------------------------
def matmul_peak(args, dtype) -> float:
  """GFLOP/s of a large jitted jnp.dot in `dtype` (float32 accumulation)."""
  n = 2048
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype)
  f = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
  t = timed(lambda: f(a).block_until_ready(), args.warmup, args.repeats)
  return 2 * n ** 3 / t["median_s"] / 1e9


# ----------------------------------------------------------------------------------------------------
# Training.
# ----------------------------------------------------------------------------------------------------
def train_ours(args, batch, matmul_dtype=None) -> dict:
  """train/step.py's jitted step (Adam, label smoothing 0.1, dropout 0.1) on one device mesh.
  matmul_dtype="bfloat16": mixed precision (bfloat16 matmul operands, float32 accumulation)."""
  from experiments.default import get_config
  from train import optimizer, schedules
  from train import step as step_lib
  config = get_config()
  cfg = model_config(args).replace(matmul_dtype=matmul_dtype)
  model = Transformer(cfg)
  schedule = schedules.make_schedule(config.train, cfg.d_model)
  tx = optimizer.make_optimizer(config.train, schedule)
  mesh = step_lib.make_mesh(jax.devices()[:1])
  state, shardings = step_lib.create_state(model, tx, mesh, jax.random.key(0))
  step_fn = step_lib.jit_train_step(model, tx, schedule, mesh, shardings, label_smoothing=0.1)
  placed = step_lib.place_batch(batch, mesh)
  key = jax.random.key(1)
  start = time.perf_counter()
  compiled = step_fn.lower(state, placed, key).compile()
  compile_s = time.perf_counter() - start
  holder = {"state": state}

  def run():
    holder["state"], metrics = compiled(holder["state"], placed, key)
    jax.block_until_ready(metrics["loss"])
  xla = compiled.cost_analysis()
  xla = xla[0] if isinstance(xla, (list, tuple)) else xla
  return run, {"compile_s": compile_s, "xla_flops": float(xla.get("flops", 0.0)) if xla else None}


def train_torch(args, batch, autocast=False) -> dict:
  """The same step in PyTorch eager on transformers' MarianMTModel (Adam, label smoothing, dropout).
  autocast=True: the forward pass under torch.autocast("cpu", torch.bfloat16) (PyTorch's mixed
  precision; the loss in float32)."""
  import contextlib
  import torch
  from transformers import MarianConfig, MarianMTModel
  torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  cfg = model_config(args, "float32")
  model = MarianMTModel(MarianConfig(
      vocab_size=cfg.vocab_size, d_model=cfg.d_model, encoder_layers=cfg.num_encoder_layers,
      decoder_layers=cfg.num_decoder_layers, encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
      encoder_attention_heads=cfg.num_heads, decoder_attention_heads=cfg.num_heads,
      activation_function="relu", scale_embedding=True, dropout=0.1, max_position_embeddings=cfg.max_len,
      pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=BOS, forced_eos_token_id=None))
  model.train()
  opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
  loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=PAD, reduction="sum")
  src = torch.from_numpy(batch["src"]).long()
  tgt_in = torch.from_numpy(batch["tgt_in"]).long()
  tgt_out = torch.from_numpy(batch["tgt_out"]).long()
  mask = src != PAD

  def run():
    opt.zero_grad(set_to_none=True)
    with (torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()):
      logits = model(input_ids=src, attention_mask=mask, decoder_input_ids=tgt_in).logits
    logits = logits.float()
    loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1)) / (tgt_out != PAD).sum()
    loss.backward()
    opt.step()
  return run, {}


# ----------------------------------------------------------------------------------------------------
# Decoding.
# ----------------------------------------------------------------------------------------------------
def decode_ours(args, params, src, matmul_dtype=None) -> dict:
  """decode/translate.py's jitted search (what `python -m decode` runs): greedy (sampling at temperature
  0) and beam search with min_len = max_len, the sentences split over every local device.
  matmul_dtype="bfloat16": the same float32 weights with bfloat16 matmul operands (mixed precision).
  Returns {mode: (run, info)}: run() decodes the batch once."""
  from decode.translate import search_fn, device_mesh
  cfg = model_config(args).replace(matmul_dtype=matmul_dtype)
  n = args.decode_len
  mesh = device_mesh()
  devices = mesh.devices.size
  if src.shape[0] % devices:
    raise ValueError(f"--decode_batch {src.shape[0]} is not a multiple of the {devices} devices")
  limits = jnp.full((src.shape[0],), n, jnp.int32)
  src = jnp.asarray(src)
  params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  key = jax.random.key(0)
  parts = {}
  for name, beam in (("greedy", 1), (f"beam{args.beam_size}", args.beam_size)):
    sampling = (("temperature", 0.0),) if beam == 1 else ()
    fn = search_fn(cfg, beam, 0.6, n, n, sampling, mesh)
    start = time.perf_counter()
    compiled = fn.lower(params, src, limits, key).compile()
    compile_s = time.perf_counter() - start
    search = (f"decode.translate: {'greedy' if beam == 1 else 'beam_search'} on {devices} CPU "
              f"device{'s' if devices > 1 else ''}")
    parts[name] = (lambda c=compiled: jax.block_until_ready(c(params, src, limits, key)),
                   {"compile_s": compile_s, "search": search})
  return parts


def decode_hf(args, hf_model, src, autocast=False) -> dict:
  """Hugging Face `generate` on the exported MarianMTModel. Returns {mode: (run, info)}.
  autocast=True: under torch.autocast("cpu", torch.bfloat16) (PyTorch's mixed precision)."""
  import contextlib
  import torch
  torch.set_num_threads(args.threads)
  n = args.decode_len
  ids = torch.from_numpy(src).long()
  mask = ids != PAD
  parts = {}
  for name, beam in (("greedy", 1), (f"beam{args.beam_size}", args.beam_size)):
    def run(beam=beam):
      with torch.inference_mode(), (torch.autocast("cpu", dtype=torch.bfloat16) if autocast
                                    else contextlib.nullcontext()):
        out = hf_model.generate(input_ids=ids, attention_mask=mask, num_beams=beam, do_sample=False,
                                min_new_tokens=n, max_new_tokens=n, early_stopping=False,
                                length_penalty=0.6)
      assert out.shape[1] == n + 1, out.shape          # decoder start + n tokens
    parts[name] = (run, {})
  return parts


def decode_ct2(args, model_dir, src, pieces) -> dict:
  """CTranslate2 float32 on the exported model. Returns {mode: (run, info)}."""
  import ctranslate2
  n = args.decode_len
  translator = ctranslate2.Translator(str(model_dir), device="cpu", compute_type="float32",
                                      intra_threads=args.threads, inter_threads=1)
  tokens = [[pieces[i] for i in row] for row in src]
  parts = {}
  for name, beam in (("greedy", 1), (f"beam{args.beam_size}", args.beam_size)):
    def run(beam=beam):
      out = translator.translate_batch(tokens, beam_size=beam, length_penalty=0.6,
                                       min_decoding_length=n, max_decoding_length=n,
                                       max_batch_size=0)
      assert len(out[0].hypotheses[0]) == n, len(out[0].hypotheses[0])
    parts[name] = (run, {})
  return parts


# ----------------------------------------------------------------------------------------------------
# Driver.
# ----------------------------------------------------------------------------------------------------
def _absent(error) -> dict:
  return {"absent": f"{type(error).__name__}: {str(error)[:200]}"}


def _run_part(fn, *a):
  try:
    return fn(*a)
  except ImportError as error:      # a peer that is not installed is reported, not skipped silently
    return _absent(error)


def machine() -> dict:
  cpu = platform.processor()
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  versions = {"python": platform.python_version(), "jax": jax.__version__}
  for name in ("torch", "transformers", "ctranslate2"):
    try:
      versions[name] = __import__(name).__version__
    except ImportError:
      versions[name] = "absent"
  return {"cpu": cpu, "cores": os.cpu_count(), "devices": str(jax.devices()),
          "date": datetime.datetime.now().isoformat(timespec="seconds"), "versions": versions}


def table(report: dict) -> str:
  rows = []
  tr = report.get("train", {})
  peak = report["matmul_peak_gflops"]["float32"]
  rows.append(("train", "system", "tokens/s", "vs torch", "note"))
  torch_tps = tr.get("torch", {}).get("tokens_per_s")
  bf16_peak = report["matmul_peak_gflops"]["bfloat16"]
  for name in ("ours", "ours_bf16", "torch", "torch_bf16"):
    r = tr.get(name)
    if r is None:
      continue
    if "absent" in r:
      rows.append(("train", name, "absent", "", r["absent"][:60]))
      continue
    ratio = f"{r['tokens_per_s'] / torch_tps:.2f}x" if torch_tps else ""
    torch_bf16 = tr.get("torch_bf16", {}).get("tokens_per_s")
    if name == "ours_bf16" and torch_bf16:
      ratio += f" ({r['tokens_per_s'] / torch_bf16:.2f}x torch_bf16)"
    note = "bf16 autocast" if name == "torch_bf16" else ""
    if name.startswith("ours"):
      note = (f"{r['gflops']:.1f} GFLOP/s = {100 * r['gflops'] / peak:.0f}% of f32 peak {peak:.0f}"
              + (f" ({100 * r['gflops'] / bf16_peak:.0f}% of bf16 peak {bf16_peak:.0f})"
                 if name == "ours_bf16" else "")
              + f"; compile {r['compile_s']:.1f} s; {report['dtype']}"
              + (" with bfloat16 matmuls" if name == "ours_bf16" else ""))
    rows.append(("train", name, f"{r['tokens_per_s']:.0f}", ratio, note))
  dec = report.get("decode", {})
  for mode in ("greedy", f"beam{report['args']['beam_size']}"):
    tps = lambda name: dec.get(name, {}).get(mode, {}).get("tokens_per_s")
    for name in ("ours", "ours_bf16", "ct2", "hf", "hf_bf16"):
      r = dec.get(name)
      if r is None:
        continue
      if "absent" in r:
        rows.append((f"decode {mode}", name, "absent", "", r["absent"][:60]))
        continue
      m = r[mode]
      # Each peer is compared with the series of ours timed beside it (see main).
      ratios, note = [], ""
      if name.startswith("ours"):
        peers = ["ct2", "hf"] + (["hf_bf16"] if name == "ours_bf16" else [])
        for peer in peers:
          mine = tps(name + "_beside_ct2") if peer == "ct2" else tps(name)
          if tps(peer) and mine:
            ratios.append(f"{mine / tps(peer):.2f}x {peer}")
        note = f"compile {m['compile_s']:.1f} s; {m['search']}"
        if name == "ours_bf16":
          note += "; bfloat16 matmuls"
        if tps(name + "_beside_ct2"):
          note += f"; {tps(name + '_beside_ct2'):.0f} tok/s beside ct2"
      elif name == "ct2" and tps("hf"):
        ratios.append(f"{m['tokens_per_s'] / tps('hf'):.2f}x hf (hf timed before ct2 ran)")
      elif name == "hf_bf16":
        note = "bf16 autocast"
      rows.append((f"decode {mode}", name, f"{m['tokens_per_s']:.0f}", " ".join(ratios), note))
  widths = [max(len(str(r[i])) for r in rows) for i in range(5)]
  return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def main(argv=None):
  args = parse_args(argv)
  skip = set(filter(None, args.skip.split(",")))
  rng = np.random.default_rng(0)
  report = {"machine": machine(), "args": vars(args), "dtype": args.dtype,
            "matmul_peak_gflops": {"float32": matmul_peak(args, jnp.float32),
                                   "bfloat16": matmul_peak(args, jnp.bfloat16)}}
  print(f"matmul peak: {report['matmul_peak_gflops']}", file=sys.stderr)

  if "train" not in skip:
    batch = random_batch(rng, args.batch, args.src_len, args.tgt_len, args.vocab)
    tokens = args.batch * args.tgt_len
    flops = train_flops(model_config(args), args.batch, args.src_len, args.tgt_len)
    report["train"] = {"model_flops_per_step": flops, "target_tokens_per_step": tokens}
    # Ours and PyTorch, each in float32 and with bfloat16 matmuls (float32 accumulation).
    parts = {"ours": train_ours,
             "ours_bf16": lambda args, batch: train_ours(args, batch, "bfloat16"),
             "torch": train_torch,
             "torch_bf16": lambda args, batch: train_torch(args, batch, autocast=True)}
    parts = {name: fn for name, fn in parts.items() if name not in skip}
    runs = {}
    for name, fn in parts.items():
      try:
        runs[name], report["train"][name] = fn(args, batch)
      except ImportError as error:
        report["train"][name] = _absent(error)
    for name, r in interleaved(runs, args.warmup, args.repeats, args.pause).items():
      r.update(report["train"][name], tokens_per_s=tokens / r["median_s"], gflops=flops / r["median_s"] / 1e9)
      report["train"][name] = r
      print(f"train {name}: {r}", file=sys.stderr)

  if "decode" not in skip:
    cfg = model_config(args, "float32")
    src = rng.integers(4, args.vocab, (args.decode_batch, args.src_len)).astype(np.int32)
    ids = jnp.ones((1, 2), jnp.int32)
    params = Transformer(cfg).init({"params": jax.random.key(2)}, ids, ids)["params"]
    report["decode"] = {}
    import tempfile
    import types
    vocab = types.SimpleNamespace(pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS, size=args.vocab)
    pieces = ["<pad>", "<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(4, args.vocab)]

    def ct2_part(tmp):
      import ctranslate2  # noqa: F401  (absent peer -> ImportError here)
      from export import ctranslate2 as ct2_export
      out = ct2_export.save_ctranslate2(ct2_export.ctranslate2_spec(params, cfg, vocab, pieces), tmp + "/ct2")
      return decode_ct2(args, out, src, pieces)

    exported = {}

    def hf_part(tmp, autocast=False):
      from export import hf as hf_export
      if "hf" not in exported:
        exported["hf"] = hf_export.to_marian(params, cfg, vocab)
      return decode_hf(args, exported["hf"], src, autocast)

    with tempfile.TemporaryDirectory() as tmp:
      # Ours in float32 and with bfloat16 matmuls, each compiled once.
      ours = {}
      for name, matmul_dtype in (("ours", None), ("ours_bf16", "bfloat16")):
        if name not in skip:
          got = _run_part(lambda tmp, m=matmul_dtype: decode_ours(args, params, src, m), tmp)
          if "absent" in got:
            report["decode"][name] = got
          else:
            ours[name] = got
      # PyTorch runs up to 2x slower in a process where CTranslate2 has run (measured here: HF greedy
      # 336 -> 639 ms, a 16 x 8000 matmul 57 -> 77 ms, and it stays so), so every PyTorch measurement
      # comes first, and CTranslate2 is timed afterwards beside a second series of our runs. Each phase
      # times its systems round-robin, as training does.
      phases = [("", [("hf", hf_part), ("hf_bf16", lambda tmp: hf_part(tmp, autocast=True))]),
                ("_beside_ct2", [("ct2", ct2_part)])]
      for suffix, peers in phases:
        systems = dict(ours)
        for peer, part in peers:
          if peer not in skip:
            got = _run_part(part, tmp)
            if "absent" in got:
              report["decode"][peer] = got
            else:
              systems[peer] = got
        if suffix and len(systems) == len(ours):
          continue          # no CTranslate2: no second series of ours (the first runs regardless)
        for mode in ("greedy", f"beam{args.beam_size}"):
          runs = {name: parts[mode][0] for name, parts in systems.items()}
          for name, r in interleaved(runs, args.warmup, args.repeats, args.pause).items():
            r.update(systems[name][mode][1], tokens_per_s=src.shape[0] * args.decode_len / r["median_s"])
            key = name + suffix if name in ours else name
            report["decode"].setdefault(key, {})[mode] = r
            print(f"decode {mode} {key}: {r}", file=sys.stderr)

  text = table(report)
  report["table"] = text
  print(f"\n{report['machine']['cpu']}, {report['machine']['cores']} cores, {report['machine']['date']}")
  print(text)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=2, default=str) + "\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
