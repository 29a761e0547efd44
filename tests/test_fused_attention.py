"""compute.attention_impl: the fused kernels compute the plain attention's numbers (splash in Pallas
interpret mode, which runs on this CPU), the model reads the same with any of them, and a setting a
kernel cannot take falls back to the plain attention, saying why once."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels import fused_attention
from model import Transformer, TransformerConfig
from model.attention import dot_product_attention, packed_mask

TINY = TransformerConfig(vocab_size=40, d_model=32, d_ff=64, num_heads=4, num_kv_heads=2, num_encoder_layers=1,
                         num_decoder_layers=1, max_len=256, dropout_rate=0.0)


def _segments(rng, b, length):
  """Packed rows: two or three sentences each, then padding (segment 0)."""
  seg = np.zeros((b, length), np.int32)
  for row in range(b):
    cuts = np.sort(rng.choice(np.arange(8, length - 8), 2, replace=False))
    seg[row, :cuts[0]], seg[row, cuts[0]:cuts[1]] = 1, 2
    seg[row, cuts[1]:length - 5 * row] = 3
  return jnp.asarray(seg)


@pytest.mark.parametrize("causal, q_len, kv_len", [
    (True, 128, 128), (True, 96, 96), pytest.param(False, 128, 256, marks=pytest.mark.slow), (False, 72, 200)],
    ids=["causal", "causal-padded", "full", "full-padded"])
def test_splash_in_interpret_mode_equals_the_plain_attention_and_its_gradient(causal, q_len, kv_len):
  """Grouped-query heads, packed segments with padding, cross lengths; lengths that are not whole blocks
  of 128 are padded inside splash (96 -> 128, 72 -> 128, 200 -> 256)."""
  rng = np.random.default_rng(0)
  b, h, g, d = 2, 4, 2, 16
  q = jnp.asarray(rng.normal(size=(b, q_len, h, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, kv_len, g, d)), jnp.float32) for _ in range(2))
  q_seg = _segments(rng, b, q_len)
  kv_seg = q_seg if causal else _segments(rng, b, kv_len)
  if not causal:   # queries of a sentence see only that sentence's keys: give every sentence keys
    kv_seg = jnp.where(kv_seg > 0, jnp.minimum(kv_seg, 3), 0)
  mask = packed_mask(q_seg, kv_seg, causal=causal)
  real = np.asarray(q_seg != 0)[:, :, None, None]              # padding queries differ (both discarded)

  def loss(fn, q, k, v):
    return jnp.sum(jnp.where(real, fn(q, k, v), 0.0) * jnp.sin(jnp.arange(d)))

  fused = lambda q, k, v: fused_attention.splash(q, k, v, mask, interpret=True)
  plain = lambda q, k, v: dot_product_attention(q, k, v, mask.dense)
  np.testing.assert_allclose(np.where(real, fused(q, k, v), 0), np.where(real, plain(q, k, v), 0),
                             atol=2e-5)
  got = jax.grad(lambda *a: loss(fused, *a), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(lambda *a: loss(plain, *a), argnums=(0, 1, 2))(q, k, v)
  for a, b_ in zip(got, want):
    np.testing.assert_allclose(a, b_, atol=5e-5)


def _logits(cfg, seed=0, length=128, packed=True, grads=False):
  """The model's logits on two rows (the second padded) and where they are real; grads: also the
  gradient of a loss over the real logits with respect to every parameter."""
  rng = np.random.default_rng(seed)
  src = jnp.asarray(rng.integers(3, 40, size=(2, length)), jnp.int32)
  tgt = jnp.asarray(rng.integers(3, 40, size=(2, length)), jnp.int32)
  src, tgt = src.at[1, 100:].set(0), tgt.at[1, 90:].set(0)      # padding
  params = Transformer(cfg.with_compute(attention_impl="xla")).init({"params": jax.random.key(0)}, src, tgt)
  model, real = Transformer(cfg, packed=packed), np.asarray(tgt != 0)
  logits = np.asarray(model.apply(params, src, tgt))
  if not grads:
    return logits, real
  loss = lambda p: jnp.sum(jnp.where(real[..., None], model.apply(p, src, tgt), 0.0).astype(jnp.float32) ** 2)
  return logits, real, jax.grad(loss)(params)


@pytest.mark.parametrize("positions, length", [("sinusoidal", 128), ("rope", 128), ("sinusoidal", 112)])
def test_the_model_reads_the_same_with_splash(positions, length):
  """Self-, causal and cross-attention through splash (interpret mode); RoPE rotates q and k before; a
  bucket of 112 positions is padded to 128 inside splash."""
  cfg = TINY.replace(positions=positions)
  want, real = _logits(cfg.with_compute(attention_impl="xla"), length=length)
  got, _ = _logits(cfg.with_compute(attention_impl="splash"), length=length)
  np.testing.assert_allclose(got[real], want[real], atol=1e-4)


def test_auto_on_this_cpu_is_the_plain_attention_bit_for_bit():
  """auto traces splash for a TPU (lengths 128), but a program lowered for the CPU keeps XLA's."""
  want, _ = _logits(TINY.with_compute(attention_impl="xla"))
  got, _ = _logits(TINY.with_compute(attention_impl="auto"))
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl, changes, why", [
    ("splash", dict(positions="alibi"), "splash attention adds no score bias"),
    ("splash", dict(positions="relative"), "splash attention adds no score bias"),
    ("splash", dict(), "is not a multiple of 128"),
    ("cudnn", dict(), "cuDNN's flash attention takes bfloat16 or float16"),
], ids=["splash-alibi", "splash-relative", "splash-length", "cudnn-float32"])
def test_a_setting_a_kernel_cannot_take_falls_back_visibly_once(impl, changes, why, caplog):
  cfg = TINY.replace(**changes)
  length = 40 if why.startswith("is not") else 128    # 40 -> 128 would be 3.2x: falls back
  fused_attention._SAID.clear()
  with caplog.at_level(logging.INFO, logger=fused_attention.__name__):
    got, _ = _logits(cfg.with_compute(attention_impl=impl), length=length)
    _logits(cfg.with_compute(attention_impl=impl), seed=1, length=length)        # traced again: no new line
  said = [r for r in caplog.records if why in r.getMessage()]
  assert len(said) == 1 and said[0].levelno == logging.WARNING
  want, real = _logits(cfg.with_compute(attention_impl="xla"), length=length)
  # (alibi and relative: the cross-attention, which has no bias, still takes splash)
  np.testing.assert_allclose(got[real], want[real], atol=1e-4)


def test_a_splash_kernel_this_jax_refuses_when_traced_falls_back_saying_why(monkeypatch, caplog):
  """Older jax versions' splash kernels refuse some shapes while tracing (head dimensions that are not
  multiples of 128): the TPU branch, traced where a program is lowered for a TPU (kernels.lowering_for;
  a plain jit on this CPU traces the CPU's branch only), then takes the plain attention."""
  def refuses(*args, **kwargs):
    raise NotImplementedError("head_dim_v=16 should be a multiple of 128")
  monkeypatch.setattr(fused_attention, "splash", refuses)
  fused_attention._SAID.clear()
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 128, 4, 16)), jnp.float32) for _ in range(3))
  segments = _segments(rng, 2, 128)
  mask = packed_mask(segments, segments, causal=True)
  plain = lambda q, k, v, mask, bias: dot_product_attention(q, k, v, mask.dense)
  with caplog.at_level(logging.INFO, logger=fused_attention.__name__), kernels.lowering_for(("tpu",)):
    got = jax.jit(lambda q, k, v, mask: fused_attention.attention("auto", q, k, v, mask, None, False, plain))(
        q, k, v, mask)
  assert [r for r in caplog.records if "splash attention cannot be traced here (head_dim_v=16" in r.getMessage()]
  np.testing.assert_array_equal(got, jax.jit(plain)(q, k, v, mask, None))


def test_cudnn_equals_the_plain_attention_on_a_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("cuDNN's attention runs on an NVIDIA GPU only; this backend is " + jax.default_backend())
  cfg = TINY.with_compute(dtype="bfloat16", attention_impl="cudnn")
  got, real = _logits(cfg)
  want, _ = _logits(cfg.with_compute(attention_impl="xla"))
  np.testing.assert_allclose(got[real], want[real], atol=5e-2)


def test_unpacked_rows_reach_cudnn_as_lengths_and_a_causal_flag_not_a_dense_mask(monkeypatch):
  """cuDNN cannot be traced on this CPU (jax's CUDA plugin is absent), so jax.nn.dot_product_attention is
  mocked at that boundary: with one sentence a row (Transformer(packed=False)) every attention hands it
  the rows' lengths, the decoder's self-attention the causal flag, and none a mask or a bias; a packed
  batch still hands it the dense mask. The mock computes with XLA's implementation, so the logits must
  equal the plain attention's."""
  calls = []
  real_attention = jax.nn.dot_product_attention

  def recorded(q, k, v, bias=None, mask=None, *, is_causal=False, query_seq_lengths=None,
               key_value_seq_lengths=None, implementation=None, **kwargs):
    calls.append(dict(bias=bias, mask=mask, causal=is_causal, q_lengths=query_seq_lengths,
                      kv_lengths=key_value_seq_lengths, implementation=implementation))
    return real_attention(q, k, v, bias, mask, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                          key_value_seq_lengths=key_value_seq_lengths, implementation="xla")

  monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)
  cfg = TINY.with_compute(dtype="bfloat16", attention_impl="cudnn")
  got, real = _logits(cfg, packed=False)
  assert [c["causal"] for c in calls] == [False, True, False]   # encoder, decoder self, cross
  for call in calls:
    assert call["implementation"] == "cudnn" and call["bias"] is None and call["mask"] is None
    assert call["q_lengths"].shape == (2,) and call["kv_lengths"].shape == (2,)
  np.testing.assert_array_equal(calls[1]["q_lengths"], [128, 90])    # the target rows' lengths
  np.testing.assert_array_equal(calls[2]["kv_lengths"], [128, 100])  # cross-attention reads the source's
  want, _ = _logits(cfg.with_compute(attention_impl="xla"))
  np.testing.assert_allclose(got[real].astype(np.float32), want[real].astype(np.float32), atol=5e-2)
  calls.clear()
  _logits(cfg, packed=True)
  assert all(c["mask"] is not None and c["q_lengths"] is None for c in calls)


def test_cudnn_with_lengths_is_as_close_to_float32_as_xla_in_bfloat16_on_a_gpu():
  """Forward and gradient of the unpacked path (lengths, causal flag) against the float32 plain
  attention: no further from it than XLA's own bfloat16 attention is (bf16 rounding alone moves a
  gradient by more than a fixed tolerance of its largest value), and equal to the dense-mask cuDNN."""
  if jax.default_backend() != "gpu":
    pytest.skip("cuDNN's attention runs on an NVIDIA GPU only; this backend is " + jax.default_backend())
  cfg = TINY.with_compute(dtype="bfloat16")
  want, real, want_grads = _logits(TINY.with_compute(attention_impl="xla"), grads=True)   # float32

  def errors(cfg, packed):
    got, _, grads = _logits(cfg, packed=packed, grads=True)
    leaves = zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads))
    grad = np.median([np.abs(np.asarray(a, np.float32) - b).max() / max(np.abs(b).max(), 1e-6) for a, b in leaves])
    return np.abs(got[real].astype(np.float32) - want[real]).max(), grad, grads

  xla_fwd, xla_grad, _ = errors(cfg.with_compute(attention_impl="xla"), packed=True)
  fwd, grad, grads = errors(cfg.with_compute(attention_impl="cudnn"), packed=False)
  _, _, dense_grads = errors(cfg.with_compute(attention_impl="cudnn"), packed=True)
  assert fwd <= 1.5 * xla_fwd + 1e-3 and grad <= 1.5 * xla_grad + 1e-3, (fwd, xla_fwd, grad, xla_grad)
  for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(dense_grads)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-2)
