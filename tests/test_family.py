"""The Transformer family's switches (docs/family.md) held to their references: positions, GQA/MQA,
gated FFNs, RMSNorm and the three architectures. Every variant: the parameter count is exact, cached
decoding equals the full forward pass, padding and packing change nothing, the future cannot leak."""
import contextlib
import functools
import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpu_decoding
from model import Compute, Transformer, TransformerConfig, init_cache, reorder_cache
from model.cache import KVCache
from model.ops import decoding_for
from model.positions import alibi_slopes, relative_bucket, rope
from run import config as run_config
from train.flops import num_params

SMALL = dict(vocab_size=31, d_model=16, d_ff=24, num_heads=4, num_encoder_layers=2,
             num_decoder_layers=2, dropout_rate=0.0, max_len=64,
             compute=Compute(kernels="reference"))
VARIANTS = {
    "paper": {},
    "learned": dict(positions="learned"),
    "rope": dict(positions="rope"),
    "alibi": dict(positions="alibi"),
    "relative": dict(positions="relative", relative_buckets=8, relative_max_distance=16),
    "gqa": dict(num_kv_heads=2),
    "mqa_swiglu_rms": dict(num_kv_heads=1, activation="swiglu", norm="rmsnorm", pre_norm=True),
    "geglu_gelu": dict(activation="geglu"),
    "gelu": dict(activation="gelu", attention_bias=False),
    "unshared": dict(share_embeddings=False, positions="rope", num_kv_heads=2),
    # What an imported Marian (OPUS-MT) model sets (export/load_hf.py).
    "marian": dict(activation="swish", logits_bias=True, layer_norm_epsilon=1e-5, share_embeddings=False),
}
ARCHS = ("encoder_decoder", "decoder_only")
# The default suite runs the heavy per-variant invariants on a few variants that between them cover
# every switch kind (positions, GQA/MQA, gated FFN, RMSNorm, pre-norm, unshared); the slow set runs all.
DEFAULT_SET = ("paper", "mqa_swiglu_rms", "unshared", "marian")


def _variants(names):
  return [pytest.param(n, marks=() if n in DEFAULT_SET else pytest.mark.slow) for n in names]


def _cfg(**overrides):
  return TransformerConfig(**{**SMALL, **overrides})


def _init(cfg, src_len=7, tgt_len=6):
  model = Transformer(cfg)
  src = jnp.ones((2, src_len), jnp.int32)
  tgt = jnp.ones((2, tgt_len), jnp.int32)
  return model, model.init(jax.random.key(0), src, tgt)["params"]


def _tokens(seed, shape, vocab=31):
  return jnp.asarray(np.random.default_rng(seed).integers(4, vocab, shape), jnp.int32)


# ---------------------------------------------------------------------------------------- references
def test_rope_score_depends_only_on_the_offset():
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.normal(size=(1, 1, 2, 8)), jnp.float32) for _ in range(2))
  def score(i, j):
    return jnp.sum(rope(q, jnp.array([[i]])) * rope(k, jnp.array([[j]])), axis=-1)
  for i, j in [(3, 1), (0, 5), (7, 7)]:
    np.testing.assert_allclose(score(i, j), score(i + 11, j + 11), rtol=1e-5, atol=1e-5)
  assert not np.allclose(score(3, 1), score(3, 2))


def test_relative_buckets_match_a_hand_computed_table():
  # Causal, 8 buckets, max distance 16: distances 0..3 exact, then 4 + floor(4 log_4(d / 4)), <= 7;
  # keys after the query all share bucket 0.
  rel = jnp.array([0, -1, -3, -4, -5, -6, -8, -11, -12, -16, -100, 1, 5])
  causal = [0, 1, 3, 4, 4, 5, 6, 6, 7, 7, 7, 0, 0]
  np.testing.assert_array_equal(relative_bucket(rel, False, 8, 16), causal)
  # Bidirectional: buckets 0..3 for keys at or before the query, 4..7 after; max_exact 2.
  rel = jnp.array([0, -1, -2, -4, -8, -16, 1, 2, 3, 8, 100])
  both = [0, 1, 2, 2, 3, 3, 5, 6, 6, 7, 7]
  np.testing.assert_array_equal(relative_bucket(rel, True, 8, 16), both)


def test_alibi_slopes_are_the_papers():
  np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)], rtol=1e-6)
  np.testing.assert_allclose(alibi_slopes(4), [2.0 ** (-2 * (i + 1)) for i in range(4)], rtol=1e-6)
  assert alibi_slopes(6).shape == (6,) and np.all(np.diff(alibi_slopes(6)[:4]) < 0)


def test_alibi_past_its_training_length_stays_finite_and_causal():
  cfg = _cfg(arch="decoder_only", positions="alibi", max_len=8)
  model, params = _init(cfg, tgt_len=8)
  tokens = _tokens(1, (1, 40))
  logits = model.apply({"params": params}, None, tokens)
  assert np.all(np.isfinite(logits))
  changed = tokens.at[0, 30].set(5 if int(tokens[0, 30]) != 5 else 6)
  other = model.apply({"params": params}, None, changed)
  np.testing.assert_array_equal(logits[:, :30], other[:, :30])
  assert not np.allclose(logits[:, 30:], other[:, 30:])


def test_gqa_with_as_many_kv_heads_as_heads_is_mha_exactly():
  model, params = _init(_cfg())
  gqa, gqa_params = _init(_cfg(num_kv_heads=4))
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(gqa_params)
  src, tgt = _tokens(2, (2, 7)), _tokens(3, (2, 6))
  np.testing.assert_array_equal(model.apply({"params": params}, src, tgt),
                                gqa.apply({"params": params}, src, tgt))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_the_cache_stores_num_kv_heads_heads(kv_heads):
  for kernels in ("reference", "cpu"):
    cfg = _cfg(num_kv_heads=kv_heads, compute=Compute(kernels=kernels))
    cache = init_cache(cfg, batch_size=3, max_len=10)
    if kernels == "reference" or kv_heads < 4:
      assert cache["layers"][0]["k"].shape == (3, 10, kv_heads, 4)
      assert cache["layers"][0]["v"].shape == (3, 10, kv_heads, 4)
      assert isinstance(decoding_for(cfg).cache(True), KVCache)


def test_bad_switches_are_named():
  with pytest.raises(ValueError, match="num_kv_heads=3"):
    _cfg(num_kv_heads=3)
  with pytest.raises(ValueError, match="positions='rotary'"):
    _cfg(positions="rotary")
  with pytest.raises(ValueError, match="attention_impl='flash' is not one of"):
    Compute(attention_impl="flash")
  with pytest.raises(ValueError, match="activation"):
    _cfg(activation="tanh")


def test_a_run_saved_with_learned_positions_loads_as_positions_learned(tmp_path):
  """The older key model.learned_positions is gone; a config.json that holds it still opens."""
  for old, positions in ((True, "learned"), (False, "sinusoidal")):
    path = tmp_path / f"{old}.json"
    path.write_text(json.dumps({"model": {"learned_positions": old, "positions": "sinusoidal"}, "data": {},
                                "train": {}}))
    model = run_config.read_config_json(path)["model"]
    assert model == {"positions": positions}
    TransformerConfig(**model)


# ---------------------------------------------------------------------------------- every variant
@pytest.mark.parametrize("arch", ARCHS + ("encoder_only",))
@pytest.mark.parametrize("name", VARIANTS)
def test_num_params_is_exact(arch, name):
  extra = dict(num_classes=3) if arch == "encoder_only" and name == "gqa" else {}
  cfg = _cfg(arch=arch, **VARIANTS[name], **extra)
  model = Transformer(cfg)
  src = jnp.ones((2, 5), jnp.int32)
  variables = model.init(jax.random.key(0), src, src)
  if cfg.num_classes:
    variables = model.init(jax.random.key(0), src, method="classify")
    variables = {"params": {**variables["params"], **model.init(jax.random.key(0), src, src)["params"]}}
  count = sum(x.size for x in jax.tree_util.tree_leaves(variables["params"]))
  assert count == num_params(cfg)


def _forward(model, params, arch, src, tgt, **kw):
  return model.apply({"params": params}, src, tgt, **kw)


@contextlib.contextmanager
def cpp_kernels(on: bool):
  """AIAYN_CPU_DECODING=1 or 0 for what runs inside (kernels/cpu_decoding.py reads it once per process)."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("AIAYN_CPU_DECODING", "1" if on else "0")
    cpu_decoding.available.cache_clear()
    try:
      yield
    finally:
      cpu_decoding.available.cache_clear()


# Every way decoding can run here: (Compute.kernels, the C++ kernels on).
DECODING_SETTINGS = [("reference", False), ("cpu", True), ("cpu", False), ("auto", True)]


def assert_cached_decoding_equals_teacher_forcing(cfg, params, seed):
  """Under every DECODING_SETTINGS and both cache kinds (beam slots or not), decoding cfg one token at a
  time (after a cached prefill, decoder-only) gives the teacher-forced logits. Lengths, padding and the
  prefill are drawn from `seed`; with beam slots, two hypotheses a sentence swap rows at every step, as
  beam search's reorder does, so each must read its own history from the other's slot."""
  # (kernels="auto" is "cpu" on this backend; it is run as what a user who sets nothing gets.)
  rng = np.random.default_rng(seed)
  decoder_only, beams = cfg.arch == "decoder_only", 2
  src_len, tgt_len = int(rng.integers(1, 9)), int(rng.integers(2, 9))
  src = _tokens(seed, (2, src_len)).at[1, src_len - int(rng.integers(0, src_len)):].set(0)   # padded
  tgt = _tokens(seed + 1, (2 * beams, tgt_len))      # row r*beams + j: hypothesis j of sentence r
  rows = np.arange(2 * beams).reshape(2, beams)[:, ::-1].reshape(-1)   # each sentence's two swap rows
  prefill = int(rng.integers(1, tgt_len)) if decoder_only else 0
  full = Transformer(cfg).apply({"params": params}, jnp.repeat(src, beams, axis=0), tgt)   # [4, T, vocab]
  for kernels, cpp in DECODING_SETTINGS:
    model = Transformer(cfg.with_compute(kernels=kernels))
    apply = functools.partial(model.apply, {"params": params})
    with cpp_kernels(cpp):
      step = jax.jit(functools.partial(apply, method="decode_step"))   # one compile for every step
      # (where decoding uses the plain cache for both, beam slots are the same program)
      plain = isinstance(decoding_for(model.cfg).cache(True), KVCache)
      for beam_slots in (False,) if plain else (False, True):
        enc_out = None if decoder_only else apply(src, method="encode")
        memory = apply(enc_out, method="prepare_decoding")
        cache = init_cache(model.cfg, 2 * beams, tgt_len + 1, beam_slots=beam_slots)
        order, steps, expected = np.arange(2 * beams), [], []
        if prefill:
          logits, cache = apply(tgt[:, :prefill], cache, memory, method="prefill")
          steps.append(logits), expected.append(full[:, prefill - 1])
        for i in range(prefill, tgt_len):
          logits, cache = step(tgt[order, i], cache, memory, None if decoder_only else src != 0)
          steps.append(logits), expected.append(full[order, i])
          if beam_slots:
            cache, order = reorder_cache(model.cfg, cache, jnp.asarray(rows)), order[rows]
        setting = f"kernels={kernels}, C++ {'on' if cpp else 'off'}, beam_slots={beam_slots}"
        np.testing.assert_allclose(np.stack(steps, 1), np.stack(expected, 1), rtol=3e-5, atol=3e-5,
                                   err_msg=setting)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in ("paper", "mqa_swiglu_rms")
                                               else pytest.mark.slow) for n in VARIANTS])
def test_cached_decoding_equals_the_full_forward_pass(arch, name):
  cfg = _cfg(arch=arch, **VARIANTS[name])
  _, params = _init(cfg)
  assert_cached_decoding_equals_teacher_forcing(cfg, params, seed=zlib.crc32(f"{arch}/{name}".encode()))


def test_prefill_with_left_padding_equals_the_unpadded_prompt():
  cfg = _cfg(arch="decoder_only", positions="relative", relative_buckets=8, relative_max_distance=16)
  model, params = _init(cfg)
  variables = {"params": params}
  memory = model.apply(variables, None, method="prepare_decoding")
  tokens = _tokens(6, (1, 6))
  full = model.apply(variables, None, tokens)
  padded = jnp.concatenate([jnp.zeros((1, 2), jnp.int32), tokens[:, :3]], axis=1)
  cache = init_cache(cfg, batch_size=1, max_len=10)
  logits, cache = model.apply(variables, padded, cache, memory, method="prefill")
  outs = [logits]
  for i in range(3, 6):
    logits, cache = model.apply(variables, tokens[:, i], cache, memory, None, method="decode_step")
    outs.append(logits)
  np.testing.assert_allclose(np.stack(outs, 1), full[:, 2:], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("arch", ARCHS + ("encoder_only",))
@pytest.mark.parametrize("name", _variants(["paper", "rope", "alibi", "relative", "mqa_swiglu_rms"]))
def test_padding_and_packing_change_nothing(arch, name):
  cfg = _cfg(arch=arch, **VARIANTS[name])
  model, params = _init(cfg)
  a_src, a_tgt = _tokens(7, (1, 4)), _tokens(8, (1, 3))
  b_src, b_tgt = _tokens(9, (1, 3)), _tokens(10, (1, 5))
  pick = (lambda out: out) if arch != "encoder_only" else (lambda out: out)
  alone_a = _forward(model, params, arch, a_src, a_tgt)
  alone_b = _forward(model, params, arch, b_src, b_tgt)
  # Padding: two zeros on the right of both sides.
  pad = lambda x: jnp.concatenate([x, jnp.zeros((1, 2), jnp.int32)], axis=1)
  padded = _forward(model, params, arch, pad(a_src), pad(a_tgt))
  n = a_src.shape[1] if arch == "encoder_only" else a_tgt.shape[1]
  np.testing.assert_allclose(pick(padded)[:, :n], alone_a, rtol=2e-5, atol=2e-5)
  # Packing: a and b in one row, told apart by segments, positions restarting.
  cat = lambda x, y: jnp.concatenate([x, y], axis=1)
  seg = lambda x, y: cat(jnp.ones_like(x), 2 * jnp.ones_like(y))
  pos = lambda x, y: cat(jnp.arange(x.shape[1])[None], jnp.arange(y.shape[1])[None])
  packed = _forward(model, params, arch, cat(a_src, b_src), cat(a_tgt, b_tgt),
                    src_segments=seg(a_src, b_src), tgt_segments=seg(a_tgt, b_tgt),
                    src_positions=pos(a_src, b_src), tgt_positions=pos(a_tgt, b_tgt))
  first = a_src.shape[1] if arch == "encoder_only" else a_tgt.shape[1]
  np.testing.assert_allclose(packed[:, :first], alone_a, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(packed[:, first:], alone_b, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", VARIANTS)
def test_a_future_token_cannot_change_an_earlier_logit(name):
  cfg = _cfg(arch="decoder_only", **VARIANTS[name])
  model, params = _init(cfg)
  tokens = _tokens(11, (1, 9))
  changed = tokens.at[0, 6].set(4 if int(tokens[0, 6]) != 4 else 5)
  before, after = (model.apply({"params": params}, None, t) for t in (tokens, changed))
  np.testing.assert_array_equal(before[:, :6], after[:, :6])


def test_encoder_only_is_bidirectional_and_classifies():
  cfg = _cfg(arch="encoder_only", num_classes=3)
  model = Transformer(cfg)
  src = _tokens(14, (2, 6))
  params = model.init(jax.random.key(0), src, method="classify")["params"]
  params = {**params, **model.init(jax.random.key(0), src, None)["params"]}
  logits = model.apply({"params": params}, src, None)
  assert logits.shape == (2, 6, 31) and logits.dtype == jnp.float32
  changed = model.apply({"params": params}, src.at[:, 5].set(7), None)
  assert not np.allclose(logits[:, 0], changed[:, 0])          # the first position sees the last
  classes = model.apply({"params": params}, src, method="classify")
  assert classes.shape == (2, 3)
