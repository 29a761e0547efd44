"""A switch added to the model and nowhere else (docs/model.md, "Adding a switch") is safe by default: a
local attention window, added at test time as one more TransformerConfig field and one more rule in
model/attention.py's `visible`. Decoding leaves the CPU caches and kernels (which do not declare the
field), says so, and still equals teacher forcing; export refuses naming the field; the fused attention
kernels fall back naming it."""
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from export.weights import UnsupportedOption, check_exportable
from model import Compute, Transformer, TransformerConfig, attention, ops
from model.cache import KVCache
from model.ops import attention_impl, decoding_for
from test_family import SMALL, _tokens, assert_cached_decoding_equals_teacher_forcing, cpp_kernels


@dataclasses.dataclass(frozen=True)
class WindowConfig(TransformerConfig):
  attention_window: int = 0   # > 0: a query sees the keys at most this many positions away


@pytest.fixture
def windowed(monkeypatch):
  """model/attention.py's `visible` with the window: the whole of the switch's model logic."""
  plain = attention.visible

  def visible(cfg, q_segments, kv_segments, q_positions=None, kv_positions=None, causal=False):
    mask = plain(cfg, q_segments, kv_segments, q_positions, kv_positions, causal)
    window = getattr(cfg, "attention_window", 0)
    if window and q_positions is not None:   # self-attention (cross-attention has no shared positions)
      mask = mask & (jnp.abs(q_positions[:, :, None] - kv_positions[:, None, :]) <= window)[:, None]
    return mask
  monkeypatch.setattr(attention, "visible", visible)


def _cfg(arch, window=2, **compute):
  small = {**SMALL, "num_encoder_layers": 1, "num_decoder_layers": 1}   # one layer each: compiles fast
  return WindowConfig(**{**small, "compute": Compute(**{"kernels": "cpu", **compute})}, arch=arch,
                      attention_window=window)


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_decoding_falls_back_and_equals_teacher_forcing(windowed, arch, caplog, monkeypatch):
  monkeypatch.setattr(ops, "_SAID", set())   # what an earlier test said once is said again here
  cfg = _cfg(arch)
  params = Transformer(cfg).init(jax.random.key(0), jnp.ones((2, 9), jnp.int32), jnp.ones((2, 9), jnp.int32))
  with caplog.at_level(logging.WARNING, logger="model.ops"), cpp_kernels(True):
    decoding = decoding_for(cfg)
  assert isinstance(decoding.cache(True), KVCache) and decoding.layer_weights is None   # the plain path
  assert "attention_window=2" in caplog.text and "kernels/cpu_backend.py" in caplog.text
  with caplog.at_level(logging.WARNING, logger="model.ops"):
    caplog.clear()
    decoding_for(cfg)
  assert "attention_window" not in caplog.text   # said once
  # The window changes the model (so a cache that ignored it would be wrong) ...
  src, tgt = _tokens(1, (2, 9)), _tokens(2, (2, 9))
  wide = Transformer(cfg.replace(attention_window=0)).apply(params, src, tgt)
  assert np.abs(np.asarray(Transformer(cfg).apply(params, src, tgt) - wide)).max() > 1e-3
  # ... and decoding it, under every kernels setting, equals teacher forcing.
  assert_cached_decoding_equals_teacher_forcing(cfg, params["params"], seed=len(arch))


def test_export_refuses_naming_the_field():
  for fmt in ("hf", "ctranslate2"):
    check_exportable(_cfg("encoder_decoder", window=0), fmt)   # at its default, nothing is set
    with pytest.raises(UnsupportedOption, match=r"attention_window=2 \(the .* export holds"):
      check_exportable(_cfg("encoder_decoder"), fmt)


def test_the_fused_kernels_fall_back_naming_the_field(windowed, caplog, monkeypatch):
  monkeypatch.setattr(ops, "_SAID", set())
  # In bfloat16, cuDNN would take this attention: traced on a CPU it raises, so equal outputs show that
  # the windowed model never reaches it.
  cfg = _cfg("decoder_only", dtype="bfloat16", attention_impl="cudnn")
  with caplog.at_level(logging.WARNING, logger="model.ops"):
    assert attention_impl(cfg) == "xla"
  assert "attention_impl='cudnn'" in caplog.text and "attention_window=2" in caplog.text
  assert attention_impl(cfg.replace(attention_window=0)) == "cudnn"
  # The fused output layer and loss (train/step.py) compute the plain logits only: the full ones instead.
  assert not ops.ops_for(cfg).fused_loss and ops.ops_for(cfg.replace(attention_window=0)).fused_loss
  tokens = _tokens(3, (2, 9))
  params = Transformer(cfg).init(jax.random.key(0), None, tokens)
  xla = Transformer(cfg.with_compute(attention_impl="xla")).apply(params, None, tokens)
  np.testing.assert_array_equal(Transformer(cfg).apply(params, None, tokens), xla)
