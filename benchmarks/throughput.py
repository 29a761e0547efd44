"""Training and decoding throughput of our model beside PyTorch / Hugging Face and CTranslate2, fairly.

    python -m benchmarks.throughput [--d_model 256 --num_layers 3 --batch 32 --src_len 64 --tgt_len 64
                                     --decode_batch 16 --decode_len 64 --repeats 7] [--preset default]
    python -m benchmarks.report        # regenerates docs/performance.md from benchmarks/results/*.json

Every system runs in a fresh process of its own that imports only that system (benchmarks/systems/),
and all of them read one set of weights and inputs from files written once (benchmarks/prepare.py: our
random init, exported to the peers by export/). The parts run one after another, each with
fresh processes: the float32 and bfloat16 matmul peaks, training, decoding. Within a part the systems
take turns round-robin, one timed run each per round (benchmarks/harness.py), so every ratio comes from
runs of the same rounds. Medians over --repeats rounds (after --warmup untimed runs), with min/max and
quartiles, go to benchmarks/results/throughput[-PRESET].json.

- Peaks: GFLOP/s of a 2048 x 2048 jnp.dot in float32 and in bfloat16 (float32 accumulation).
- Training (target tokens/s of one Adam step, label smoothing 0.1, dropout --dropout): ours
  (train/step.py) in float32 and with bfloat16 matmuls; PyTorch eager on the equivalent MarianMTModel in
  float32 and under torch.autocast(bfloat16); the same under torch.compile. Utilisation: our model's
  matmul FLOPs per step (3x the forward) over the step time, against the measured peaks.
- Decoding (target tokens/s, exactly --decode_len tokens per sentence): greedy and beam --beam_size for
  ours (decode/translate.py's search, sentences split over one CPU device per core), Hugging Face
  `generate` eager, Hugging Face greedy under torch.compile, CTranslate2 float32 and int8_float32.
--baseline DIR: the same float32 rows from another checkout (code before a change), as the extra system
ours_baseline; the ratio ours/ours_baseline is the change's speed-up, measured in the same rounds.
--preset default: the default experiment's model (d_model 128, 2+2 layers, no dropout) and its packed
2,048-token batch: our training rows only (MarianMTModel has no packed-row attention), and decoding.
--preset tiny: a 1+1-layer d_model-32 model on 8-token sentences, for the tests.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys
import tempfile

from benchmarks import files, harness, report
from run.devices import usable_cpus

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
PRESETS = {"default": dict(d_model=128, num_layers=2, num_heads=4, d_ff=512, vocab=8000, batch=32,
                           src_len=64, tgt_len=64, dropout=0.0),
           # For the tests: every part of a benchmark in seconds; its numbers measure nothing.
           "tiny": dict(d_model=32, num_layers=1, num_heads=2, d_ff=64, vocab=300, batch=4, src_len=8, tgt_len=8,
                        dropout=0.0)}


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__.split("\n")[0])
  p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                 help="default: the default experiment's model and packed batches (overrides sizes)")
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--num_layers", type=int, default=3, help="encoder and decoder layers each")
  p.add_argument("--num_heads", type=int, default=4)
  p.add_argument("--d_ff", type=int, default=1024)
  p.add_argument("--vocab", type=int, default=8000)
  p.add_argument("--dropout", type=float, default=0.1)
  p.add_argument("--batch", type=int, default=32, help="training rows")
  p.add_argument("--src_len", type=int, default=64)
  p.add_argument("--tgt_len", type=int, default=64)
  p.add_argument("--decode_batch", type=int, default=16, help="a multiple of the CPU cores")
  p.add_argument("--decode_len", type=int, default=64, help="generated tokens per sentence")
  p.add_argument("--decode_devices", type=int, default=None,
                 help="our CPU devices for decoding, the sentences split over them (default: one per core "
                      "it may use, as `python -m decode` runs; 1: the whole batch on one device, as `python -m train`'s "
                      "evaluation runs)")
  p.add_argument("--beam_size", type=int, default=4)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                 help="our compute dtype (parameters stay float32); peers run float32")
  p.add_argument("--kernels", default=None, help="our model.config kernels switch (default: the config's)")
  p.add_argument("--threads", type=int, default=usable_cpus(),
                 help="PyTorch and CTranslate2 intra-op threads (XLA uses every core)")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--pause", type=float, default=0.5, help="seconds of idle before each timed run")
  p.add_argument("--skip", default="", help="comma list of parts (peak, train, decode) and systems "
                 "(ours, ours_bf16, torch, torch_bf16, torch_compile, torch_compile_bf16, hf, "
                 "hf_compile, ct2, ct2_int8) to leave out")
  p.add_argument("--baseline", default=None, metavar="DIR",
                 help="another checkout of this repository: its float32 training and decoding run as the "
                      "extra system ours_baseline, in the same rounds, so a change is measured side by side")
  p.add_argument("--setup_timeout", type=float, default=1800.0, help="seconds a system may take to set up")
  p.add_argument("--isa", default="native", choices=sorted(ISA_ENV),
                 help="avx2: every system, the float32 matmul peak included, capped at AVX2 (on an AVX-512 "
                      "host: close to what an AVX2-only CPU of the same cores would run; XLA's matmul "
                      "library is not capped, so the bfloat16 systems are left out)")
  p.add_argument("--note", default="", help="a line for the performance page, e.g. the machine's state")
  p.add_argument("--out", default=None, help="default: benchmarks/results/throughput[-PRESET].json")
  args = p.parse_args(argv)
  if args.decode_devices is not None and args.decode_devices < 1:
    p.error(f"--decode_devices {args.decode_devices}: give 1 or more devices")
  if args.preset:
    for key, value in PRESETS[args.preset].items():
      setattr(args, key, value)
  if args.out is None:
    devices = f"{args.decode_devices}device" if args.decode_devices else None
    suffix = "".join(f"-{x}" for x in (args.preset, args.isa if args.isa != "native" else None, devices) if x)
    args.out = str(RESULTS / f"throughput{suffix}.json")
  return args


def model_fields(args) -> dict:
  """TransformerConfig fields of the benchmarked model (as JSON), its Compute fields under "compute"."""
  kernels = {"kernels": args.kernels} if args.kernels else {}
  return dict(vocab_size=args.vocab, d_model=args.d_model, d_ff=args.d_ff, num_heads=args.num_heads,
              num_encoder_layers=args.num_layers, num_decoder_layers=args.num_layers,
              dropout_rate=args.dropout, max_len=max(256, args.src_len, args.tgt_len, args.decode_len + 1),
              compute=dict(dtype=args.dtype, **kernels))


def train_flops(m: dict, rows: int, src_len: int, tgt_len: int) -> float:
  """Matmul FLOPs of one training step (forward + backward = 3x forward) on full rows (a packed row's
  attention spans the whole row, masked); elementwise work excluded."""
  d, f, v = m["d_model"], m["d_ff"], m["vocab_size"]
  enc_token = 8 * d * d + 4 * d * f + 4 * src_len * d               # QKV+O, FFN, scores + weighted sum
  dec_token = (8 * d * d + 4 * tgt_len * d                            # self-attention
               + 4 * d * d + 4 * src_len * d                          # cross: Q, O, scores, weighted sum
               + 4 * d * f)
  cross_kv = 4 * d * d                                                # cross K, V per source token
  forward = rows * (m["num_encoder_layers"] * enc_token * src_len
                    + m["num_decoder_layers"] * (dec_token * tgt_len + cross_kv * src_len)
                    + 2 * d * v * tgt_len)                            # output projection
  return 3.0 * forward


# ----------------------------------------------------------------------------------------------------
# The systems of each part: (name, module, options, tasks).
# ----------------------------------------------------------------------------------------------------
OURS, TORCH, CT2 = "benchmarks.systems.ours", "benchmarks.systems.torch_hf", "benchmarks.systems.ct2"
PEAK_SYSTEMS = [("peak_float32", OURS, {"peak_dtype": "float32"}),
                ("peak_bfloat16", OURS, {"peak_dtype": "bfloat16"})]
TRAIN_SYSTEMS = [
    ("ours", OURS, {"matmul_dtype": None}),
    ("ours_bf16", OURS, {"matmul_dtype": "bfloat16"}),
    ("torch", TORCH, {"autocast": False, "compile": False}),
    ("torch_bf16", TORCH, {"autocast": True, "compile": False}),
    ("torch_compile", TORCH, {"autocast": False, "compile": True}),
    ("torch_compile_bf16", TORCH, {"autocast": True, "compile": True}),
    ("ours_baseline", OURS, {"matmul_dtype": None})]   # only with --baseline
DECODE_SYSTEMS = [
    ("ours", OURS, {"matmul_dtype": None}),
    ("ours_bf16", OURS, {"matmul_dtype": "bfloat16"}),
    ("hf", TORCH, {"autocast": False, "compile": False}),
    ("hf_compile", TORCH, {"autocast": False, "compile": True}),
    ("ct2", CT2, {"compute_type": "float32"}),
    ("ct2_avx2", CT2, {"compute_type": "float32"}),      # oneDNN capped at AVX2: SYSTEM_ENV
    ("ct2_int8", CT2, {"compute_type": "int8_float32"}),
    ("ours_baseline", OURS, {"matmul_dtype": None})]   # only with --baseline
# Which peer each of our rows is compared with (a ratio > 1: ours is faster).
TRAIN_PAIRS = [("ours", "torch"), ("ours", "torch_compile"), ("ours_bf16", "torch_bf16"),
               ("ours_bf16", "torch_compile_bf16"), ("ours", "ours_baseline"), ("ours_baseline", "torch")]
DECODE_PAIRS = [(o, p) for o in ("ours", "ours_bf16")
                for p in ("hf", "hf_compile", "ct2", "ct2_avx2", "ct2_best", "ct2_int8")] + [
    ("ours", "ours_baseline"), ("ours_baseline", "ct2"), ("ours_baseline", "ct2_best")]

# A system's own settings, on top of --isa's. CTranslate2 does its float32 GEMM with oneDNN on a CPU
# that is not Intel's (MKL only on Intel), and on the AMD EPYC of docs/performance.md oneDNN's AVX-512
# sgemm decoded slower than its AVX2 one. So CTranslate2 float32 runs twice: as installed (ct2) and with oneDNN capped at
# AVX2 (ct2_avx2); ct2_best takes, in each round, the faster of the two, and the targets compare with it.
SYSTEM_ENV = {"ct2_avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}
BEST_OF = {"ct2_best": ("ct2", "ct2_avx2")}


# --isa: what caps each system's instruction set. XLA's generated code takes --xla_cpu_max_isa (in
# xla_env); the libraries each read their own variable.
ISA_ENV = {
    "native": {},
    "avx2": {"AIAYN_CPU_MARCH": "x86-64-v3",       # our C++ kernels (kernels/cpu_decoding.py)
             "ATEN_CPU_CAPABILITY": "avx2",        # PyTorch's own kernels
             "ONEDNN_MAX_CPU_ISA": "AVX2",         # oneDNN (PyTorch, CTranslate2)
             "MKL_ENABLE_INSTRUCTIONS": "AVX2",    # MKL's GEMM (PyTorch, CTranslate2)
             "CT2_FORCE_CPU_ISA": "AVX2"},         # CTranslate2's own kernels
}


# What --isa avx2 cannot cap: XLA's matmul library (YNNPACK) detects the CPU itself and keeps AVX-512
# and AVX512-BF16 (a bfloat16 2048 x 2048 dot ran at 299 GFLOP/s under the cap, above the float32 peak,
# which only the BF16 instructions give). Our bfloat16 rows would keep instructions that PyTorch's lose,
# so the bfloat16 systems are left out of a capped run.
BF16_SYSTEMS = ("peak_bfloat16", "ours_bf16", "torch_bf16", "torch_compile_bf16")
ISA_SKIPPED = "--isa: XLA's matmul library keeps AVX512-BF16 under the cap, so bfloat16 would not compare"


def xla_env(devices: int, isa: str = "native") -> dict:
  """XLA_FLAGS for our worker: `devices` host devices (1: XLA's default), the --isa cap, other flags
  kept."""
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if "host_platform_device_count" not in f and "xla_cpu_max_isa" not in f)
  if devices > 1:
    flags += f" --xla_force_host_platform_device_count={devices}"
  if isa != "native":
    flags += f" --xla_cpu_max_isa={isa.upper()}"
  return {"XLA_FLAGS": flags.strip()}


def run_part(systems, tasks_of, base_spec: dict, args, log_dir) -> tuple[dict, dict]:
  """Starts the part's workers, times each task round-robin, closes them.
  Returns ({task: {name: [seconds]}}, {name: worker})."""
  workers = []
  for name, module, options in systems:
    tasks = tasks_of(name)
    env = dict(ISA_ENV[args.isa], **SYSTEM_ENV.get(name, {}))
    if module == OURS:
      decode_devices = args.decode_devices or usable_cpus()
      env.update(xla_env(decode_devices if "greedy" in tasks else 1, args.isa))
    tree = args.baseline if name == "ours_baseline" else harness.REPO
    workers.append(harness.Worker(name, module, dict(base_spec, **options, tasks=tasks), env, tree))
  harness.start(workers, log_dir, args.setup_timeout)
  times = {}
  try:
    for task in sorted({t for w in workers for t in w.spec["tasks"]}, key=["peak", "train", "greedy",
                                                                          "beam"].index):
      print(f"[harness] timing {task}", file=sys.stderr, flush=True)
      times[task] = harness.round_robin(workers, task, warmup=args.warmup, repeats=args.repeats,
                                        pause=args.pause)
  finally:
    harness.close(workers)
  return times, {w.name: w for w in workers}


def rows(times: dict, workers: dict, names, per_run=None, skipped=None) -> dict:
  """One result per system: status, pid, setup info, and the summary of its runs (+ rates)."""
  out = {}
  for name in names:
    worker = workers.get(name)
    if worker is None:
      out[name] = {"status": "skipped", "reason": (skipped or {}).get(name, "--skip")}
      continue
    row = {"status": worker.status, "pid": worker.pid, "info": worker.info}
    if worker.reason:
      row["reason"] = worker.reason
    if times.get(name):
      row.update(harness.summary(times[name]))
      if per_run:
        row.update(per_run(row["median_s"]))
    out[name] = row
  return out


def ratios(times: dict, pairs) -> dict:
  """ours/peer speed ratios from the same rounds: of the medians, and the range of per-round ratios."""
  out = {}
  for ours, peer in pairs:
    a, b = times.get(ours), times.get(peer)
    if a and b and len(a) == len(b):
      per_round = sorted(y / x for x, y in zip(a, b))
      out[f"{ours}/{peer}"] = {"of_medians": harness.summary(b)["median_s"] / harness.summary(a)["median_s"],
                               "min": per_round[0], "max": per_round[-1]}
  return out


def best_of(times: dict) -> dict:
  """times plus BEST_OF's systems: in each round, the faster of a peer's settings (when every one ran).
  Taking the faster per round, not per median, leans the comparison towards the peer."""
  out = dict(times)
  for best, names in BEST_OF.items():
    runs = [times.get(n) for n in names]
    if all(runs) and len({len(r) for r in runs}) == 1:
      out[best] = [min(round_) for round_ in zip(*runs)]
  return out


def main(argv=None):
  args = parse_args(argv)
  skip = set(filter(None, args.skip.split(",")))
  isa_skipped = {n: ISA_SKIPPED for n in BF16_SYSTEMS if args.isa != "native" and n not in skip}
  if args.isa != "native" and "ct2_avx2" not in skip:
    isa_skipped["ct2_avx2"] = "--isa caps ct2 itself, oneDNN included: ct2_avx2 would be the same system"
  skip |= set(isa_skipped)
  if args.baseline is None:
    skip.add("ours_baseline")
  elif not (pathlib.Path(args.baseline) / "benchmarks" / "systems" / "ours.py").exists():
    raise SystemExit(f"--baseline {args.baseline}: not a checkout of this repository "
                     "(no benchmarks/systems/ours.py)")
  else:
    args.baseline = str(pathlib.Path(args.baseline).resolve())
  packed = args.preset == "default"
  command = shlex.join(["python", "-m", "benchmarks.throughput"] + list(sys.argv[1:] if argv is None else argv))
  # The rows of the results: every system (skipped ones say so) but ours_baseline, which needs --baseline.
  listed = lambda systems: [n for n, _, _ in systems if n != "ours_baseline" or args.baseline]
  result = {"benchmark": "throughput", "date": harness.now(), "command": command, "note": args.note,
            "preset": args.preset,
            "machine": harness.machine(), "versions": harness.versions(), "args": vars(args),
            "model": model_fields(args), "harness_pid": os.getpid(),
            "commit": harness.commit_of(),
            "baseline": harness.commit_of(args.baseline) if args.baseline else None,
            "load_average": {"start": os.getloadavg()[0]}}
  with tempfile.TemporaryDirectory(prefix="aiayn-bench-") as shared:
    base = {"dir": shared, "model": result["model"], "threads": args.threads,
            "train": {"label_smoothing": 0.1},
            "decode": {"len": args.decode_len, "beam_size": args.beam_size, "alpha": 0.6}}
    train_names = [n for n, _, _ in TRAIN_SYSTEMS if n not in skip and "train" not in skip
                   and (not packed or n.startswith("ours"))]
    decode_names = [n for n, _, _ in DECODE_SYSTEMS if n not in skip and "decode" not in skip]
    peers = {n for n in train_names + decode_names if not n.startswith("ours")}
    exports = ["marian"] * any(n.startswith(("torch", "hf")) for n in peers) + ["ct2"] * any(
        n.startswith("ct2") for n in peers)
    print("[harness] preparing the shared weights and inputs", file=sys.stderr, flush=True)
    harness.prepare(dict(dir=shared, model=result["model"], exports=exports, seed=0,
                         train=dict(rows=args.batch, src_len=args.src_len, tgt_len=args.tgt_len,
                                    packed=packed),
                         decode=dict(batch=args.decode_batch, src_len=args.src_len)), shared)
    result["prepared"] = json.loads((pathlib.Path(shared) / files.PREPARED).read_text())

    if "peak" not in skip:
      systems = [s for s in PEAK_SYSTEMS if s[0] not in skip]
      times, workers = run_part(systems, lambda name: ["peak"], base, args, shared)
      result["peak"] = {}
      for name, row in rows(times["peak"], workers, [n for n, _, _ in PEAK_SYSTEMS], skipped=isa_skipped).items():
        if "median_s" in row:
          row["gflops"] = row["info"]["peak"]["flops"] / row["median_s"] / 1e9
        result["peak"][name.removeprefix("peak_")] = row

    if train_names:
      batch = files.train_batch(shared)
      tokens = int((batch["tgt_segments"] > 0).sum())
      flops = train_flops(result["model"], *batch["src"].shape, batch["tgt_in"].shape[1])
      systems = [s for s in TRAIN_SYSTEMS if s[0] in train_names]
      times, workers = run_part(systems, lambda name: ["train"], base, args, shared)
      not_run = {n: "packed batches: MarianMTModel has no attention within packed rows"
                 for n, _, _ in TRAIN_SYSTEMS if packed and not n.startswith("ours")}
      shape = batch["src"].shape
      result["train"] = {
          "batch": f"{shape[0]} rows x {shape[1]} ({'packed' if packed else 'one pair a row'})",
          "target_tokens": tokens, "model_flops": flops,
          "systems": rows(times.get("train", {}), workers, listed(TRAIN_SYSTEMS), lambda s: {
              "tokens_per_s": tokens / s, "gflops": flops / s / 1e9}, {**isa_skipped, **not_run}),
          "ratios": ratios(times.get("train", {}), TRAIN_PAIRS)}

    if decode_names:
      tasks_of = lambda name: ["greedy"] if name == "hf_compile" else ["greedy", "beam"]
      systems = [s for s in DECODE_SYSTEMS if s[0] in decode_names]
      times, workers = run_part(systems, tasks_of, base, args, shared)
      tokens = args.decode_batch * args.decode_len
      result["decode"] = {"tokens": tokens, "beam_size": args.beam_size}
      for task in ("greedy", "beam"):
        names = [n for n in listed(DECODE_SYSTEMS) if task in tasks_of(n)]
        task_times = best_of(times.get(task, {}))
        systems_rows = rows(task_times, workers, names, lambda s: {"tokens_per_s": tokens / s}, isa_skipped)
        for best, of in BEST_OF.items():
          if best in task_times:
            summary = harness.summary(task_times[best])
            systems_rows[best] = {"status": "ready", "best_of": list(of), **summary,
                                  "tokens_per_s": tokens / summary["median_s"]}
        result["decode"][task] = {"systems": systems_rows, "ratios": ratios(task_times, DECODE_PAIRS)}

  return harness.finish(result, args.out, report.render_run)


if __name__ == "__main__":
  main()
