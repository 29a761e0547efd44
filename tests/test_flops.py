"""train/flops.py: model FLOPs from the config agree with the compiled step; peaks; the MFU meter."""
import functools
import json

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
