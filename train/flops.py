"""A model's size: its parameters, model FLOPs per training step, the devices' peak, and MFU
(docs/mfu.md).

    count = num_params(cfg)                                    # what init creates, from its shapes
    flops = train_step_flops(cfg, rows, src_len, tgt_len)      # from the config and the batch shape
    peak = peak_flops(jax.devices(), cfg, override=config.train.peak_flops)
    meter = Meter(cfg, peak); meter.add(batch) per step; meter.report(seconds) per log line

Model FLOPs count the matmuls of the forward pass, times 3 for the backward pass (each product has two
gradient products of its size), over the batch's padded shape [rows, len], as the compiled step
computes them: causal self-attention counts its full [len, len] scores, and remat's recomputation is not
counted (it is hardware FLOPs, not model FLOPs). MFU = model FLOPs per second / the devices' peak.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import platform
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from model import Transformer, TransformerConfig
from model.config import as_dtype

log = logging.getLogger(__name__)

# Dense (no sparsity) peak matmul FLOP/s per device, from the vendors' data sheets, by jax's device_kind
# (a regular expression, searched case-blind, first match wins: the specific names before the general).
# float32 is what XLA runs a float32 matmul at by default: TF32 tensor cores on NVIDIA GPUs from Ampere
# on, one bfloat16 pass on TPUs (jax_default_matmul_precision='highest' is slower than this peak).
# Sources (dense figures; the sheets print twice these "with sparsity"):
#   V100: NVIDIA Tesla V100 data sheet: FP32 15.7 (SXM2) / 14 (PCIe) / 16.4 (V100S) TFLOPS. It has no
#     bfloat16 units; see NO_BF16.
#   A100 40/80 GB (SXM, PCIe): NVIDIA A100 data sheet: BF16 312, TF32 156.
#   A10: NVIDIA A10 data sheet: BF16 125, TF32 62.5.   A40: NVIDIA A40 data sheet: BF16 149.7, TF32 74.8.
#   L4: NVIDIA L4 data sheet: BF16 121, TF32 60.       L40S: NVIDIA L40S data sheet: BF16 362, TF32 183.
#   H100 SXM: BF16 989, TF32 495; H100 PCIe: 756, 378; H100 NVL: 835, 418 (NVIDIA H100 data sheet).
#   H200 (SXM): BF16 989, TF32 495; H200 NVL: 835, 418 (NVIDIA H200 data sheet).
#   B200: NVIDIA HGX B200 data sheet (per GPU): BF16 2,250, TF32 1,100.
#   TPU v4 275, v5e 197, v5p 459, v6e (Trillium) 918 bf16 TFLOPS per chip (Google Cloud TPU system
#     architecture pages); jax names v5e "TPU v5 lite", v5p "TPU v5" or "TPU v5p", v6e "TPU v6 lite".
PEAKS = (
    (r"V100S", {"bfloat16": 16.4e12, "float32": 16.4e12}),
    (r"V100.*PCIE", {"bfloat16": 14e12, "float32": 14e12}),
    (r"V100", {"bfloat16": 15.7e12, "float32": 15.7e12}),           # SXM2
    (r"A100", {"bfloat16": 312e12, "float32": 156e12}),             # 40 GB and 80 GB, SXM4 and PCIe
    (r"\bA10\b", {"bfloat16": 125e12, "float32": 62.5e12}),         # not the A10G
    (r"\bA40\b", {"bfloat16": 149.7e12, "float32": 74.8e12}),
    (r"L40S", {"bfloat16": 362e12, "float32": 183e12}),
    (r"\bL4\b", {"bfloat16": 121e12, "float32": 60e12}),
    (r"H100.*PCIE", {"bfloat16": 756e12, "float32": 378e12}),
    (r"H[12]00.*NVL", {"bfloat16": 835e12, "float32": 418e12}),
    (r"H100", {"bfloat16": 989e12, "float32": 495e12}),             # SXM5: "NVIDIA H100 80GB HBM3"
    (r"H200", {"bfloat16": 989e12, "float32": 495e12}),             # the H100's chip, more and faster memory
    (r"B200", {"bfloat16": 2250e12, "float32": 1100e12}),
    (r"TPU v4", {"bfloat16": 275e12, "float32": 275e12}),
    (r"TPU v5 ?lite|TPU v5e", {"bfloat16": 197e12, "float32": 197e12}),
    (r"TPU v5p?\b", {"bfloat16": 459e12, "float32": 459e12}),
    (r"TPU v6 ?lite|TPU v6e", {"bfloat16": 918e12, "float32": 918e12}),
)
# Devices without bfloat16 matmul units: XLA runs a bfloat16 matmul there in float32, so a bfloat16 run's
# peak is the float32 one (PEAKS holds it under both keys), and the run says so once.
NO_BF16 = (r"V100",)
_warned: set[str] = set()   # device kinds already warned about, once per process


# ----------------------------------------------------------------------------------------------------
# Parameters.
# ----------------------------------------------------------------------------------------------------
def num_params(cfg: TransformerConfig) -> int:
  """Parameters `Transformer(cfg).init` creates (with the classification head where cfg has one), from
  jax.eval_shape: nothing is allocated or computed."""
  model = Transformer(cfg)
  ids = jnp.ones((1, 4), jnp.int32)   # [batch, length]: any shape within max_len gives the same params

  def init():
    params = model.init(jax.random.key(0), ids, ids)["params"]
    if cfg.num_classes:   # the pooler and classifier exist only on the classify path
      params = {**params, **model.init(jax.random.key(0), ids, method="classify")["params"]}
    return params

  return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(jax.eval_shape(init)))


# ----------------------------------------------------------------------------------------------------
# Model FLOPs.
# ----------------------------------------------------------------------------------------------------
def _attention(cfg: TransformerConfig, q: int, kv: int) -> int:
  """Matmul FLOPs of one attention sub-layer: q queries over kv keys and values (one row)."""
  d, h, g, dk, dv = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim_k, cfg.head_dim_v
  projections = 2 * q * d * h * dk + 2 * kv * d * g * (dk + dv) + 2 * q * h * dv * d   # Q; K, V; output
  return projections + 2 * q * kv * h * (dk + dv)                                    # scores; weighted values


def _ffn(cfg: TransformerConfig, n: int) -> int:
  inputs = 2 if cfg.activation in ("swiglu", "geglu") else 1
  return 2 * n * cfg.d_model * cfg.d_ff * (inputs + 1)


def forward_flops(cfg: TransformerConfig, src_len: int, tgt_len: int) -> int:
  """Matmul FLOPs of the forward pass over one row of src_len source and tgt_len target positions."""
  d, vocab = cfg.d_model, cfg.vocab_size
  total = 0
  if cfg.arch != "decoder_only":
    total += cfg.num_encoder_layers * (_attention(cfg, src_len, src_len) + _ffn(cfg, src_len))
  if cfg.arch == "encoder_only":
    return total + 2 * src_len * d * d + 2 * src_len * d * vocab   # MLM head: transform, output
  cross = _attention(cfg, tgt_len, src_len) if cfg.arch == "encoder_decoder" else 0
  total += cfg.num_decoder_layers * (_attention(cfg, tgt_len, tgt_len) + cross + _ffn(cfg, tgt_len))
  return total + 2 * tgt_len * d * vocab                            # logits


def train_step_flops(cfg: TransformerConfig, rows: int, src_len: int, tgt_len: int) -> int:
  """Model FLOPs of one training step on a batch [rows, src_len] / [rows, tgt_len]: 3x the forward."""
  return 3 * rows * forward_flops(cfg, src_len, tgt_len)


def batch_flops(cfg: TransformerConfig, batch) -> int:
  """train_step_flops for a batch dict (its 'src' and 'tgt_in' shapes; decoder-only reads tgt_in)."""
  rows, tgt_len = np.shape(batch["tgt_in"])
  src_len = np.shape(batch["src"])[1] if "src" in batch else 0
  return train_step_flops(cfg, rows, src_len, tgt_len)


# ----------------------------------------------------------------------------------------------------
# Peak.
# ----------------------------------------------------------------------------------------------------
def compute_dtype(cfg: TransformerConfig) -> str:
  """'bfloat16' where the matmul operands are 16-bit, else 'float32'."""
  dtype = as_dtype(cfg.compute.matmul_dtype or cfg.compute.dtype)
  return "float32" if dtype == jnp.float32 else "bfloat16"


def table_peak(device_kind: str, dtype: str) -> float | None:
  """The data-sheet peak of one device of this kind, or None for a kind the table does not know."""
  for pattern, peaks in PEAKS:
    if re.search(pattern, device_kind, re.IGNORECASE):
      return peaks[dtype]
  return None


def lacks_bf16(device_kind: str) -> bool:
  return any(re.search(pattern, device_kind, re.IGNORECASE) for pattern in NO_BF16)


def _warn_once(device_kind: str, message: str) -> None:
  if device_kind not in _warned:
    _warned.add(device_kind)
    log.warning(message)


def _cache_file() -> pathlib.Path:
  root = os.environ.get("AIAYN_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                       os.path.expanduser("~/.cache"), "aiayn")
  return pathlib.Path(root) / "peak_flops.json"


def _cpu_name() -> str:
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def probe_peak(dtype: str, size: int = 1024, repeats: int = 10) -> float:
  """FLOP/s of a [size, size] x [size, size] matmul on a local device: the median of `repeats` timed calls,
  so that one stray timing can neither raise nor lower it."""
  device = jax.local_devices()[0]   # addressable in every process of a multi-host job
  a = jax.device_put(np.ones((size, size), jnp.dtype(dtype)), device)   # no program to make it
  matmul = jax.jit(lambda a, b: a @ b)
  matmul(a, a).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * size ** 3 / float(np.median(times))


def measured_peak(dtype: str) -> float:
  """The CPU's matmul peak in `dtype`: probed at every call, and the highest probe seen on this CPU model,
  core count and jax version is kept in ~/.cache/aiayn/peak_flops.json ($AIAYN_CACHE), so a probe taken
  while the machine was busy reads low once and is then replaced by a later, quieter one."""
  key = f"{_cpu_name()}|{os.cpu_count()} cpus|jax {jax.__version__}|{dtype}"
  path = _cache_file()
  try:
    cached = json.loads(path.read_text())
  except (OSError, ValueError):
    cached = {}
  probed = probe_peak(dtype)
  if probed > cached.get(key, 0.0):
    cached[key] = probed
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      tmp = path.with_suffix(f".tmp{os.getpid()}")
      tmp.write_text(json.dumps(cached, indent=1, sort_keys=True) + "\n")
      tmp.replace(path)
    except OSError:
      pass   # a read-only home: this probe's number serves this run
  return float(max(cached.get(key, 0.0), probed))


def peak_flops(devices, cfg: TransformerConfig, override: float = 0.0) -> tuple[float, str]:
  """The peak FLOP/s of `devices` together for cfg's matmul dtype -> (FLOP/s, where it came from).

  override > 0: that many FLOP/s per device (config.train.peak_flops). A CPU's fake devices share the
  host, so its peak is the host's, the best matmul probe seen on it (`measured_peak`). An accelerator the table lacks: 0.
  """
  devices = list(devices)
  dtype = compute_dtype(cfg)
  if override and override > 0:
    return float(override) * len(devices), "config.train.peak_flops"
  if devices[0].platform == "cpu":
    return measured_peak(dtype), f"measured {dtype} matmul on this CPU"
  kind = devices[0].device_kind
  per_device = table_peak(kind, dtype)
  if per_device is None:
    _warn_once(kind, f"[flops] unknown device {kind!r}: train/mfu is logged as 0; set its dense {dtype} "
                     f"peak FLOP/s per device with --config.train.peak_flops=VALUE (from its data sheet)")
    return 0.0, f"unknown device {kind!r}: set config.train.peak_flops"
  if dtype == "bfloat16" and lacks_bf16(kind):
    _warn_once(kind, f"[flops] {kind} has no bfloat16 matmul units: XLA computes this run's bfloat16 "
                     f"matmuls in float32, so MFU is against its float32 peak ({per_device / 1e12:g} TFLOP/s); "
                     f"its float16 tensor cores are not used")
    return per_device * len(devices), f"{kind} float32 data sheet (no bfloat16 units) x {len(devices)}"
  return per_device * len(devices), f"{kind} {dtype} data sheet x {len(devices)}"


# ----------------------------------------------------------------------------------------------------
# The training loop's meter.
# ----------------------------------------------------------------------------------------------------
class Meter:
  """Adds up model FLOPs of the steps between two log lines; `report` turns them into metrics.

  peak: of the devices whose rows `add` sees (this process's); processes: how many processes share the
  step equally, so that model_flops_per_step is the whole step's."""

  def __init__(self, cfg: TransformerConfig, peak: float, processes: int = 1):
    self.cfg, self.peak, self.processes = cfg, peak, processes
    self.flops, self.steps = 0, 0

  def add(self, batch) -> None:
    self.flops += batch_flops(self.cfg, batch)
    self.steps += 1

  def report(self, seconds: float) -> dict:
    """{'train/model_flops_per_step', 'train/model_flops_per_sec', 'train/mfu'} since the last report."""
    per_sec = self.flops / max(seconds, 1e-9)
    out = {"train/model_flops_per_step": self.processes * self.flops / max(self.steps, 1),
           "train/model_flops_per_sec": self.processes * per_sec,
           "train/mfu": per_sec / self.peak if self.peak else 0.0}
    self.flops, self.steps = 0, 0
    return out
