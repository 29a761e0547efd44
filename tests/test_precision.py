"""Mixed-precision matmuls (kernels/mixed_matmul.py against the rounded reference) and the model that uses them."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from model import Transformer, TransformerConfig
from kernels import mixed_matmul as precision
from model.ops import ops_for

# (lhs shape, rhs shape, dimension numbers): the dense layers, the attention einsums, the output layer
# and its gradients, and contractions whose axes come permuted.
CASES = [
    ((5, 7), (7, 4), (((1,), (0,)), ((), ()))),                      # dense
    ((2, 3, 7), (7, 4, 6), (((2,), (0,)), ((), ()))),               # [b, l, d] x [d, h, k]
    ((2, 3, 4, 6), (4, 6, 5), (((2, 3), (0, 1)), ((), ()))),        # heads [b, l, h, k] x [h, k, d]
    ((2, 7, 3, 4), (2, 6, 3, 4), (((3,), (3,)), ((0, 2), (0, 2)))),  # bqhd,bkhd->bhqk
    ((2, 3, 7, 6), (2, 6, 3, 4), (((3,), (1,)), ((0, 1), (0, 2)))),  # bhqk,bkhd->bhqd
    ((9, 4), (11, 4), (((1,), (1,)), ((), ()))),                     # y x table^T
    ((9, 11), (9, 4), (((0,), (0,)), ((), ()))),                     # dlogits^T x y
    ((6, 4), (5, 6), (((0,), (1,)), ((), ()))),
    ((4, 5, 6), (6, 5, 3), (((1, 2), (1, 0)), ((), ()))),            # contraction axes permuted
    ((2, 6, 4), (2, 5, 6), (((1,), (2,)), ((0,), (0,)))),
]


def _operands(case, seed=0):
  lhs_shape, rhs_shape, dims = case
  rng = np.random.default_rng(seed)
  lhs = jnp.asarray(rng.standard_normal(lhs_shape), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)
  out_shape = lax.dot_general(lhs, rhs, dims).shape
  weights = jnp.asarray(rng.standard_normal(out_shape), jnp.float32)
  return lhs, rhs, dims, weights


def _value_and_grads(dot, lhs, rhs, dims, weights):
  f = jax.jit(jax.value_and_grad(lambda a, b: jnp.sum(weights * dot(a, b, dims)), argnums=(0, 1)))
  return f(lhs, rhs)


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_custom_gradient_equals_autodiff_in_float32(case):
  """With float32 operands the custom forward and backward matmuls are exactly lax.dot_general's: this
  checks their dimension bookkeeping (transposes, batch axes, permuted contractions)."""
  lhs, rhs, dims, weights = _operands(case)
  want_value, want = _value_and_grads(lax.dot_general, lhs, rhs, dims, weights)
  mixed_f32 = lambda a, b, d: precision.mixed_dot_general(a, b, d, dtype=jnp.float32)
  value, got = _value_and_grads(mixed_f32, lhs, rhs, dims, weights)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == jnp.float32
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bfloat16_operands_accumulate_in_float32(case):
  """bfloat16 operands: outputs and gradients are float32 and equal to float32 products of the
  bfloat16-rounded operands (and cotangent) up to float32 accumulation order."""
  lhs, rhs, dims, weights = _operands(case, seed=1)
  out = jax.jit(lambda a, b: precision.mixed_dot_general(a, b, dims))(lhs, rhs)
  assert out.dtype == jnp.float32
  # Rounds in the forward pass only (straight-through), so that the reference gradients stay float32.
  rounded = lambda x: x + lax.stop_gradient(x.astype(jnp.bfloat16).astype(jnp.float32) - x)
  np.testing.assert_allclose(out, lax.dot_general(rounded(lhs), rounded(rhs), dims), rtol=1e-5,
                             atol=1e-5)
  _, got = _value_and_grads(precision.mixed_dot_general, lhs, rhs, dims, weights)
  _, want = _value_and_grads(lambda a, b, d: lax.dot_general(rounded(a), rounded(b), d),
                             lhs, rhs, dims, rounded(weights))
  for g, w in zip(got, want):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  # and it really rounds: the exact float32 gradient differs
  _, exact = _value_and_grads(lax.dot_general, lhs, rhs, dims, weights)
  assert max(float(jnp.max(jnp.abs(g - e))) for g, e in zip(got, exact)) > 1e-4


def test_einsum_and_dense_helpers_fall_back_to_plain_float32():
  assert precision.dot_general_for(None) is None
  assert precision.dot_general_for(jnp.float32) is None
  a, b = jnp.ones((2, 3)), jnp.ones((3, 4))
  assert precision.einsum("ij,jk->ik", a, b).dtype == jnp.float32
  assert precision.einsum("ij,jk->ik", a, b, jnp.bfloat16).dtype == jnp.float32


SMALL = TransformerConfig(vocab_size=50, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2,
                          num_decoder_layers=2, dropout_rate=0.0, max_len=32)


def test_mixed_model_tracks_the_float32_model():
  """Same parameters, bfloat16 matmul operands: logits and gradients close to float32's (bfloat16
  keeps 8 significant bits), parameters float32, and no config mixes dtypes by accident."""
  rng = np.random.default_rng(0)
  src = jnp.asarray(rng.integers(3, 50, (3, 9)), jnp.int32)
  tgt = jnp.asarray(rng.integers(3, 50, (3, 8)), jnp.int32)
  f32, mixed = Transformer(SMALL), Transformer(SMALL.with_compute(matmul_dtype="bfloat16"))
  assert ops_for(SMALL).matmul_dtype is None and ops_for(mixed.cfg).matmul_dtype == jnp.bfloat16
  assert ops_for(SMALL.with_compute(matmul_dtype="float32")).matmul_dtype is None
  params = f32.init(jax.random.key(0), src, tgt)["params"]

  def loss_and_grads(model):
    def loss(p):
      logits = model.apply({"params": p}, src, tgt)
      return -jnp.mean(jax.nn.log_softmax(logits)[..., 5]), logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (loss32, logits32), grads32 = loss_and_grads(f32)
  (loss16, logits16), grads16 = loss_and_grads(mixed)
  assert logits16.dtype == jnp.float32
  scale = float(jnp.max(jnp.abs(logits32)))
  err = float(jnp.max(jnp.abs(logits16 - logits32)))
  assert 0 < err < 0.03 * scale, (err, scale)
  g32, g16 = jax.tree_util.tree_leaves(grads32), jax.tree_util.tree_leaves(grads16)
  assert all(g.dtype == jnp.float32 for g in g16)
  flat = lambda gs: jnp.concatenate([g.ravel() for g in gs])
  cosine = float(jnp.dot(flat(g32), flat(g16)) / jnp.linalg.norm(flat(g32)) / jnp.linalg.norm(flat(g16)))
  assert cosine > 0.999, cosine


def test_config_rejects_an_unknown_or_pointless_matmul_dtype():
  with pytest.raises(ValueError, match="float8"):
    SMALL.with_compute(matmul_dtype="float8")
  with pytest.raises(ValueError, match="matmul_dtype='float32' with dtype='bfloat16'"):
    SMALL.with_compute(dtype="bfloat16", matmul_dtype="float32")
  assert ops_for(SMALL.with_compute(dtype="bfloat16", matmul_dtype="bfloat16")).matmul_dtype is None


def _dot_operand_types(hlo: str) -> list[tuple[str, str]]:
  """The element types of every dot's two operands in an optimized HLO module's text."""
  types, found = {}, []
  for line in hlo.splitlines():
    define = re.match(r"\s*(?:ROOT )?%(\S+) = (\w+)\[", line)
    if define:
      types[define.group(1)] = define.group(2)
    call = re.search(r" dot\(%(\S+?), %(\S+?)\)", line)
    if call:
      found.append((types[call.group(1)], types[call.group(2)]))
  return found


def _scaled(case, k: int):
  """case with every axis but the batch axes k times longer (XLA:CPU runs tiny bfloat16 dots in float32)."""
  lhs_shape, rhs_shape, dims = case
  (lc, rc), (lb, rb) = dims
  lhs_shape = tuple(n if i in lb else n * k for i, n in enumerate(lhs_shape))
  rhs_shape = tuple(n if i in rb else n * k for i, n in enumerate(rhs_shape))
  return lhs_shape, rhs_shape, dims


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bfloat16_matmuls_stay_bfloat16_on_the_cpu(case):
  """XLA:CPU runs a bfloat16 dot with an operand that is not row-major as a float32 dot (both operands
  converted up, at half the speed): mixed_matmul lays every operand out row-major, forward and backward."""
  if jax.default_backend() != "cpu":
    pytest.skip("the layouts are XLA:CPU's")
  lhs, rhs, dims, weights = _operands(_scaled(case, 8))
  dot = lambda a, b, d: precision.mixed_dot_general(a, b, d, dtype=jnp.bfloat16)
  f = jax.jit(jax.value_and_grad(lambda a, b: jnp.sum(weights * dot(a, b, dims)), argnums=(0, 1)))
  found = _dot_operand_types(f.lower(lhs, rhs).compile().as_text())
  assert len(found) == 3 and all(t == ("bf16", "bf16") for t in found), found


@pytest.mark.slow
def test_bfloat16_and_float32_smoke_training_curves_agree(tmp_path):
  """The default experiment's smoke model trained 30 steps in float32 and in bfloat16 (the accelerator
  configs' dtype, here on the CPU): the two loss curves stay within 3% of each other."""
  from run import metrics as metrics_io
  from test_train import smoke_config
  from train.train import train_and_evaluate
  curves = {}
  for dtype in ("float32", "bfloat16"):
    config = smoke_config(**{"train.num_steps": 30, "train.log_every": 5, "compute.dtype": dtype,
                             "train.learning_rate": 5e-3})
    train_and_evaluate(config, tmp_path / dtype)
    curves[dtype] = np.array([l["train/loss"] for l in metrics_io.read_metrics(tmp_path / dtype)
                              if "train/loss" in l])
  assert len(curves["float32"]) == 6 and curves["float32"][-1] < 0.9 * curves["float32"][0]
  np.testing.assert_allclose(curves["bfloat16"], curves["float32"], rtol=0.03)
