"""train/flops.py: model FLOPs from the config agree with the compiled step; peaks; the MFU meter."""
import functools
import json
import logging

import jax
import jax.numpy as jnp
import optax
import pytest

from model import Compute, Transformer, TransformerConfig
from train import flops
from train import step as step_lib

# The formula counts the matmuls; the compiled step also does elementwise work (softmax, norms, Adam),
# a few percent at these sizes.
TOLERANCE = 0.10


def _batch(rows, src_len, tgt_len):
  return {key: jnp.ones((rows, src_len if key.startswith("src") else tgt_len), jnp.int32)
          for key in ("src", "src_segments", "src_positions", "tgt_in", "tgt_out", "tgt_segments",
                      "tgt_positions")}


@pytest.mark.parametrize("family", [{}, dict(arch="decoder_only", activation="swiglu", num_kv_heads=2)])
def test_formula_matches_the_compiled_train_steps_cost_analysis(family):
  cfg = TransformerConfig(vocab_size=512, d_model=64, d_ff=256, num_heads=4, num_encoder_layers=1,
                          num_decoder_layers=1, max_len=64, compute=Compute(kernels="reference"), **family)
  model, tx = Transformer(cfg), optax.adam(1e-3)
  batch = _batch(8, 40, 48)
  state = jax.eval_shape(lambda key: step_lib.init_state(key, model, tx), jax.random.key(0))
  step = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, schedule=lambda s: 1e-3,
                                   label_smoothing=0.1, loss_chunk_tokens=0))
  cost = step.lower(state, batch, jax.random.key(0)).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  expected = flops.batch_flops(cfg, batch)
  assert expected == flops.train_step_flops(cfg, 8, 40, 48)
  assert expected <= cost["flops"] <= (1 + TOLERANCE) * expected, (cost["flops"], expected)


def test_formula_by_hand():
  """One encoder and one decoder layer, d=4, d_ff=8, 1 head, vocab 10, src 3, tgt 2 positions."""
  cfg = TransformerConfig(vocab_size=10, d_model=4, d_ff=8, num_heads=1, num_encoder_layers=1,
                          num_decoder_layers=1)
  attention = lambda q, kv: 2 * q * 4 * 4 + 2 * kv * 4 * 8 + 2 * q * kv * 8 + 2 * q * 4 * 4
  ffn = lambda n: 2 * n * 4 * 8 * 2
  forward = attention(3, 3) + ffn(3) + attention(2, 2) + attention(2, 3) + ffn(2) + 2 * 2 * 4 * 10
  assert flops.train_step_flops(cfg, 5, 3, 2) == 3 * 5 * forward


def test_peak_table_and_override():
  assert flops.table_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
  assert flops.table_peak("NVIDIA H100 PCIe", "bfloat16") == 756e12
  assert flops.table_peak("NVIDIA H200", "bfloat16") == 989e12
  assert flops.table_peak("NVIDIA A100-SXM4-40GB", "float32") == 156e12
  assert flops.table_peak("TPU v5 lite", "bfloat16") == 197e12
  assert flops.table_peak("TPU v5", "bfloat16") == 459e12
  assert flops.table_peak("TPU v6 lite", "bfloat16") == 918e12
  assert flops.table_peak("Some Future Chip", "bfloat16") is None
  cfg = TransformerConfig(compute=Compute(dtype="bfloat16"))
  assert flops.compute_dtype(cfg) == "bfloat16"
  assert flops.compute_dtype(TransformerConfig(compute=Compute(matmul_dtype="bfloat16"))) == "bfloat16"
  assert flops.peak_flops(jax.devices()[:4], cfg, override=2e12) == (8e12, "config.train.peak_flops")


@pytest.mark.parametrize("kind, bf16, fp32", [
    ("Tesla V100-SXM2-32GB", 15.7e12, 15.7e12),      # no bfloat16 units: its float32 peak
    ("Tesla V100-PCIE-16GB", 14e12, 14e12),
    ("NVIDIA A100-SXM4-40GB", 312e12, 156e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, 156e12),
    ("NVIDIA A100 80GB PCIe", 312e12, 156e12),
    ("NVIDIA A10", 125e12, 62.5e12),
    ("NVIDIA A40", 149.7e12, 74.8e12),
    ("NVIDIA L4", 121e12, 60e12),
    ("NVIDIA L40S", 362e12, 183e12),
    ("NVIDIA H100 80GB HBM3", 989e12, 495e12),        # SXM
    ("NVIDIA H100 PCIe", 756e12, 378e12),
    ("NVIDIA H200", 989e12, 495e12),
    ("NVIDIA B200", 2250e12, 1100e12),
    ("TPU v4", 275e12, 275e12),
    ("TPU v5 lite", 197e12, 197e12),                  # v5e
    ("TPU v5", 459e12, 459e12),                       # v5p
    ("TPU v5p", 459e12, 459e12),
    ("TPU v6 lite", 918e12, 918e12),                  # v6e
])
def test_each_device_kind_has_its_dense_peak(kind, bf16, fp32):
  assert (flops.table_peak(kind, "bfloat16"), flops.table_peak(kind, "float32")) == (bf16, fp32)


@pytest.mark.parametrize("kind", ["NVIDIA A10G", "NVIDIA L40", "TPU v3", "Some Future Chip"])
def test_a_name_that_only_contains_a_known_one_is_not_taken_for_it(kind):
  assert flops.table_peak(kind, "bfloat16") is None


class _Device:
  platform = "gpu"

  def __init__(self, kind):
    self.device_kind = kind


@pytest.fixture
def warnings_logged(monkeypatch):
  """The messages train/flops.py warns, with its once-per-process memory cleared (the "train" logger does
  not propagate to caplog's root handler once a command has called log_to_console)."""
  monkeypatch.setattr(flops, "_warned", set())
  messages = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = lambda record: messages.append(record.getMessage())
  flops.log.addHandler(handler)
  yield messages
  flops.log.removeHandler(handler)


def test_an_unknown_device_warns_once_naming_the_config_key(warnings_logged):
  cfg = TransformerConfig(compute=Compute(dtype="bfloat16"))
  for _ in range(3):
    assert flops.peak_flops([_Device("NVIDIA Z9")] * 2, cfg)[0] == 0.0
  warnings = warnings_logged
  assert len(warnings) == 1 and "unknown device 'NVIDIA Z9'" in warnings[0], warnings
  assert "--config.train.peak_flops=" in warnings[0]
  assert flops.peak_flops([_Device("NVIDIA Z9")], cfg, override=5e12) == (5e12, "config.train.peak_flops")


def test_a_bfloat16_run_on_a_v100_says_it_computes_in_float32(warnings_logged):
  cfg = TransformerConfig(compute=Compute(dtype="bfloat16"))
  peak, source = flops.peak_flops([_Device("Tesla V100-SXM2-32GB")] * 8, cfg)
  flops.peak_flops([_Device("Tesla V100-SXM2-32GB")] * 8, cfg)
  assert peak == 8 * 15.7e12 and "float32 data sheet (no bfloat16 units)" in source
  warnings = warnings_logged
  assert len(warnings) == 1 and "no bfloat16 matmul units" in warnings[0] and "15.7 TFLOP/s" in warnings[0]
  # A float32 run has nothing to be told.
  assert flops.peak_flops([_Device("NVIDIA A100-SXM4-80GB")], TransformerConfig())[0] == 156e12
  assert len(warnings) == 1


def test_cpu_peak_keeps_the_highest_probe(tmp_path, monkeypatch):
  monkeypatch.setenv("AIAYN_CACHE", str(tmp_path))
  probes = iter([100e9, 150e9, 120e9])   # the second probe ran on a quieter machine
  monkeypatch.setattr(flops, "probe_peak", lambda dtype: next(probes))
  cfg = TransformerConfig()
  peaks = [flops.peak_flops(jax.devices(), cfg)[0] for _ in range(3)]   # the host's, whatever the fake devices
  assert peaks == [100e9, 150e9, 150e9]
  assert list(json.loads((tmp_path / "peak_flops.json").read_text()).values()) == [150e9]


def test_probe_measures_a_matmul():
  assert 1e8 < flops.probe_peak("float32", size=256, repeats=2) < 1e15


def test_meter_reports_flops_and_mfu():
  cfg = TransformerConfig(vocab_size=100, d_model=8, d_ff=16, num_heads=2, num_encoder_layers=1,
                          num_decoder_layers=1)
  meter = flops.Meter(cfg, peak=1e9, processes=2)
  meter.add(_batch(4, 6, 5))
  meter.add(_batch(4, 8, 7))
  report = meter.report(2.0)
  total = flops.train_step_flops(cfg, 4, 6, 5) + flops.train_step_flops(cfg, 4, 8, 7)
  assert report["train/model_flops_per_step"] == 2 * total / 2
  assert report["train/mfu"] == pytest.approx(total / 2.0 / 1e9)
  assert meter.report(1.0)["train/model_flops_per_step"] == 0   # counts restart after each report
