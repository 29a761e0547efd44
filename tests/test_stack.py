"""compute.remat and compute.scan_layers (model/stack.py): the same model, computed another way.

Rematerialization must give the gradients of remat='none'; the scanned layout must give the outputs and
gradients of the unrolled one once its parameters are converted, and the conversion must round-trip.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import Compute, Transformer, TransformerConfig, init_cache
from run import layout

CFG = TransformerConfig(vocab_size=61, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2,
                        num_decoder_layers=3, max_len=32, dropout_rate=0.1, compute=Compute(kernels="reference"))
SRC = jax.random.randint(jax.random.key(1), (2, 9), 1, 61)
TGT = jax.random.randint(jax.random.key(2), (2, 7), 1, 61)


def _init(cfg):
  return Transformer(cfg).init(jax.random.key(0), SRC, TGT)["params"]


def _grads(cfg, params, deterministic):
  def loss(p):
    logits = Transformer(cfg).apply({"params": p}, SRC, TGT, deterministic=deterministic,
                                    rngs={"dropout": jax.random.key(3)})
    return jnp.mean(jax.nn.log_softmax(logits)[..., 5])
  return jax.jit(jax.grad(loss))(params)


def _assert_trees_close(a, b, tol=1e-5):
  """Leaf by leaf, up to tol of the largest entry of b (some gradients are 0 up to rounding)."""
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  scale = max(float(np.abs(y).max()) for y in jax.tree_util.tree_leaves(b))
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol * scale)


def test_remat_gives_the_gradients_of_none_with_dropout():
  params = _init(CFG)
  expected = _grads(CFG, params, False)
  dots = {}
  for remat in ("none", "minimal", "full"):
    cfg = CFG.with_compute(remat=remat)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: jnp.sum(Transformer(cfg).apply({"params": p}, SRC, TGT))))(params))
    assert jaxpr.count("remat") >= (0 if remat == "none" else 5), remat   # one per layer
    dots[remat] = jaxpr.count("dot_general[")
    if remat != "none":
      _assert_trees_close(_grads(cfg, params, False), expected)
  # minimal recomputes only the batched attention products, full every product of the layers.
  assert dots["none"] < dots["minimal"] < dots["full"], dots


def test_scanned_layers_equal_unrolled():
  unrolled = _init(CFG)
  cfg = CFG.with_compute(scan_layers=True, remat="full")
  scanned = layout.scan_params(unrolled)
  assert set(scanned["encoder"]) == {"embed", "layers"} - ({"embed"} - set(unrolled["encoder"]))
  assert jax.tree_util.tree_structure(scanned) == jax.tree_util.tree_structure(_init(cfg))
  assert scanned["decoder"]["layers"]["ffn"]["wi"]["kernel"].shape == (3, 32, 64)   # [layers, d, d_ff]
  back = layout.unroll_params(scanned)
  for x, y in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(unrolled)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  np.testing.assert_allclose(Transformer(cfg).apply({"params": scanned}, SRC, TGT),
                             Transformer(CFG).apply({"params": unrolled}, SRC, TGT), atol=1e-5)
  grads = layout.unroll_params(_grads(cfg, scanned, True))
  _assert_trees_close(grads, _grads(CFG, unrolled, True))


def test_scanned_family_equals_unrolled():
  base = CFG.replace(arch="decoder_only", positions="relative", pre_norm=True, num_kv_heads=2)
  unrolled = Transformer(base).init(jax.random.key(0), SRC, TGT)["params"]
  cfg = base.with_compute(scan_layers=True)
  scanned = layout.scan_params(unrolled)
  np.testing.assert_allclose(Transformer(cfg).apply({"params": scanned}, SRC, TGT),
                             Transformer(base).apply({"params": unrolled}, SRC, TGT), atol=1e-5)


def test_scanned_model_decodes_after_unrolling():
  cfg = CFG.with_compute(scan_layers=True)
  scanned = _init(cfg)
  with pytest.raises(ValueError, match="unrolled"):
    init_cache(cfg, 2, 8)
  model, params = layout.unrolled(Transformer(cfg), scanned)
  assert not model.cfg.compute.scan_layers and "layers_2" in params["decoder"]
  # The unrolled model's cached decoding reproduces the scanned model's teacher-forced logits.
  enc_out = model.apply({"params": params}, SRC, method="encode")
  memory = model.apply({"params": params}, enc_out, method="prepare_decoding")
  cache = init_cache(model.cfg, 2, TGT.shape[1])
  step = jax.jit(lambda ids, cache: model.apply({"params": params}, ids, cache, memory, SRC != 0,
                                                method="decode_step"))
  steps = []
  for t in range(TGT.shape[1]):
    logits, cache = step(TGT[:, t], cache)
    steps.append(logits)
  np.testing.assert_allclose(jnp.stack(steps, 1), Transformer(cfg).apply({"params": scanned}, SRC, TGT),
                             atol=1e-4)
