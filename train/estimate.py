"""A run's cost before it starts: `--estimate` on `python -m train`, `jobs.submit` and `jobs.sweep` prints
its steps, tokens, model FLOPs, and projected hours and device-hours, then exits without starting anything.

    print(report(config, devices=8))            # a table over the devices of DEVICE_KINDS
    row = project(config, devices=8, device_kind="NVIDIA A100-SXM4-80GB")

MEASURED is the one table of measured step times the projection rests on; the rest is arithmetic:
  - a step's model FLOPs: train/flops.py's count for this config, on rows of 256 positions as measured;
  - its utilisation (MFU) at this many tokens per device: that of the measured model nearer in FLOPs per
    token (base or big), read off the line through its measured step times (fixed cost + cost per token);
  - another device is assumed to reach that MFU of its own data-sheet peak in the run's precision
    (train/flops.py's PEAKS): nobody has measured it, and a V100 computes bfloat16 in float32;
  - on several devices each holds tokens / devices, accumulation splits them further, and the gradient
    all-reduce between devices is not counted.
Read your run's own `train/mfu` and `train/tokens_per_sec` in metrics.jsonl once it runs, and scale.
"""
from __future__ import annotations

import dataclasses
import math

import ml_collections

import run
from train import flops

SEQ_LEN = 256   # positions a row in the measurements below


@dataclasses.dataclass(frozen=True)
class Line:
  """Measured step times of one model on one device: step_s = fixed_s + per_1k_s * tokens / 1000."""
  fixed_s: float
  per_1k_s: float
  flops_per_token: float     # the benchmark's model FLOPs a step / its tokens a step
  tokens: tuple[int, int]    # the measured range of tokens per device


# One NVIDIA H200, jax 0.11.2, bfloat16, rows of 256 positions, tokens counted per side as
# config.data.batch_tokens counts them: docs/accelerators.md ("The check") and REPRODUCING.md, from
# benchmarks/results/accelerators/h200-2026-11-27-check.json (base) and -check-big.json (big).
MEASURED_ON = ("NVIDIA H200", 989e12)   # its device kind and bfloat16 peak
MEASURED = {
    "base": Line(fixed_s=5.44e-3, per_1k_s=1.230e-3, flops_per_token=3120562176000 / 7936,
                 tokens=(7936, 32000)),
    "big": Line(fixed_s=4.96e-3, per_1k_s=3.073e-3, flops_per_token=10435159916544 / 7936,
                tokens=(7936, 32000)),
}
# The devices a report lists: one per entry of train/flops.py's PEAKS that labs are likely to have.
DEVICE_KINDS = ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB",
                "NVIDIA L40S", "NVIDIA A40", "NVIDIA A10", "NVIDIA L4", "Tesla V100-SXM2-32GB",
                "NVIDIA B200", "TPU v4", "TPU v5 lite", "TPU v5p", "TPU v6 lite")


@dataclasses.dataclass(frozen=True)
class Projection:
  device_kind: str
  devices: int
  step_s: float
  mfu: float
  hours: float

  @property
  def device_hours(self) -> float:
    return self.hours * self.devices


def _model(config: ml_collections.ConfigDict):
  vocab_size = int(config.data.get("vocab_size", 0) or 32_000)
  return run.model_config(config, vocab_size)


def flops_per_token(config: ml_collections.ConfigDict) -> float:
  """Model FLOPs of a training step per token of batch_tokens, on rows of SEQ_LEN positions."""
  return flops.train_step_flops(_model(config), 1, SEQ_LEN, SEQ_LEN) / SEQ_LEN


def reference(per_token: float) -> tuple[str, Line]:
  """The measured model nearer (in log FLOPs per token) to a model of `per_token` FLOPs per token."""
  name = min(MEASURED, key=lambda key: abs(math.log(MEASURED[key].flops_per_token / per_token)))
  return name, MEASURED[name]


def measured_mfu(line: Line, tokens: float) -> float:
  """The MFU the measured model reached on MEASURED_ON at `tokens` tokens per device (its line)."""
  return line.flops_per_token * tokens / ((line.fixed_s + line.per_1k_s * tokens / 1000) * MEASURED_ON[1])


def steps_and_tokens(config: ml_collections.ConfigDict) -> tuple[int, int]:
  steps = int(config.train.num_steps)
  return steps, steps * int(config.data.batch_tokens)


def project(config: ml_collections.ConfigDict, devices: int, device_kind: str) -> Projection | None:
  """The run's projected step time and hours on `devices` devices of `device_kind` (None: not in PEAKS)."""
  cfg = _model(config)
  peak = flops.table_peak(device_kind, flops.compute_dtype(cfg))
  if peak is None:
    return None
  accum = int(config.train.get("grad_accum_steps", 1) or 1)
  tokens = int(config.data.batch_tokens) / devices / accum   # per device, per micro-step
  per_token = flops_per_token(config)
  mfu = measured_mfu(reference(per_token)[1], tokens)
  step_s = accum * per_token * tokens / (peak * mfu)
  return Projection(device_kind, devices, step_s, mfu, step_s * int(config.train.num_steps) / 3600)


def report(config: ml_collections.ConfigDict, devices: int, kinds=DEVICE_KINDS, what: str = "the run") -> str:
  """Lines for a terminal: the run's steps, tokens and FLOPs, then each device kind's projection."""
  steps, tokens = steps_and_tokens(config)
  per_token = flops_per_token(config)
  name, line = reference(per_token)
  per_device = int(config.data.batch_tokens) / devices
  accum = int(config.train.get("grad_accum_steps", 1) or 1)
  inside = line.tokens[0] <= per_device / accum <= line.tokens[1]
  out = [f"[estimate] {what}: {steps:,} steps x {int(config.data.batch_tokens):,} tokens a step (source and "
         f"target each) = {tokens:,} tokens; {per_token * int(config.data.batch_tokens):.2e} model FLOPs a "
         f"step, {per_token * tokens:.2e} in all",
         f"[estimate] on {devices} device{'s' if devices != 1 else ''} ({per_device:,.0f} tokens each a step), "
         f"at the MFU {name} reached at that size on one {MEASURED_ON[0]} (measured "
         f"{line.tokens[0]:,}-{line.tokens[1]:,} tokens{'' if inside else ': this size is outside, extrapolated'}"
         f"; train/estimate.py); other devices assumed to reach it of their own peak, unmeasured; no "
         f"all-reduce counted:",
         f"  {'device':<24} {'step':>10} {'MFU':>6} {'hours':>9} {'device-hours':>13}"]
  for kind in kinds:
    row = project(config, devices, kind)
    if row is not None:
      out.append(f"  {kind:<24} {row.step_s * 1000:>7.1f} ms {row.mfu:>6.1%} {row.hours:>9.2f} "
                 f"{row.device_hours:>13.1f}")
  return "\n".join(out)


def report_here(config: ml_collections.ConfigDict, devices) -> str:
  """report() for `devices` (this host's, jax.devices()): their kind on their count; on a CPU host, every
  kind of DEVICE_KINDS on one device."""
  devices = list(devices)
  if devices[0].platform == "cpu":
    return (report(config, 1) + "\n[estimate] no accelerator here: one device of each kind above; `python -m "
            "jobs.submit --nodes N --gpus_per_node G --estimate -- FLAGS` projects a job's devices")
  kind = devices[0].device_kind
  if flops.table_peak(kind, "bfloat16") is None:
    return (report(config, len(devices)) + f"\n[estimate] {kind} is not in train/flops.py's PEAKS: the table "
            f"shows the known devices on {len(devices)}")
  return report(config, len(devices), kinds=(kind,))


def gpu_kinds(gpus: int) -> tuple[str, ...]:
  """The kinds a job with `gpus` GPUs may run on: the GPUs of DEVICE_KINDS, or all where it asks for none."""
  return tuple(k for k in DEVICE_KINDS if not k.startswith("TPU")) if gpus else DEVICE_KINDS


def for_job(config: ml_collections.ConfigDict, nodes: int, gpus_per_node: int) -> str:
  """report() for a SLURM job of `nodes` x `gpus_per_node` GPUs (no GPUs: one device of each kind)."""
  return report(config, max(1, nodes * gpus_per_node), gpu_kinds(gpus_per_node))


def for_sweep(trials: list[tuple[str, ml_collections.ConfigDict]], devices: int, kinds=DEVICE_KINDS) -> str:
  """A sweep's trials, each run on `devices` devices: each trial's steps and tokens, then per device kind
  the hours of all trials one after another and their device-hours."""
  out = []
  for name, config in trials:
    steps, tokens = steps_and_tokens(config)
    out.append(f"[estimate] trial {name}: {steps:,} steps, {tokens:,} tokens, "
               f"{flops_per_token(config) * tokens:.2e} model FLOPs")
  out += [f"[estimate] {len(trials)} trials on {devices} device{'s' if devices != 1 else ''} each, at the MFU "
          f"measured on one {MEASURED_ON[0]} (train/estimate.py); other devices assumed to reach it, unmeasured:",
          f"  {'device':<24} {'hours, in turn':>15} {'device-hours':>13}"]
  for kind in kinds:
    rows = [project(config, devices, kind) for _, config in trials]
    if rows and all(row is not None for row in rows):
      hours = sum(row.hours for row in rows)
      out.append(f"  {kind:<24} {hours:>15.2f} {hours * devices:>13.1f}")
  return "\n".join(out)
