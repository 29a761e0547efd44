"""The pure train/eval steps: schedules, loss, 1 vs 8 devices, FSDP, accumulation, non-finite guard."""
import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from data.vocab import BOS, EOS
from model import Transformer
from run import model_config
from run.mesh import make_mesh
from train import loss as loss_lib
from train import schedules
from train import step as step_lib
from train.optimizer import make_optimizer

VOCAB = 40


def toy_batch(rows=16, length=7, seed=0):
  """A learnable batch in the data contract's format: the target is the reversed source.

  Row r has length - (r % 3) real tokens and padding after them (segments 0 there).
  """
  rng = np.random.RandomState(seed)
  src = np.zeros((rows, length), np.int32)
  tgt_in = np.zeros((rows, length + 1), np.int32)
  tgt_out = np.zeros((rows, length + 1), np.int32)
  for r in range(rows):
    n = length - r % 3
    tokens = rng.randint(EOS + 1, VOCAB, n)   # no special ids inside the text
    src[r, :n] = tokens
    tgt_in[r, :n + 1] = np.concatenate([[BOS], tokens[::-1]])   # bos + target
    tgt_out[r, :n + 1] = np.concatenate([tokens[::-1], [EOS]])  # target + eos
  segments = lambda x: (x != 0).astype(np.int32)
  positions = lambda x: np.where(x != 0, np.arange(x.shape[1]), 0).astype(np.int32)
  tgt_segments = (tgt_out != 0).astype(np.int32)
  return dict(src=src, src_segments=segments(src), src_positions=positions(src), tgt_in=tgt_in,
              tgt_out=tgt_out, tgt_segments=tgt_segments,
              tgt_positions=np.where(tgt_segments, np.arange(length + 1), 0).astype(np.int32))


def tiny_config(**train):
  config = ml_collections.ConfigDict()
  config.model = dict(d_model=32, d_ff=64, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                      dropout_rate=0.1, max_len=32)
  config.compute = dict()   # model.Compute's defaults
  config.train = dict(schedule="inverse_sqrt", learning_rate=3e-3, warmup_steps=5, num_steps=100,
                      adam_b1=0.9, adam_b2=0.98, adam_eps=1e-9, weight_decay=0.0, grad_clip_norm=0.0)
  config.train.update(train)
  return config


def setup(config, devices=None, fsdp=False, accum=1, label_smoothing=0.1,
          loss_chunk_tokens=step_lib.DEFAULT_LOSS_CHUNK):
  mesh = make_mesh(devices)
  model = Transformer(model_config(config, VOCAB))
  schedule = schedules.make_schedule(config.train, config.model.d_model)
  tx = make_optimizer(config.train, schedule)
  state, shardings = step_lib.create_state(model, tx, mesh, jax.random.key(0), fsdp=fsdp)
  train_step = step_lib.jit_train_step(model, tx, schedule, mesh, shardings,
                                       label_smoothing=label_smoothing, accum_steps=accum,
                                       loss_chunk_tokens=loss_chunk_tokens)
  return mesh, model, state, shardings, train_step


def assert_params_close(a, b, tol=1e-5):
  """Every parameter equal within tol, except attention KEY biases: adding a constant to every key
  logit of a query changes no softmax, so their gradient is zero up to rounding, and Adam (eps 1e-9)
  turns that rounding noise, which depends on the reduction order, into lr-sized steps."""
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
    name = jax.tree_util.keystr(path)
    if "['key']['bias']" not in name:
      np.testing.assert_allclose(x, y, rtol=tol, atol=tol, err_msg=name)


def run(config, steps=4, same_batch=False, **kwargs):
  mesh, _, state, _, train_step = setup(config, **kwargs)
  history = []
  for i in range(steps):
    batch = toy_batch(seed=0 if same_batch else i)
    state, metrics = train_step(state, step_lib.place_batch(batch, mesh), jax.random.key(7))
    history.append(jax.device_get(metrics))
  return jax.device_get(state), history


# ------------------------------------------------------------------------------------------------------
def test_paper_schedule_values():
  lr = schedules.paper(d_model=512, warmup_steps=4000)
  # count 0 is the paper's step 1: 512^-0.5 * 4000^-1.5
  np.testing.assert_allclose(lr(0), 512 ** -0.5 * 4000 ** -1.5, rtol=1e-6)
  assert float(lr(0)) > 0
  # peak at step = warmup: d_model^-0.5 * warmup^-0.5 = 6.988e-4
  np.testing.assert_allclose(lr(3999), 512 ** -0.5 * 4000 ** -0.5, rtol=1e-6)
  np.testing.assert_allclose(lr(3999), 6.98771e-4, rtol=1e-5)
  np.testing.assert_allclose(lr(15999), 512 ** -0.5 * 16000 ** -0.5, rtol=1e-6)
  assert lr(3998) < lr(3999) and lr(4000) < lr(3999)
  np.testing.assert_allclose(schedules.paper(512, 4000, multiplier=2.0)(99), 2 * lr(99), rtol=1e-6)
  inv = schedules.inverse_sqrt(1e-3, 100)
  np.testing.assert_allclose([inv(49), inv(99), inv(399)], [5e-4, 1e-3, 5e-4], rtol=1e-6)
  cos = schedules.cosine(1e-3, 10, 110, final_fraction=0.0)
  np.testing.assert_allclose([cos(4), cos(9), cos(59), cos(109)], [5e-4, 1e-3, 5e-4, 0.0], atol=1e-9)


def test_label_smoothed_loss_matches_numpy():
  rng = np.random.RandomState(0)
  logits = rng.randn(2, 3, 5).astype(np.float32)
  targets = rng.randint(0, 5, (2, 3))
  weights = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  eps = 0.1
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  q = np.full((2, 3, 5), eps / 4)
  np.put_along_axis(q, targets[..., None], 1 - eps, axis=-1)
  expected = ((q * (np.log(q) - logp)).sum(-1) * weights).sum()          # KL(q || p)
  got = loss_lib.smoothed_cross_entropy(jnp.asarray(logits), targets, weights, eps)
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  # eps = 0 is the plain NLL
  np.testing.assert_allclose(loss_lib.smoothed_cross_entropy(logits, targets, weights, 0.0),
                             loss_lib.nll(logits, targets, weights), rtol=1e-6)
  np.testing.assert_allclose(loss_lib.correct(logits, targets, weights),
                             ((logits.argmax(-1) == targets) * weights).sum())
  # A target tied for the highest logit counts as correct (argmax would pick the first of the tied).
  tied = jnp.zeros((1, 2, 5)).at[0, 0, 1].set(3.0).at[0, 0, 4].set(3.0).at[0, 1, 2].set(1.0)
  assert float(loss_lib.correct(tied, jnp.array([[4, 3]]), jnp.ones((1, 2)))) == 1.0


def test_loss_is_normalised_by_real_tokens_of_the_global_batch():
  config = tiny_config()
  mesh, model, state, shardings, _ = setup(config)
  batch = toy_batch()
  eval_step = step_lib.jit_eval_step(model, mesh, shardings.params, label_smoothing=0.1)
  sums = jax.device_get(eval_step(state.params, step_lib.place_batch(batch, mesh)))
  assert sums["tokens"] == (batch["tgt_segments"] != 0).sum()
  logits = jax.jit(model.apply)({"params": state.params}, batch["src"], batch["tgt_in"])
  weights = (batch["tgt_segments"] != 0).astype(np.float32)
  np.testing.assert_allclose(sums["loss"], loss_lib.smoothed_cross_entropy(
      logits, batch["tgt_out"], weights, 0.1), rtol=1e-5)


def test_loss_falls_when_fitting_one_batch():
  _, history = run(tiny_config(learning_rate=1e-2), steps=30, same_batch=True)
  first, last = history[0], history[-1]
  assert last["loss"] < 0.7 * first["loss"], (first["loss"], last["loss"])
  assert last["accuracy"] > first["accuracy"]
  for key in ("loss", "nll", "ppl", "accuracy", "learning_rate", "grad_norm", "param_norm", "tokens"):
    assert np.isfinite(last[key]), key
  np.testing.assert_allclose(last["ppl"], np.exp(last["nll"]), rtol=1e-5)


def test_one_device_equals_eight_devices():
  assert len(jax.devices()) == 8
  config = tiny_config()
  state1, hist1 = run(config, devices=jax.devices()[:1])
  state8, hist8 = run(config)
  np.testing.assert_allclose([h["loss"] for h in hist1], [h["loss"] for h in hist8], rtol=1e-5, atol=1e-5)
  assert_params_close(state1.params, state8.params)
  # and FSDP on 8 devices: the same numbers with sharded parameters and optimizer state
  mesh, _, state, shardings, _ = setup(config, fsdp=True)
  specs = [s.spec for s in jax.tree_util.tree_leaves(shardings.params)]
  assert any("data" in spec for spec in specs)
  state_fsdp, hist_fsdp = run(config, fsdp=True)
  np.testing.assert_allclose([h["loss"] for h in hist1], [h["loss"] for h in hist_fsdp], rtol=1e-5,
                             atol=1e-5)
  assert_params_close(state1.params, state_fsdp.params)


@pytest.mark.slow
def test_bf16_matmul_steps_track_float32_and_agree_across_devices():
  """Mixed precision (compute.matmul_dtype="bfloat16", kernels/mixed_matmul.py) in the jitted data-parallel
  step, fused loss included: losses within 1% of float32's, and 1 device equals 8."""
  config = tiny_config()
  config.compute.matmul_dtype = "bfloat16"
  state1, hist1 = run(config, devices=jax.devices()[:1])
  state8, hist8 = run(config)
  # The first step's loss is computed from the same parameters on both; the later ones from parameters
  # that a bfloat16 rounding (below) moved apart: within a quarter of bfloat16's unit roundoff (2^-8).
  # Measured: 1.2e-4 at the third step on an Intel Xeon with AVX512-BF16, where XLA rounds in hardware.
  np.testing.assert_allclose(hist1[0]["loss"], hist8[0]["loss"], rtol=1e-6)
  np.testing.assert_allclose([h["loss"] for h in hist1], [h["loss"] for h in hist8], rtol=2 ** -10)
  # A float32 sum that differs in its last bit (another reduction order) can round to a different
  # bfloat16: a rare element differs by up to 2^-8 relative after a step, and Adam's normalised update
  # carries that into the next steps (measured: 32 of 22,656 weights beyond 1e-3, the largest 4.7e-3).
  # So: 99% of the weights within 1e-3, none beyond 1e-2 (key biases aside, as in assert_params_close).
  leaves = lambda s: [np.asarray(x, np.float64).ravel() for p, x in jax.tree_util.tree_leaves_with_path(
      s.params) if "['key']['bias']" not in jax.tree_util.keystr(p)]
  diffs = np.abs(np.concatenate(leaves(state1)) - np.concatenate(leaves(state8)))
  assert float(np.mean(diffs > 1e-3)) < 1e-2 and float(diffs.max()) < 1e-2, (np.sum(diffs > 1e-3), diffs.max())
  # FSDP with gradient accumulation and the full-logits loss: runs, and tracks float32 there too
  # (accumulation draws other dropout masks, so it is compared with float32 accumulation)
  _, hist_fsdp = run(config, fsdp=True, accum=2, loss_chunk_tokens=0)
  _, hist_fsdp32 = run(tiny_config(), fsdp=True, accum=2, loss_chunk_tokens=0)
  np.testing.assert_allclose([h["loss"] for h in hist_fsdp], [h["loss"] for h in hist_fsdp32], rtol=1e-2)
  state32, hist32 = run(tiny_config())
  np.testing.assert_allclose([h["loss"] for h in hist8], [h["loss"] for h in hist32], rtol=1e-2)
  diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(state8.params),
                                                          jax.tree_util.tree_leaves(state32.params)))
  assert diff > 1e-6   # the bfloat16 rounding is really there


def test_gradient_accumulation_equals_one_big_batch():
  config = tiny_config()
  config.model.dropout_rate = 0.0   # dropout masks differ per micro-batch; compare the arithmetic
  state1, hist1 = run(config, steps=3)
  state4, hist4 = run(config, steps=3, accum=4)
  np.testing.assert_allclose([h["loss"] for h in hist1], [h["loss"] for h in hist4], rtol=1e-5)
  assert [h["tokens"] for h in hist1] == [h["tokens"] for h in hist4]
  assert_params_close(state1.params, state4.params, tol=1e-5)


def test_nonfinite_step_keeps_the_last_good_state():
  mesh, _, state, _, train_step = setup(tiny_config())
  key = jax.random.key(7)
  state, _ = train_step(state, step_lib.place_batch(toy_batch(seed=0), mesh), key)
  good = jax.device_get(state)
  # Poison one parameter: the next loss is NaN, so the update must be refused.
  poisoned = state.replace(params=jax.tree_util.tree_map(lambda p: p * jnp.nan, state.params))
  bad_state, metrics = train_step(poisoned, step_lib.place_batch(toy_batch(seed=1), mesh), key)
  assert not np.isfinite(float(metrics["loss"]))
  assert int(bad_state.nonfinite_step) == 1 and int(bad_state.step) == 1
  # Later (finite) batches do not move it either: the run must stop and keep the last good state.
  fresh = bad_state.replace(params=jax.device_put(good.params, jax.tree_util.tree_map(
      lambda x: x.sharding, bad_state.params)))
  after, _ = train_step(fresh, step_lib.place_batch(toy_batch(seed=2), mesh), key)
  assert int(after.step) == 1 and int(after.nonfinite_step) == 1
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(after.params), good.params)


def test_fsdp_spec_picks_largest_divisible_dim():
  assert step_lib.fsdp_spec((36, 32), 8) == jax.sharding.PartitionSpec(None, "data")
  assert step_lib.fsdp_spec((64, 32), 8) == jax.sharding.PartitionSpec("data", None)
  assert step_lib.fsdp_spec((3,), 8) == jax.sharding.PartitionSpec()
  assert step_lib.fsdp_spec((), 8) == jax.sharding.PartitionSpec()


def test_place_batch_names_a_missing_key():
  mesh = make_mesh()
  batch = toy_batch()
  del batch["tgt_positions"]
  with pytest.raises(KeyError, match="tgt_positions"):
    step_lib.place_batch(batch, mesh)


def test_the_step_compiles_once_for_a_fixed_batch_shape(caplog):
  mesh, _, state, _, train_step = setup(tiny_config())
  state, _ = train_step(state, step_lib.place_batch(toy_batch(seed=0), mesh), jax.random.key(0))
  with jax.log_compiles(), caplog.at_level(logging.WARNING):   # public: JAX logs every compilation
    for i in (1, 2):
      state, _ = train_step(state, step_lib.place_batch(toy_batch(seed=i), mesh), jax.random.key(i))
  compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
  assert not [m for m in compiled if "step" in m], compiled


# ------------------------------------------------------------------------------------------------------
# The fused output layer + loss equals full logits + the plain losses, in value and gradient.
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [5, 16, 4096])          # uneven, even, one chunk
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_fused_output_losses_equal_full_logits(chunk, label_smoothing):
  rng = np.random.default_rng(chunk)
  y = jnp.asarray(rng.standard_normal((3, 11, 8)), jnp.float32)
  table = jnp.asarray(rng.standard_normal((VOCAB, 8)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, VOCAB, (3, 11)), jnp.int32)
  weights = jnp.asarray(rng.random((3, 11)) < 0.7, jnp.float32)

  def full(y, table):
    logits = jnp.einsum("btd,vd->btv", y, table)
    return (loss_lib.smoothed_cross_entropy(logits, targets, weights, label_smoothing),
            loss_lib.nll(logits, targets, weights), loss_lib.correct(logits, targets, weights))

  def fused(y, table):
    return loss_lib.fused_output_losses(y, table, targets, weights, label_smoothing, chunk)

  np.testing.assert_allclose(fused(y, table), full(y, table), rtol=1e-5)
  grad = lambda f: jax.grad(lambda y, t: 2.5 * f(y, t)[0], argnums=(0, 1))(y, table)
  for got, want in zip(grad(fused), grad(full)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [5, 4096])               # several chunks, one chunk
def test_mixed_precision_fused_loss_runs_jitted_and_equals_the_rounded_reference(chunk):
  """matmul_dtype bfloat16: the jitted value and gradient equal full logits computed from the
  bfloat16-rounded operands (the mixed-precision reference). With one chunk XLA:CPU once folded the
  table gradient's transpose into its bfloat16 dot and failed at run time (no kernel for it)."""
  rng = np.random.default_rng(chunk)
  y = jnp.asarray(rng.standard_normal((4, 32, 32)), jnp.float32)
  table = jnp.asarray(rng.standard_normal((VOCAB, 32)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, VOCAB, (4, 32)), jnp.int32)
  weights = jnp.asarray(rng.random((4, 32)) < 0.7, jnp.float32)
  rounded = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)

  def full(y, table):
    logits = jnp.einsum("btd,vd->btv", rounded(y), rounded(table))
    return loss_lib.smoothed_cross_entropy(logits, targets, weights, 0.1)

  def fused(y, table):
    return loss_lib.fused_output_losses(y, table, targets, weights, 0.1, chunk, jnp.bfloat16)[0]

  value_and_grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(y, table)
  (got, got_grads), (want, want_grads) = value_and_grad(fused), value_and_grad(full)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(got_grads, want_grads):   # the backward matmuls read bfloat16-rounded operands
    np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * float(jnp.max(jnp.abs(w))))


@pytest.mark.parametrize("share_embeddings", [True, False])
def test_fused_and_full_logit_steps_train_alike(share_embeddings):
  """A few steps with the fused output loss (compute.kernels "cpu") give the parameters and metrics of the
  full-logits path: the same kernels with loss_chunk_tokens=0, and the reference, which never fuses."""
  config = tiny_config()
  config.model.share_embeddings = share_embeddings
  config.model.dropout_rate = 0.0   # the reference draws other dropout masks
  results = []
  for kernels, chunk in (("cpu", 16), ("cpu", 0), ("reference", 16)):
    config.compute.kernels = kernels
    mesh, _, state, _, step = setup(config, jax.devices()[:1], loss_chunk_tokens=chunk)
    history = []
    for i in range(3):
      state, metrics = step(state, step_lib.place_batch(toy_batch(seed=i), mesh), jax.random.key(7))
      history.append(jax.device_get(metrics))
    results.append((jax.device_get(state.params), history))
  params_fused, hist_fused = results[0]
  for params_full, hist_full in results[1:]:
    for a, b in zip(hist_full, hist_fused):
      for key in ("loss", "nll", "accuracy", "grad_norm", "tokens"):
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, err_msg=key)
    assert_params_close(params_full, params_fused)


def test_data_parallel_fused_loss_gathers_nothing():
  """Chunks of the fused loss keep every row, so on 8 devices each computes only its own rows: the
  compiled data-parallel step has no all-gather (only the gradient all-reduce)."""
  mesh, _, state, _, step = setup(tiny_config(), loss_chunk_tokens=4)   # several chunks per device
  assert mesh.devices.size == 8
  hlo = step.lower(state, step_lib.place_batch(toy_batch(), mesh), jax.random.key(7)).compile().as_text()
  assert "all-reduce" in hlo
  assert "all-gather" not in hlo


def test_bfloat16_chunked_loss_equals_the_float32_full_logits_loss_within_bfloat16_rounding():
  """The accelerator configs' output layer: bfloat16 decoder outputs and table (dtype bfloat16),
  float32 accumulation, log-softmax and loss, in chunks; against today's float32 full-logits loss."""
  rng = np.random.default_rng(7)
  y = jnp.asarray(rng.standard_normal((4, 32, 32)), jnp.float32)
  table = jnp.asarray(rng.standard_normal((VOCAB, 32)) * 0.3, jnp.float32)
  targets = jnp.asarray(rng.integers(0, VOCAB, (4, 32)), jnp.int32)
  weights = jnp.asarray(rng.random((4, 32)) < 0.7, jnp.float32)

  def full(y, table):
    logits = jnp.einsum("btd,vd->btv", y, table)
    return loss_lib.smoothed_cross_entropy(logits, targets, weights, 0.1)

  def chunked(y, table):
    return loss_lib.fused_output_losses(y.astype(jnp.bfloat16), table.astype(jnp.bfloat16), targets, weights,
                                        0.1, 16)[0]

  value_and_grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(y, table)
  (got, got_grads), (want, want_grads) = value_and_grad(chunked), value_and_grad(full)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-2)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=3e-2 * float(jnp.max(jnp.abs(w))))


def test_the_chunked_loss_carries_the_logits_bias_and_its_gradient():
  """Marian's logits bias (cfg.logits_bias): the chunked loss adds it per chunk and returns its gradient,
  equal to full logits + bias."""
  rng = np.random.default_rng(3)
  y = jnp.asarray(rng.standard_normal((3, 11, 8)), jnp.float32)
  table = jnp.asarray(rng.standard_normal((VOCAB, 8)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal(VOCAB), jnp.float32)
  targets = jnp.asarray(rng.integers(0, VOCAB, (3, 11)), jnp.int32)
  weights = jnp.asarray(rng.random((3, 11)) < 0.7, jnp.float32)

  def full(y, table, bias):
    logits = jnp.einsum("btd,vd->btv", y, table) + bias
    return loss_lib.smoothed_cross_entropy(logits, targets, weights, 0.1)

  chunked = lambda y, table, bias: loss_lib.fused_output_losses(y, table, targets, weights, 0.1, 5, None, bias)[0]
  np.testing.assert_allclose(chunked(y, table, bias), full(y, table, bias), rtol=1e-5)
  grads = lambda f: jax.grad(f, argnums=(0, 1, 2))(y, table, bias)
  for got, want in zip(grads(chunked), grads(full)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
