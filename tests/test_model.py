"""Model invariants: causality, padding, packing, cached decoding, parameter counts, a numpy reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import Compute, Transformer, TransformerConfig, base, big, init_cache, reorder_cache
from model.embedding import sinusoid
from train.flops import num_params

SMALL = TransformerConfig(vocab_size=40, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2,
                          num_decoder_layers=2, dropout_rate=0.0, max_len=64)


def _init(cfg, src, tgt, seed=0):
  return jax.jit(Transformer(cfg).init)({"params": jax.random.key(seed)}, src, tgt)["params"]


def _forward(model):
  """The jitted teacher-forced forward pass (op-by-op Flax is slow on the CPU)."""
  return jax.jit(lambda params, src, tgt, **kw: model.apply({"params": params}, src, tgt, **kw))


def _random_ids(rng, shape, vocab=40):
  return jnp.asarray(rng.integers(3, vocab, size=shape), jnp.int32)


@pytest.fixture(scope="module")
def small():
  rng = np.random.default_rng(0)
  src = _random_ids(rng, (3, 7))
  tgt = _random_ids(rng, (3, 6))
  model = Transformer(SMALL)
  return _forward(model), _init(SMALL, src, tgt), rng


# ---------------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------------

def test_future_target_tokens_never_change_earlier_logits(small):
  model, params, rng = small
  src = _random_ids(rng, (2, 7))
  tgt = _random_ids(rng, (2, 6))
  base_logits = model(params, src, tgt)
  for t in range(1, 6):
    changed = tgt.at[:, t:].set(_random_ids(rng, (2, 6 - t)))
    logits = model(params, src, changed)
    np.testing.assert_array_equal(logits[:, :t], base_logits[:, :t])
    assert not np.allclose(logits[:, t], base_logits[:, t])  # the change is visible where it may be


def test_source_tokens_under_padding_never_change_outputs(small):
  model, params, rng = small
  src = _random_ids(rng, (2, 8)).at[0, 5:].set(0).at[1, 3:].set(0)
  tgt = _random_ids(rng, (2, 5))
  logits = model(params, src, tgt)
  for _ in range(3):
    # Garbage under the padding, but the segments still say it is padding.
    noisy = jnp.where(src == 0, _random_ids(rng, src.shape), src)
    out = model(params, noisy, tgt, src_segments=(src != 0).astype(jnp.int32))
    np.testing.assert_allclose(out, logits, atol=1e-6)
  # Longer padding changes nothing either.
  wider = jnp.pad(src, ((0, 0), (0, 4)))
  np.testing.assert_allclose(model(params, wider, tgt), logits, atol=1e-5)


def test_segment_masks_isolate_packed_sequences(small):
  model, params, rng = small
  src_a, src_b = _random_ids(rng, (1, 4)), _random_ids(rng, (1, 3))
  tgt_a, tgt_b = _random_ids(rng, (1, 3)), _random_ids(rng, (1, 5))
  packed_src = jnp.concatenate([src_a, src_b, jnp.zeros((1, 2), jnp.int32)], axis=1)
  packed_tgt = jnp.concatenate([tgt_a, tgt_b], axis=1)
  src_seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0, 0]])
  tgt_seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 2]])
  src_pos = jnp.array([[0, 1, 2, 3, 0, 1, 2, 0, 0]])
  tgt_pos = jnp.array([[0, 1, 2, 0, 1, 2, 3, 4]])
  packed = model(params, packed_src, packed_tgt, src_segments=src_seg,
                       tgt_segments=tgt_seg, src_positions=src_pos, tgt_positions=tgt_pos)
  alone_a = model(params, src_a, tgt_a)
  alone_b = model(params, src_b, tgt_b)
  np.testing.assert_allclose(packed[:, :3], alone_a, atol=1e-5)
  np.testing.assert_allclose(packed[:, 3:], alone_b, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Incremental decoding
# ---------------------------------------------------------------------------------------------------

def _decode_incrementally(model, params, cfg, src, tgt_in, hyps_per_sentence):
  """Feeds tgt_in one token per step through the cache, k copies per sentence; returns [b*k, t, V]."""
  memory = jax.jit(lambda src: model.apply(
      {"params": params}, model.apply({"params": params}, src, method="encode"),
      method="prepare_decoding"))(src)
  n = src.shape[0] * hyps_per_sentence
  cache = init_cache(cfg, n, tgt_in.shape[1])
  step = jax.jit(lambda ids, cache: model.apply({"params": params}, ids, cache, memory, src != 0,
                                                method="decode_step"))
  outputs = []
  for t in range(tgt_in.shape[1]):
    logits, cache = step(jnp.repeat(tgt_in[:, t], hyps_per_sentence), cache)
    outputs.append(logits)
  return jnp.stack(outputs, axis=1)


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
@pytest.mark.parametrize("tgt_len", [1, 4, 9])
@pytest.mark.parametrize("hyps_per_sentence", [1, 3])
def test_cached_decoding_equals_teacher_forcing(small, tgt_len, hyps_per_sentence, kernels):
  model, params, rng = small
  src = _random_ids(rng, (3, 8)).at[0, 2:].set(0).at[1, 6:].set(0)  # sources of length 2, 6, 8
  tgt_in = _random_ids(rng, (3, tgt_len))
  full = model(params, src, tgt_in)
  cfg = SMALL.with_compute(kernels=kernels)
  incremental = _decode_incrementally(Transformer(cfg), params, cfg, src, tgt_in, hyps_per_sentence)
  expected = jnp.repeat(full, hyps_per_sentence, axis=0)
  assert float(jnp.max(jnp.abs(incremental - expected))) <= 1e-4


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
@pytest.mark.parametrize("switch", ["pre_norm", "learned", "unshared", "no_bias",
                                    "bf16_matmuls"])
def test_cached_decoding_equals_teacher_forcing_with_switches(switch, kernels):
  changes = {"pre_norm": dict(pre_norm=True), "learned": dict(positions="learned"),
             "unshared": dict(share_embeddings=False), "no_bias": dict(attention_bias=False),
             "bf16_matmuls": dict(compute=Compute(kernels=kernels, matmul_dtype="bfloat16"))}[switch]
  cfg = SMALL.with_compute(kernels=kernels).replace(**changes)
  rng = np.random.default_rng(1)
  src = _random_ids(rng, (2, 6)).at[0, 3:].set(0)
  tgt_in = _random_ids(rng, (2, 5))
  model = Transformer(cfg)
  params = _init(cfg, src, tgt_in)
  full = _forward(model)(params, src, tgt_in)
  incremental = _decode_incrementally(model, params, cfg, src, tgt_in, 2)
  assert float(jnp.max(jnp.abs(incremental - jnp.repeat(full, 2, axis=0)))) <= 1e-4
  if cfg.compute.matmul_dtype is not None:   # both paths really rounded: float32 decoding differs
    exact_cfg = SMALL.with_compute(kernels=kernels)
    exact = _decode_incrementally(Transformer(exact_cfg), params, exact_cfg, src, tgt_in, 2)
    assert float(jnp.max(jnp.abs(incremental - exact))) > 1e-3


@pytest.mark.parametrize("kernels,beam_slots", [("reference", False), ("cpu", False), ("cpu", True)])
@pytest.mark.parametrize("beams", [2, 3])
def test_reordered_caches_follow_each_hypothesis_history(small, beams, kernels, beam_slots):
  """Hypotheses that change parents at every step (as in beam search) still get, at every step, the
  logits of teacher forcing on their own history. With the CPU kernels' beam slots the keys and values
  never move: only the slot history is reordered."""
  model, params, rng = small
  b, steps = 2, 6
  src = _random_ids(rng, (b, 7)).at[0, 4:].set(0)
  cfg = SMALL.with_compute(kernels=kernels)
  module = Transformer(cfg)
  memory = jax.jit(lambda src: module.apply(
      {"params": params}, module.apply({"params": params}, src, method="encode"),
      method="prepare_decoding"))(src)
  n = b * beams
  cache = init_cache(cfg, n, steps, beam_slots=beam_slots)
  assert ("slot_history" in cache) == beam_slots
  step = jax.jit(lambda ids, cache: module.apply({"params": params}, ids, cache, memory, src != 0,
                                                 method="decode_step"))
  reorder = jax.jit(functools.partial(reorder_cache, cfg))
  history = np.zeros((n, 0), np.int32)
  for t in range(steps):
    ids = np.asarray(_random_ids(rng, (n,)))
    logits, cache = step(jnp.asarray(ids), cache)
    history = np.concatenate([history, ids[:, None]], axis=1)
    expected = model(params, jnp.repeat(src, beams, axis=0), jnp.asarray(history))[:, -1]
    assert float(jnp.max(jnp.abs(logits - expected))) <= 1e-4, t
    # Every row continues a random hypothesis of its own sentence (some twice, some dropped).
    rows = (np.arange(n) // beams) * beams + rng.integers(0, beams, n)
    before = jax.tree_util.tree_map(np.asarray, cache)
    cache = reorder(cache, jnp.asarray(rows, jnp.int32))
    history = history[rows]
    if beam_slots:   # the keys and values stay where they were written
      for old, new in zip(before["layers"], cache["layers"]):
        np.testing.assert_array_equal(np.asarray(new["k"]), old["k"])
        np.testing.assert_array_equal(np.asarray(new["v"]), old["v"])


# ---------------------------------------------------------------------------------------------------
# Parameter counts (Table 3 of the paper, 37,000-token shared vocabulary)
# ---------------------------------------------------------------------------------------------------

TABLE3 = {  # row -> (config changes from base, paper's count in millions)
    "base": ({}, 65),
    "B d_k=16": (dict(d_k=16, d_v=64), 58),
    "B d_k=32": (dict(d_k=32, d_v=64), 60),
    "C N=2": (dict(num_encoder_layers=2, num_decoder_layers=2), 36),
    "C N=4": (dict(num_encoder_layers=4, num_decoder_layers=4), 50),
    "C N=8": (dict(num_encoder_layers=8, num_decoder_layers=8), 80),
    "C d_model=256": (dict(d_model=256, d_k=32, d_v=32), 28),
    "C d_model=1024": (dict(d_model=1024, d_k=128, d_v=128), 168),
    "C d_ff=1024": (dict(d_ff=1024), 53),
    "C d_ff=4096": (dict(d_ff=4096), 90),
}


@pytest.mark.parametrize("row", list(TABLE3) + ["big"])
def test_parameter_counts_match_table3(row):
  if row == "big":
    cfg, paper = big(vocab_size=37000), 213
  else:
    changes, paper = TABLE3[row]
    cfg = base(vocab_size=37000, **changes)
  counted = num_params(cfg)   # what init creates, from its shapes
  print(f"Table 3 {row:>15}: {counted / 1e6:7.1f}M  (paper {paper}M, {100 * (counted / 1e6 / paper - 1):+.1f}%)")
  assert abs(counted / 1e6 - paper) / paper <= 0.07


# ---------------------------------------------------------------------------------------------------
# An independent reference in plain numpy
# ---------------------------------------------------------------------------------------------------

def _np_layer_norm(x, p, eps=1e-6):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def _np_attention(x, memory, mask, p, h):
  q = np.einsum("td,dhk->thk", x, p["query"]["kernel"]) + p["query"]["bias"]
  k = np.einsum("sd,dhk->shk", memory, p["key"]["kernel"]) + p["key"]["bias"]
  v = np.einsum("sd,dhk->shk", memory, p["value"]["kernel"]) + p["value"]["bias"]
  out = np.zeros((x.shape[0], h, v.shape[-1]))
  for head in range(h):
    scores = q[:, head] @ k[:, head].T / np.sqrt(q.shape[-1])
    scores = np.where(mask, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out[:, head] = weights @ v[:, head]
  return np.einsum("thk,hkd->td", out, p["out"]["kernel"]) + p["out"]["bias"]


def _np_ffn(x, p):
  hidden = np.maximum(0.0, x @ p["wi"]["kernel"] + p["wi"]["bias"])
  return hidden @ p["wo"]["kernel"] + p["wo"]["bias"]


def _np_positions(length, d):
  pe = np.zeros((length, d))
  for pos in range(length):
    for i in range(d // 2):
      pe[pos, 2 * i] = np.sin(pos / 10000 ** (2 * i / d))
      pe[pos, 2 * i + 1] = np.cos(pos / 10000 ** (2 * i / d))
  return pe


def _np_transformer(params, src, tgt, cfg):
  """One sentence, post-norm, shared embeddings: the paper's equations written out directly."""
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
  emb = p["shared_embedding"]["embedding"]
  d, h = cfg.d_model, cfg.num_heads
  x = emb[src] * np.sqrt(d) + _np_positions(len(src), d)
  enc_mask = np.ones((len(src), len(src)), bool)
  for i in range(cfg.num_encoder_layers):
    lp = p["encoder"][f"layers_{i}"]
    x = _np_layer_norm(x + _np_attention(x, x, enc_mask, lp["self_attention"], h),
                       lp["residual_attention"]["norm"])
    x = _np_layer_norm(x + _np_ffn(x, lp["ffn"]), lp["residual_ffn"]["norm"])
  y = emb[tgt] * np.sqrt(d) + _np_positions(len(tgt), d)
  causal = np.tril(np.ones((len(tgt), len(tgt)), bool))
  cross_mask = np.ones((len(tgt), len(src)), bool)
  for i in range(cfg.num_decoder_layers):
    lp = p["decoder"][f"layers_{i}"]
    y = _np_layer_norm(y + _np_attention(y, y, causal, lp["self_attention"], h),
                       lp["residual_self"]["norm"])
    y = _np_layer_norm(y + _np_attention(y, x, cross_mask, lp["cross_attention"], h),
                       lp["residual_cross"]["norm"])
    y = _np_layer_norm(y + _np_ffn(y, lp["ffn"]), lp["residual_ffn"]["norm"])
  return y @ emb.T


def test_agrees_with_numpy_reference():
  cfg = SMALL.replace(num_encoder_layers=1, num_decoder_layers=1)
  rng = np.random.default_rng(2)
  src, tgt = _random_ids(rng, (1, 6)), _random_ids(rng, (1, 5))
  params = _init(cfg, src, tgt, seed=3)
  # Non-trivial LayerNorm parameters and biases, so that a misplaced one shows.
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(4), len(leaves))
  params = jax.tree_util.tree_unflatten(
      treedef, [leaf + 0.1 * jax.random.normal(k, leaf.shape) for leaf, k in zip(leaves, keys)])
  ours = _forward(Transformer(cfg))(params, src, tgt)[0]
  reference = _np_transformer(params, np.asarray(src[0]), np.asarray(tgt[0]), cfg)
  assert np.max(np.abs(np.asarray(ours) - reference)) <= 1e-4


def test_sinusoid_interleaves_sin_and_cos_as_the_formula():
  np.testing.assert_allclose(sinusoid(jnp.arange(50), 16), _np_positions(50, 16), atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Switches: forward, backward, dtypes, one trace per shape
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes", [dict(pre_norm=True), dict(positions="learned"),
                                     dict(share_embeddings=False),
                                     dict(compute=Compute(dtype="bfloat16"), param_dtype="float32"),
                                     dict(compute=Compute(matmul_dtype="bfloat16")),
                                     dict(compute=Compute(matmul_dtype="bfloat16"), share_embeddings=False),
                                     dict(attention_bias=False, dropout_rate=0.1,
                                          attention_dropout_rate=0.1, relu_dropout_rate=0.1),
                                     dict(compute=Compute(kernels="reference"), dropout_rate=0.1,
                                          attention_dropout_rate=0.1, relu_dropout_rate=0.1)],
                         ids=["pre_norm", "learned", "unshared", "bfloat16", "bf16_matmuls",
                              "bf16_matmuls_unshared", "no_bias_dropout", "reference_kernels"])
def test_switches_run_forward_and_backward_and_trace_once(changes):
  cfg = SMALL.replace(**changes)
  model = Transformer(cfg)
  rng = np.random.default_rng(5)
  src, tgt = _random_ids(rng, (2, 6)), _random_ids(rng, (2, 5))
  params = _init(cfg, src, tgt)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
  traces = []

  @jax.jit
  def loss_and_grad(params, src, tgt, key):
    traces.append(1)

    def loss(params):
      logits = model.apply({"params": params}, src, tgt, deterministic=False, rngs={"dropout": key})
      assert logits.dtype == jnp.float32
      return -jnp.mean(jax.nn.log_softmax(logits)[..., 3])
    return jax.value_and_grad(loss)(params)

  for step in range(3):
    value, grads = loss_and_grad(params, src, tgt, jax.random.key(step))
    assert np.isfinite(float(value))
    norm = sum(float(jnp.sum(g.astype(jnp.float32) ** 2)) for g in jax.tree_util.tree_leaves(grads))
    assert np.isfinite(norm) and norm > 0
  assert len(traces) == 1
  loss_and_grad.lower(params, src[:, :4], tgt, jax.random.key(0))  # a new shape traces once more (no
  assert len(traces) == 2                                           # need to compile it to see that)


def test_bfloat16_computes_in_bfloat16_and_stays_close_to_float32():
  rng = np.random.default_rng(6)
  src, tgt = _random_ids(rng, (2, 6)), _random_ids(rng, (2, 5))
  params = _init(SMALL, src, tgt)
  f32 = _forward(Transformer(SMALL))(params, src, tgt)
  bf16 = _forward(Transformer(SMALL.with_compute(dtype="bfloat16")))(params, src, tgt)
  assert bf16.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(f32 - bf16))) < 0.25
  assert not np.array_equal(np.asarray(f32), np.asarray(bf16))


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
@pytest.mark.parametrize("share_embeddings", [True, False])
def test_bfloat16_logits_are_accumulated_and_returned_in_float32(share_embeddings, kernels):
  """dtype bfloat16: the output layer reads bfloat16 operands but accumulates in float32, so the logits
  are not bfloat16 values cast up (they were, with an unshared output layer)."""
  cfg = SMALL.replace(share_embeddings=share_embeddings, compute=Compute(dtype="bfloat16", kernels=kernels))
  src, tgt = _random_ids(np.random.default_rng(7), (2, 6)), _random_ids(np.random.default_rng(8), (2, 5))
  model, params = Transformer(cfg), _init(cfg, src, tgt)
  logits = _forward(model)(params, src, tgt)
  y, table = jax.jit(lambda p: model.apply({"params": p}, src, tgt, method="features"))(params)
  assert y.dtype == table.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
  want = jnp.einsum("btd,vd->btv", y.astype(jnp.float32), table.astype(jnp.float32))
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
  assert np.mean(np.asarray(logits) != np.asarray(logits.astype(jnp.bfloat16).astype(jnp.float32))) > 0.5


# ---------------------------------------------------------------------------------------------------
# Config validation
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    (dict(d_model=30, num_heads=4), "not divisible by num_heads"),
    (dict(dropout_rate=-0.1), "dropout_rate"),
    (dict(compute=dict(dtype="float8")), "unknown dtype"),
    (dict(num_decoder_layers=0), "num_decoder_layers"),
    (dict(d_k=0), "d_k must be positive"),
    (dict(compute=dict(kernels="gpu")), "kernels='gpu' is not one of"),
])
def test_config_rejects_bad_values(changes, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig(**{k: Compute(**v) if k == "compute" else v for k, v in changes.items()})


def test_row_b_changes_d_k_alone():
  cfg = base(d_k=16)
  assert (cfg.head_dim_k, cfg.head_dim_v) == (16, 64)
  assert TransformerConfig(d_model=30, num_heads=4, d_k=8, d_v=8).head_dim_k == 8
