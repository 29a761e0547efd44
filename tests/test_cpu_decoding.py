"""The CPU decoding backend's C++ kernels (kernels/cpu_decoding.py) and panels (kernels/output_layer.py)
against XLA's ops and numpy: the same numbers, the same picks, the same bits on any number of threads;
where they are built and used (decoding on a CPU only), and the table of environment switches."""
import functools
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpu_backend, cpu_decoding, output_layer
from model import Transformer, init_cache
from model.ops import decoding_for
from test_kernels import SMALL, random_ids

# The C++ decoding kernels compile on first use; without a C++ compiler decoding uses XLA ops (the
# fallback docs/accelerators.md describes), so the tests of the kernels themselves skip, saying why.
needs_compiler = pytest.mark.skipif(cpu_decoding.find_compiler() is None,
                                    reason="no C++ compiler (c++, g++ or $CXX): decoding uses XLA ops")



def _attention_reference(q, k, v, visible):
  """cpu_decoding's arithmetic in numpy (float64): q [b, j, h, d]; k, v [b, j, h, T, d] per query;
  visible bool [b, j, T]. Rows with nothing visible average every value."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  scores = np.einsum("bjhd,bjhtd->bjht", q, k)
  scores = np.where(visible[:, :, None], scores, -np.inf)
  none = ~visible.any(-1)[:, :, None, None]
  scores = np.where(none, 0.0, scores)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("bjht,bjhtd->bjhd", weights, v)


def test_cpu_decoding_kernel_builds_here_and_is_what_float32_decoding_uses():
  """Where the machine has a C++ compiler (docs/install.md's set-up), float32 decoding runs the custom calls."""
  if cpu_decoding.find_compiler() is None:
    pytest.skip("no C++ compiler here (c++, g++ or $CXX): decoding uses XLA ops")
  assert cpu_decoding.available()
  assert cpu_decoding.build().exists()
  cfg = SMALL.with_compute(kernels="cpu")
  for beam_slots in (False, True):
    assert decoding_for(cfg).cache(beam_slots).ffi
    assert not decoding_for(cfg.with_compute(matmul_dtype="bfloat16")).cache(beam_slots).ffi
  cache = init_cache(cfg, 4, 10, beam_slots=True)
  assert cache["layers"][0]["k"].shape == (4, 4, 8, 10) and cache["layers"][0]["v"].shape == (4, 4, 10, 8)
  plain = init_cache(cfg, 4, 10, beam_slots=False)       # keys positions-last for the kernel here too
  assert plain["layers"][0]["k"].shape == (4, 4, 8, 10) and plain["layers"][0]["v"].shape == (4, 4, 10, 8)
  # Beam search picks its candidates with the C++ kernel whatever the dtype (the logits are float32).
  assert decoding_for(cfg).beam_extensions is cpu_decoding.beam_extensions
  assert decoding_for(cfg.with_compute(matmul_dtype="bfloat16")).beam_extensions is cpu_decoding.beam_extensions
  assert decoding_for(cfg.with_compute(kernels="reference")).beam_extensions is None
  # The output layer's product too, in float32; mixed precision keeps XLA's dot on the rounded table.
  assert decoding_for(cfg).decoding_weights is output_layer.decoding_panels
  assert decoding_for(cfg.with_compute(matmul_dtype="bfloat16")).decoding_weights.func is output_layer.decoding_kernel


def test_output_layer_panels_hold_the_table_by_columns_with_zeros_past_the_vocabulary():
  table = jnp.arange(7 * 3, dtype=jnp.float32).reshape(7, 3)          # vocab 7, d_model 3
  panels = np.asarray(output_layer.panels(table, 4))
  assert panels.shape == (2, 3, 4)
  for p in range(2):
    for c in range(4):
      want = table[p * 4 + c] if p * 4 + c < 7 else np.zeros(3)
      np.testing.assert_array_equal(panels[p, :, c], want)


@needs_compiler
@pytest.mark.parametrize("n", [1, 3, 8, 9, 17, 64])         # rests of every size, passes of 8 (or 4)
@pytest.mark.parametrize("d, vocab", [(5, 1), (64, 100), (32, 8000)])
def test_panel_matmul_is_the_output_layer_product(n, d, vocab):
  rng = np.random.default_rng(n * 1000 + vocab)
  y = rng.standard_normal((n, d)).astype(np.float32)
  table = rng.standard_normal((vocab, d)).astype(np.float32)
  got = np.asarray(jax.jit(functools.partial(output_layer.panel_logits, vocab=vocab))(
      y, output_layer.decoding_panels(table)))
  assert got.shape == (n, vocab)
  np.testing.assert_allclose(got, y.astype(np.float64) @ table.T.astype(np.float64), rtol=1e-5, atol=1e-4)
  with pytest.raises(Exception, match="shapes do not match"):     # a layout of another width
    jax.block_until_ready(cpu_decoding.panel_matmul(y, output_layer.panels(table, 2 * cpu_decoding.panel_width())))


@needs_compiler
@pytest.mark.parametrize("make, x_shape", [
    (lambda: nn.Dense(37), (3, 1, 20)),                                  # d_out not a whole panel
    (lambda: nn.Dense(64, use_bias=False), (9, 20)),
    (lambda: nn.DenseGeneral((4, 8)), (5, 1, 20)),                       # attention's query, key, value
    (lambda: nn.DenseGeneral(20, axis=(-2, -1)), (2, 3, 4, 8)),          # attention's out
])
def test_dense_layers_on_their_panels_equal_their_plain_call(make, x_shape):
  """kernels/cpu_backend.py: flax's layers, with the same product (with the bias) on their panels."""
  rng = np.random.default_rng(len(x_shape))
  x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
  module = make()
  variables = module.init(jax.random.key(1), x)
  variables = jax.tree.map(lambda v: v + 0.5, variables)             # a bias that is not zero
  contracted = 1 if isinstance(module, nn.Dense) else len(module.axis) if isinstance(module.axis, tuple) else 1
  panels = cpu_backend.kernel_panels(variables["params"]["kernel"], contracted)
  assert panels.shape[2] == cpu_decoding.panel_width()
  want = module.apply(variables, x)
  got = jax.jit(lambda v, x, p: module.apply(v, x, method=lambda m, x: cpu_backend.panel_product(m, x, p)))(
      variables, x, panels)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="trailing axes"):
    nn.DenseGeneral(8, axis=0).apply({"params": {"kernel": jnp.zeros((3, 8))}}, jnp.zeros((3, 2)),
                                     method=lambda m, x: cpu_backend.panel_product(m, x, None))


def _panel_products(cfg, src):
  """How many C++ panel products one decode_step runs (in its compiled HLO), and the decoding memory."""
  model = Transformer(cfg)
  params = model.init(jax.random.key(0), src, src)["params"]
  variables = {"params": params}
  memory = model.apply(variables, None if cfg.arch == "decoder_only" else
                       model.apply(variables, src, method="encode"), method="prepare_decoding")
  cache = init_cache(cfg, src.shape[0], 8)
  step = jax.jit(lambda ids, cache: model.apply(variables, ids, cache, memory,
                                                None if cfg.arch == "decoder_only" else src != 0,
                                                method="decode_step"))
  hlo = step.lower(src[:, 0], cache).as_text()
  return hlo.count("aiayn_panel_matmul"), memory


@needs_compiler
@pytest.mark.parametrize("changes, per_layer", [
    ({}, 4 + 2 + 2),                                                   # self q k v out, cross q out, FFN
    (dict(arch="decoder_only", activation="swiglu", num_kv_heads=2), 4 + 3),
])
def test_float32_decoding_runs_every_kernel_of_a_step_on_panels(changes, per_layer):
  """On the C++ path a step multiplies by every decoder kernel laid out once per set of parameters (and the output
  layer); cross-attention's keys and values stay out (computed once); mixed precision keeps XLA's dots."""
  src = random_ids(np.random.default_rng(0), (2, 5))
  cfg = SMALL.replace(**changes).with_compute(kernels="cpu")
  count, memory = _panel_products(cfg, src)
  assert count == per_layer * cfg.num_decoder_layers + 1
  assert len(memory["panels"]) == cfg.num_decoder_layers
  assert set(memory["panels"][0].get("cross_attention", {})) <= {"query", "out"}
  count, memory = _panel_products(cfg.with_compute(matmul_dtype="bfloat16"), src)
  assert count == 0 and "panels" not in memory
  assert _panel_products(cfg.with_compute(kernels="reference"), src)[0] == 0


@needs_compiler
def test_cpu_decoding_vectors_fit_the_registers_of_every_x86_level(tmp_path):
  """The kernel's vector type must be as wide as the target's registers: wider, GCC passes it through
  memory (the -Wpsabi warning), which made decoding on an AVX2-only host much slower. Compiled for each
  x86-64 level, with that warning an error."""
  import platform
  import subprocess
  if platform.machine() not in ("x86_64", "AMD64"):
    pytest.skip(f"x86-64 levels only (this machine: {platform.machine()})")
  compiler = cpu_decoding.find_compiler()
  compiling = {}
  for level in ("x86-64-v2", "x86-64-v3", "x86-64-v4"):   # SSE4.2, AVX2, AVX-512, compiled side by side
    command = [compiler, *cpu_decoding.FLAGS, f"-march={level}", "-fPIC", "-Werror=psabi",
               f"-I{jax.ffi.include_dir()}", "-c", str(cpu_decoding.SOURCE), "-o", str(tmp_path / f"{level}.o")]
    compiling[level] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  for level, compiler_process in compiling.items():
    stderr = compiler_process.communicate()[1]
    assert compiler_process.returncode == 0, f"{level}: {stderr[-1500:]}"


# Below a vector; blocks and rests; several runs of up to 4 blocks (positions 0-63, 64-95, then a rest)
# and values of 5 blocks (4, then 1).
@needs_compiler
@pytest.mark.parametrize("d, dv, length", [(8, 6, 7), (32, 32, 41), (64, 80, 100)])
def test_slot_attention_reads_each_position_from_its_slot_and_stops_at_index(d, dv, length):
  rng = np.random.default_rng(5)
  b, j, h = 3, 4, 2
  q = rng.standard_normal((b, j, h, d)).astype(np.float32)
  k = rng.standard_normal((b * j, h, length, d)).astype(np.float32)
  v = rng.standard_normal((b * j, h, length, dv)).astype(np.float32)
  slot = rng.integers(0, j, (b * j, length)).astype(np.int32)
  run = jax.jit(cpu_decoding.slot_attention)
  keys_last = np.swapaxes(k, 2, 3)                                                  # [n, h, d, L]
  for index in (0, 3, 40, length // 2, length - 1):   # 40: a run of 3 blocks
    got = np.asarray(run(q, keys_last, v, slot, index))
    # Query a of sentence r reads position t from row r * j + slot[r * j + a, t].
    rows = np.arange(b)[:, None, None] * j + slot.reshape(b, j, length)             # [b, j, L]
    keys = np.moveaxis(k[rows, :, np.arange(length)], 2, 3)                          # [b, j, h, L, d]
    values = np.moveaxis(v[rows, :, np.arange(length)], 2, 3)
    visible = np.broadcast_to(np.arange(length) <= index, (b, j, length))
    np.testing.assert_allclose(got, _attention_reference(q, keys, values, visible), rtol=1e-5, atol=1e-5)
  plain = run(q[:, :1], keys_last[::j], v[::j], np.zeros((b, length), np.int32), 4)   # a plain cache
  visible = np.broadcast_to(np.arange(length) <= 4, (b, 1, length))
  want = _attention_reference(q[:, :1], k[::j][:, None], v[::j][:, None], visible)
  np.testing.assert_allclose(plain, want, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("d, src", [(8, 5), (32, 37), (64, 100)])   # below a vector; blocks and rests
def test_masked_attention_skips_masked_sources_and_averages_a_fully_masked_row(d, src):
  rng = np.random.default_rng(6)
  b, j, h = 3, 2, 2
  q = rng.standard_normal((b, j, h, d)).astype(np.float32)
  k = rng.standard_normal((b, h, src, d)).astype(np.float32)
  v = rng.standard_normal((b, h, src, d)).astype(np.float32)
  mask = np.zeros((b, src), bool)
  mask[0, :3] = mask[1] = True                    # a partly masked row, a whole one, an empty one
  got = np.asarray(jax.jit(cpu_decoding.masked_attention)(q, np.swapaxes(k, 2, 3), v, mask))
  per_query = lambda x: np.broadcast_to(x[:, None], (b, j) + x.shape[1:])
  want = _attention_reference(q, per_query(k), per_query(v), per_query(mask))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[2], np.broadcast_to(v[2].mean(1), (j, h, d)), rtol=1e-5, atol=1e-6)
  # And the XLA attention it replaces agrees (its -1e9 logits zero the masked weights).
  from kernels.decode_cache import cached_attention
  xla = cached_attention(q / d ** -0.5, k, v, mask[:, None, None, :])   # it scales q itself
  np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-5)


def test_cpu_decoding_build_failure_is_reported_and_decoding_falls_back(monkeypatch, tmp_path):
  monkeypatch.setenv("AIAYN_CACHE", str(tmp_path))
  with pytest.raises(RuntimeError, match="failed"):
    cpu_decoding.build(compiler="false")
  monkeypatch.setattr(cpu_decoding, "build", lambda: (_ for _ in ()).throw(RuntimeError("no compiler")))
  cpu_decoding.available.cache_clear()
  try:
    with pytest.warns(UserWarning, match="uses XLA ops .no compiler"):
      assert not cpu_decoding.available()
    assert not decoding_for(SMALL.with_compute(kernels="cpu")).cache(True).ffi
    assert decoding_for(SMALL.with_compute(kernels="cpu")).beam_extensions is None
    assert decoding_for(SMALL.with_compute(kernels="cpu")).decoding_weights.func is output_layer.decoding_kernel
  finally:
    cpu_decoding.available.cache_clear()


@needs_compiler
@pytest.mark.parametrize("b, k, vocab", [(5, 4, 8000), (4, 3, 77), (3, 2, 5), (2, 1, 16)])
def test_beam_extensions_kernel_picks_what_select_extensions_picks(b, k, vocab):
  """Every mode, hypotheses that are out (alive NEG_INF), repeated logits (ties go to the lower index),
  vocabularies of whole blocks, with rests, and smaller than a vector, up to n = k * vocab."""
  from decode import beam_search as bs
  assert cpu_decoding.available()   # builds and registers the custom calls
  rng = np.random.default_rng(vocab)
  logits = (rng.standard_normal((b, k, vocab)) * 3).astype(np.float32)
  logits[0, :, vocab // 2:] = logits[0, :, :vocab - vocab // 2]    # the same logit at two tokens
  logits[:, 0, 3 % vocab] += 10.0                                  # eos the best token of hypothesis 0
  if k > 1:
    logits[-1, 1] = logits[-1, 0]                                 # two hypotheses alike
  alive = -np.sort(rng.exponential(3.0, (b, k)), axis=1).astype(np.float32)
  alive[1 % b, k // 2 + 1:] = bs.NEG_INF
  if k > 1:
    alive[-1, 1] = alive[-1, 0]
  ref = jax.jit(bs.select_extensions, static_argnums=(3, 4))
  kernel = jax.jit(cpu_decoding.beam_extensions, static_argnums=(3, 4))
  for mode in (bs.FREE, bs.NO_EOS, bs.ONLY_EOS, bs.DEAD):
    modes = np.full((b,), mode, np.int32)
    modes[0] = bs.FREE
    for n in sorted({1, min(2 * k, k * vocab), k * vocab}):
      if n > 64:
        continue
      want_values, want_index = ref(logits, alive, modes, n, 3 % vocab)
      got_values, got_index = kernel(logits, alive, modes, n, 3 % vocab)
      np.testing.assert_array_equal(got_index, want_index, err_msg=f"mode {mode}, n {n}")
      np.testing.assert_allclose(got_values, want_values, rtol=1e-6, atol=1e-5)
  # A diverged model's logits: NaN everywhere, or one infinity (NaN totals after it). The picks are
  # unspecified there, but written and in range.
  for bad in (np.nan, np.inf):
    broken = logits.copy()
    broken[0] = np.nan
    broken[-1, 0, 0] = bad
    values, index = kernel(broken, alive, np.zeros((b,), np.int32), min(2 * k, k * vocab), 3 % vocab)
    assert np.all((0 <= np.asarray(index)) & (np.asarray(index) < k * vocab))
    assert np.all(np.isnan(np.asarray(values)[0]))


@needs_compiler
def test_beam_search_with_the_kernel_finds_what_it_finds_with_xla_ops():
  """The whole search, with a sentence that reaches its limit and min_len holding eos back."""
  from decode import beam_search as bs
  assert cpu_decoding.available()
  rng = np.random.default_rng(0)
  vocab, b, k = 300, 3, 4
  table = jnp.asarray(rng.standard_normal((vocab, vocab)) * 2, jnp.float32)   # next-token logits by token

  def step(ids, cache):
    return table[ids] + cache["bias"], cache

  cache = {"bias": jnp.asarray(rng.standard_normal((b, vocab)), jnp.float32)}
  for min_len in (0, 4):
    run = lambda extensions: jax.jit(lambda c: bs.beam_search(
        step, c, batch_size=b, beam_size=k, max_len=jnp.array([3, 9, 12]), max_steps=12, eos_id=3, bos_id=2,
        min_len=min_len, extensions=extensions))(cache)
    want_seqs, want_scores = run(bs.select_extensions)
    got_seqs, got_scores = run(cpu_decoding.beam_extensions)
    np.testing.assert_array_equal(got_seqs, want_seqs)
    np.testing.assert_allclose(got_scores, want_scores, rtol=1e-5)


_THREADS_SCRIPT = """
import os, sys
os.sched_setaffinity(0, {int(c) for c in sys.argv[2].split(",")})   # before JAX sizes its thread pool
import jax, jax.numpy as jnp, numpy as np
from kernels import cpu_decoding, output_layer
rng = np.random.default_rng(0)
f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
b, j, h, d, length, src, vocab = 8, 4, 4, 64, 512, 1024, 32000   # parts long enough for both threads
x, table = f32(64, 200), f32(1000, 200)
panels = output_layer.panels(table, cpu_decoding.panel_width())
slot = jnp.asarray(rng.integers(0, j, (b * j, length)), jnp.int32)
mask = jnp.asarray(rng.random((b, src)) < 0.8)
mode = jnp.asarray(rng.integers(0, 4, (b,)), jnp.int32)
out = {
    "panel": jax.jit(lambda x, p: cpu_decoding.panel_matmul(x, p, 1000))(x, panels),
    "slot": jax.jit(cpu_decoding.slot_attention)(f32(b, j, h, d), f32(b * j, h, d, length),
                                                   f32(b * j, h, length, d), slot, jnp.int32(500)),
    "masked": jax.jit(cpu_decoding.masked_attention)(f32(b, j, h, d), f32(b, h, d, src), f32(b, h, src, d),
                                                       mask),
}
out["values"], out["indices"] = jax.jit(lambda l, a, m: cpu_decoding.beam_extensions(l, a, m, 8, 3))(
    f32(b, j, vocab), f32(b, j), mode)
np.savez(sys.argv[1], **{k: np.asarray(v) for k, v in out.items()})
"""


@needs_compiler
def test_cpu_kernels_give_the_same_bits_on_one_thread_as_on_all(tmp_path):
  """The C++ kernels share their work with XLA's intra-op thread pool, which JAX sizes by the CPUs the
  process may run on: pinned to one CPU, then free on all of them, every kernel's result is the same, bit
  for bit (each part is computed the same way whichever thread takes it)."""
  import os
  import subprocess
  import sys
  cpus = sorted(os.sched_getaffinity(0))
  if len(cpus) < 2:
    pytest.skip(f"needs 2 CPUs to compare one thread with several (this process may use {cpus})")
  script = tmp_path / "threads.py"
  script.write_text(_THREADS_SCRIPT)
  results = []
  for name, allowed in (("one", cpus[:1]), ("all", cpus)):
    path = tmp_path / f"{name}.npz"
    env = {**os.environ, "PYTHONPATH": str(cpu_decoding.SOURCE.parent.parent)}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, str(script), str(path), ",".join(map(str, allowed))],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results.append(np.load(path))
  one, every = results
  assert set(one.files) == {"panel", "slot", "masked", "values", "indices"}
  for name in one.files:
    np.testing.assert_array_equal(one[name], every[name], err_msg=name)
  np.testing.assert_allclose(one["panel"], np.asarray(_panel_reference()), rtol=1e-4, atol=1e-3)


def _panel_reference():
  """The script's panel product in numpy (float64), from the same generator draws."""
  rng = np.random.default_rng(0)
  x, table = rng.standard_normal((64, 200)), rng.standard_normal((1000, 200))
  return x @ table.T


def test_model_init_and_training_never_build_the_cpu_decoding_kernels(monkeypatch):
  """Only decoding asks for the C++ kernels: init, the forward pass and its gradient on the CPU path run
  without them (here: with the build made to fail loudly)."""
  def refuse():
    raise AssertionError("the C++ decoding kernels were asked for outside decoding")
  monkeypatch.setattr(cpu_decoding, "available", refuse)
  cfg = SMALL.with_compute(kernels="cpu")
  ids = random_ids(np.random.default_rng(0), (2, 6))
  model = Transformer(cfg)
  params = model.init({"params": jax.random.key(0)}, ids, ids)["params"]
  jax.grad(lambda p: jnp.sum(model.apply({"params": p}, ids, ids)))(params)
  with pytest.raises(AssertionError, match="outside decoding"):
    init_cache(cfg, 2, 8)


def test_every_environment_switch_is_in_the_accelerators_table():
  """docs/accelerators.md lists every AIAYN_* variable that the code, scripts or tests read."""
  root = pathlib.Path(__file__).resolve().parent.parent
  read = set()
  for pattern in ("*.py", "*.sh"):
    for path in root.rglob(pattern):
      if ".git" not in path.parts and "site-packages" not in path.parts:
        read |= set(re.findall(r"AIAYN_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")))
  doc = (root / "docs" / "accelerators.md").read_text()
  table = doc[doc.index("## The CPU backend and its switches"):doc.index("## What is proven here")]
  listed = set(re.findall(r"^\| `(AIAYN_[A-Z0-9_]+)`", table, re.M))
  assert read and read <= listed, f"not in docs/accelerators.md's table: {sorted(read - listed)}"
