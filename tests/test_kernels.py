"""The CPU fast paths of kernels/ against the reference model: the switch, and equal results.

Per-kernel tests live beside their reference: the mixed matmul in test_precision.py, the 16-bit dropout
in test_dropout.py, the fused loss in test_train_step.py, the beam-slot search in test_beam_search.py,
cached decoding with either cache in test_model.py.
"""
import functools

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels import cpu_decoding, dropout16, flat_matmul
from model import Transformer, TransformerConfig, init_cache, reorder_cache
from model.ops import ops_for

SMALL = TransformerConfig(vocab_size=40, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2,
                          num_decoder_layers=2, dropout_rate=0.0, max_len=32)


def random_ids(rng, shape):
  """Token ids int32 `shape` of SMALL's vocabulary, past the special ids."""
  return jnp.asarray(rng.integers(3, 40, size=shape), jnp.int32)


def test_auto_picks_the_fast_paths_on_the_cpu_backend_only(monkeypatch):
  assert jax.default_backend() == "cpu"
  assert kernels.resolve("auto") == "cpu" and ops_for(SMALL).fused_loss
  assert kernels.resolve("reference") == "reference" and kernels.resolve("cpu") == "cpu"
  for backend in ("gpu", "tpu"):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert kernels.resolve("auto") == "reference"
    ops = ops_for(SMALL)
    # the chunked loss is every path's; the CPU's dropout and matmuls are not
    assert ops.fused_loss and ops.dropout is nn.Dropout and ops.dot_general is None
  with pytest.raises(ValueError, match="kernels='fast' is not one of"):
    kernels.resolve("fast")


def _dot_ranks(fn, *args):
  """(lhs rank, rhs rank) of every dot_general in fn's jaxpr, nested jaxprs included."""
  ranks = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        ranks.append(tuple(v.aval.ndim for v in eqn.invars))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return ranks


def test_flat_matmul_runs_attention_projections_and_their_gradients_as_2d_matmuls():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.float32)
  w_in = jnp.asarray(rng.standard_normal((16, 4, 8)), jnp.float32)     # [d_model, heads, d_k]
  w_out = jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32)    # [heads, d_v, d_model]

  def layer(dot_general, x, w_in, w_out):
    h = dot_general(x, w_in, (((2,), (0,)), ((), ())))                   # [3, 5, 4, 8]
    return jnp.sum(dot_general(h, w_out, (((2, 3), (0, 1)), ((), ()))) ** 2)

  grad = lambda dg: jax.grad(functools.partial(layer, dg), argnums=(0, 1, 2))
  want, got = grad(jax.lax.dot_general)(x, w_in, w_out), grad(flat_matmul.dot_general)(x, w_in, w_out)
  for g, w in zip(got, want):
    assert g.shape == w.shape
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)
  assert all(r == (2, 2) for r in _dot_ranks(grad(flat_matmul.dot_general), x, w_in, w_out))
  assert any(r != (2, 2) for r in _dot_ranks(grad(jax.lax.dot_general), x, w_in, w_out))
  # Products with batch axes (attention's) or contractions elsewhere are lax.dot_general's, unchanged.
  q = jnp.asarray(rng.standard_normal((3, 5, 4, 8)), jnp.float32)
  batched = (((3,), (3,)), ((0, 2), (0, 2)))
  np.testing.assert_array_equal(flat_matmul.dot_general(q, q, batched), jax.lax.dot_general(q, q, batched))
  assert _dot_ranks(lambda a: flat_matmul.dot_general(a, a, batched), q) == [(4, 4)]
  assert ops_for(SMALL.with_compute(kernels="cpu")).dot_general is flat_matmul.dot_general


def _loss_and_grads(cfg, params, src, tgt, dropout_key=None):
  model = Transformer(cfg)

  def loss(p):
    rngs = None if dropout_key is None else {"dropout": dropout_key}
    logits = model.apply({"params": p}, src, tgt, deterministic=dropout_key is None, rngs=rngs)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 5]), logits
  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


@pytest.mark.parametrize("changes", [{}, dict(share_embeddings=False, pre_norm=True)])
def test_cpu_model_equals_reference_in_float32(changes):
  """Same logits and gradients (float32 rounding apart): the fast paths change layout, not arithmetic."""
  rng = np.random.default_rng(0)
  src, tgt = random_ids(rng, (3, 7)), random_ids(rng, (3, 6))
  reference = SMALL.replace(**changes).with_compute(kernels="reference")
  params = Transformer(reference).init(jax.random.key(0), src, tgt)["params"]
  (_, want), want_grads = _loss_and_grads(reference, params, src, tgt)
  (_, got), got_grads = _loss_and_grads(reference.with_compute(kernels="cpu"), params, src, tgt)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for g, w in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_cpu_mixed_precision_equals_rounded_reference():
  """bfloat16 matmul operands: both round the same operands and accumulate in float32, so the logits
  agree to float32 rounding; the gradients differ only where the custom gradient also rounds the
  cotangent to bfloat16 (the reference's autodiff keeps it float32), i.e. at bfloat16 precision."""
  rng = np.random.default_rng(1)
  src, tgt = random_ids(rng, (3, 7)), random_ids(rng, (3, 6))
  reference = SMALL.with_compute(kernels="reference", matmul_dtype="bfloat16")
  params = Transformer(reference).init(jax.random.key(0), src, tgt)["params"]
  (_, want), want_grads = _loss_and_grads(reference, params, src, tgt)
  (_, got), got_grads = _loss_and_grads(reference.with_compute(kernels="cpu"), params, src, tgt)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  (_, exact), _ = _loss_and_grads(SMALL.with_compute(kernels="reference"), params, src, tgt)
  assert float(jnp.max(jnp.abs(want - exact))) > 1e-3        # the reference really rounds
  flat = lambda gs: jnp.concatenate([g.ravel() for g in jax.tree_util.tree_leaves(gs)])
  g, w = flat(got_grads), flat(want_grads)
  assert float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) < 2e-2


def test_both_dropouts_drop_at_the_configured_rate():
  """nn.Dropout (reference) and the 16-bit dropout: the same keep rate within sampling noise, zeros
  where dropped, kept elements scaled so that the mean is unchanged."""
  x = jnp.ones((200_000,), jnp.float32)
  key = jax.random.key(3)
  for cls in (nn.Dropout, dropout16.Dropout):
    y = np.asarray(cls(0.3).apply({}, x, deterministic=False, rngs={"dropout": key}))
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 5 * np.sqrt(0.7 * 0.3 / x.size), cls
    assert abs(y.mean() - 1.0) < 0.01, cls
    np.testing.assert_allclose(y[kept], y[kept][0], rtol=1e-6)


def _greedy_logits(cfg, params, src, steps, beam_slots=False, hyps=1):
  model = Transformer(cfg)

  @jax.jit
  def run(params, src):
    variables = {"params": params}
    memory = model.apply(variables, model.apply(variables, src, method="encode"),
                         method="prepare_decoding")
    cache = init_cache(cfg, src.shape[0] * hyps, steps, beam_slots=beam_slots)
    ids = jnp.full((src.shape[0] * hyps,), 2, jnp.int32)
    out = []
    for _ in range(steps):
      logits, cache = model.apply(variables, ids, cache, memory, src != 0, method="decode_step")
      ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      cache = reorder_cache(cfg, cache, jnp.arange(ids.shape[0]))   # the identity reorder
      out.append(logits)
    return jnp.stack(out, axis=1)
  return run(params, src)


@pytest.mark.parametrize("matmul_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("beam_slots", [False, True])
@pytest.mark.parametrize("ffi", [True, False])
def test_cpu_decoding_caches_and_output_layer_equal_reference(matmul_dtype, beam_slots, ffi, monkeypatch):
  """Head-major caches stored in the matmul dtype, beam slots and the pre-transposed output layer give
  the reference cache's logits, step after step, with the C++ attention (float32) and without it."""
  if not ffi:
    monkeypatch.setattr(cpu_decoding, "available", lambda: False)
  rng = np.random.default_rng(2)
  src = random_ids(rng, (2, 6)).at[0, 4:].set(0)
  reference = SMALL.with_compute(kernels="reference", matmul_dtype=matmul_dtype)
  params = Transformer(reference).init(jax.random.key(0), src, src)["params"]
  params = jax.tree.map(lambda p: p + 0.05, params)                  # biases that are not zero
  want = _greedy_logits(reference, params, src, 5, beam_slots, hyps=3)
  got = _greedy_logits(reference.with_compute(kernels="cpu"), params, src, 5, beam_slots, hyps=3)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_reference_cache_is_position_major_and_cpu_cache_head_major_and_rounded():
  cfg = SMALL.with_compute(kernels="reference", matmul_dtype="bfloat16")
  ref = init_cache(cfg, 4, 10, beam_slots=True)
  assert ref["layers"][0]["k"].shape == (4, 10, 4, 8) and ref["layers"][0]["k"].dtype == jnp.float32
  assert "slot_history" not in ref
  head_major = init_cache(cfg.with_compute(kernels="cpu"), 4, 10, beam_slots=False)
  assert head_major["layers"][0]["k"].shape == head_major["layers"][0]["v"].shape == (4, 4, 10, 8)
  cpu = init_cache(cfg.with_compute(kernels="cpu"), 4, 10, beam_slots=True)
  # Beam slots keep keys with positions last, [n, h, d_k, L]; values head-major [n, h, L, d_v].
  assert cpu["layers"][0]["k"].shape == (4, 4, 8, 10) and cpu["layers"][0]["k"].dtype == jnp.bfloat16
  assert cpu["layers"][0]["v"].shape == (4, 4, 10, 8)
  assert cpu["slot_history"].shape == (4, 10)
  reorder = functools.partial(reorder_cache, cfg.with_compute(kernels="cpu"))
  moved = reorder(dict(cpu, index=jnp.arange(4)), jnp.array([1, 1, 0, 3]))
  assert moved["layers"][0]["k"] is cpu["layers"][0]["k"]      # keys and values stay put
  np.testing.assert_array_equal(moved["index"], [1, 1, 0, 3])
