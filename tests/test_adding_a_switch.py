"""A switch added to the model and nowhere else (docs/model.md, "Adding a switch") is safe by default: a
local attention window, added at test time as one more TransformerConfig field and one more rule in
model/attention.py's `visible`, and attention-logit soft-capping (Gemma 2's), one more field and one more
line in model/attention.py's `scores`. Decoding leaves the CPU caches and kernels (which do not declare
the field), says so, and still equals teacher forcing; export refuses naming the field; the fused
attention kernels and the fused loss fall back naming it; the recorded attention maps show the change."""
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
from decode.attention_maps import forward_with_maps
from test_family import SMALL, _tokens, assert_cached_decoding_equals_teacher_forcing, cpp_kernels


@dataclasses.dataclass(frozen=True)
class WindowConfig(TransformerConfig):
  attention_window: int = 0   # > 0: a query sees the keys at most this many positions away
  attention_softcap: float = 0.0   # > 0: scores become cap * tanh(scores / cap)


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


@pytest.fixture
def capped(monkeypatch):
  """model/attention.py's `scores` with soft-capping: the whole of the switch's model logic."""
  plain = attention.scores

  def scores(cfg, q, k, bias=None, dot_general=None):
    logits = plain(cfg, q, k, bias, dot_general)
    cap = getattr(cfg, "attention_softcap", 0.0)
    return cap * jnp.tanh(logits / cap) if cap else logits
  monkeypatch.setattr(attention, "scores", scores)


def _cfg(arch, window=2, softcap=0.0, **compute):
  small = {**SMALL, "num_encoder_layers": 1, "num_decoder_layers": 1}   # one layer each: compiles fast
  return WindowConfig(**{**small, "compute": Compute(**{"kernels": "cpu", **compute})}, arch=arch,
                      attention_window=window, attention_softcap=softcap)


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
    assert attention_impl(cfg) == ("xla", ())
  assert "attention_impl='cudnn'" in caplog.text and "attention_window=2" in caplog.text
  assert attention_impl(cfg.replace(attention_window=0)) == ("cudnn", ("cudnn",))
  # The fused output layer and loss (train/step.py) compute the plain logits only: the full ones instead.
  assert not ops.ops_for(cfg).fused_loss and ops.ops_for(cfg.replace(attention_window=0)).fused_loss
  tokens = _tokens(3, (2, 9))
  params = Transformer(cfg).init(jax.random.key(0), None, tokens)
  xla = Transformer(cfg.with_compute(attention_impl="xla")).apply(params, None, tokens)
  np.testing.assert_array_equal(Transformer(cfg).apply(params, None, tokens), xla)


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder_only"])
def test_a_change_to_the_scores_reaches_the_model_its_maps_and_decoding(capped, arch, caplog, monkeypatch):
  """Soft-capping, written once in `scores`: the model computes it, the recorded attention maps
  (decode/attention_maps.py) show it, decoding falls back from the CPU caches and equals teacher forcing,
  and every fast path falls back naming the field."""
  monkeypatch.setattr(ops, "_SAID", set())
  cfg = _cfg(arch, window=0, softcap=0.5)
  plain = cfg.replace(attention_softcap=0.0)
  src, tgt = _tokens(1, (1, 7)), _tokens(2, (1, 7))
  params = Transformer(cfg).init(jax.random.key(0), src, tgt)
  # Large enough queries and keys that the cap changes the scores: the weights of one attention scaled up.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x * 8.0 if any(getattr(p, "key", None) in ("query", "key") for p in path) else x, params)
  src_ids = [] if arch == "decoder_only" else [int(x) for x in src[0]]
  with caplog.at_level(logging.WARNING, logger="model.ops"):
    capped_logits, capped_maps = forward_with_maps(Transformer(cfg), params["params"], src_ids,
                                                   [int(x) for x in tgt[0]])
    ops.decoding_for(cfg)
  plain_logits, plain_maps = forward_with_maps(Transformer(plain), params["params"], src_ids,
                                               [int(x) for x in tgt[0]])
  assert np.abs(capped_logits - plain_logits).max() > 1e-3
  # The maps show the capped attention, the first of each stack too (the same queries and keys as the
  # plain model's: only the scores' cap can move its weights).
  assert capped_maps.keys() == plain_maps.keys()
  for key, weights in capped_maps.items():
    assert np.abs(weights - plain_maps[key]).max() > 1e-3, key
  for path in ("kernels/cpu_backend.py's DECODING", "CUDNN", "SPLASH", "FUSED_LOSS"):
    assert any(path in r.getMessage() and "attention_softcap=0.5" in r.getMessage()
               for r in caplog.records), path
  with cpp_kernels(True):
    assert_cached_decoding_equals_teacher_forcing(cfg, params["params"], seed=len(arch) + 1)
