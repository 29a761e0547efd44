"""What GPU and TPU users run lowers for them, from this CPU host, with the default kernels="auto" and
attention_impl="auto": the train step of the base and big models in bfloat16, the eval step, beam search
and greedy search, exported with jax.export (lowering only: nothing is compiled). None carries a custom
call of the CPU decoding backend (kernels/cpu_decoding.py), although tracing them here chooses that
backend: each of its calls is resolved where the program is lowered.

The train and eval steps are exported for "cuda" and for "tpu" one at a time, as a user compiling ahead
of time for one kind of machine does: their attention takes Pallas's splash kernel on a TPU, and JAX
lowers a Pallas TPU kernel for no other platform, so one program for both would fail to lower
(docs/accelerators.md). The searches, whose lengths splash does not take here, go for both at once.
"""
import dataclasses
import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import export

import kernels
from data.batching import BATCH_KEYS
from decode import translate as translate_lib
from kernels import cpu_decoding
from model import Transformer, TransformerConfig, config as config_lib
from train import step as step_lib

PLATFORMS = ("cuda", "tpu")
OURS = tuple(cpu_decoding.TARGETS)   # aiayn_slot_attention, aiayn_panel_matmul, ...
REMAT = ("none", "minimal", "full")
SCAN = (False, True)


def _custom_calls(module_text: str) -> set:
  return set(re.findall(r"custom_call @([\w$.]+)", module_text))


def _lower(fn, *args, platforms=PLATFORMS, allow=()) -> str:
  """fn (jitted) exported for `platforms` on these abstract arguments -> its StableHLO text."""
  checks = [export.DisabledSafetyCheck.custom_call(name) for name in allow]
  return kernels.export(fn, *args, platforms=platforms, disabled_checks=checks).mlir_module()


def _assert_none_of_ours(text: str):
  ours = sorted(c for c in _custom_calls(text) if c in OURS or c.startswith("aiayn"))
  assert not ours, f"the CPU decoding backend's custom calls reached a GPU/TPU program: {ours}"


def _model(preset: str, compute=config_lib.Compute(), **changes) -> Transformer:
  cfg = config_lib.PRESETS[preset](compute=compute, **changes)
  assert cfg.compute.kernels == "auto" and cfg.compute.attention_impl == "auto"   # the defaults, as a user has them
  return Transformer(cfg)


def _abstract_batch(rows: int, length: int) -> dict:
  return {key: jax.ShapeDtypeStruct((rows, length), jnp.int32) for key in BATCH_KEYS}


def _abstract_params(model: Transformer):
  ids = jnp.ones((1, 2), jnp.int32)
  return jax.eval_shape(lambda: model.init({"params": jax.random.key(0)}, ids, ids)["params"])


def _train_step_texts(model, rows=8, length=256, platforms=PLATFORMS, rng_impl="threefry2x32") -> dict:
  """{platform: the train step's StableHLO lowered for it}, for "cuda" and "tpu"."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  schedule = lambda step: 1e-3
  tx = optax.adam(schedule)
  state, _ = step_lib.abstract_state(model, tx, mesh)
  # train_step as jit_train_step jits it, less the donation (which jax.export does not take)
  step = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, schedule=schedule,
                                   label_smoothing=0.1))
  rng = jax.eval_shape(lambda: jax.random.key(0, impl=rng_impl))
  return {p: _lower(step, state, _abstract_batch(rows, length), rng, platforms=(p,)) for p in platforms}


def _float32_vocab_arrays(text: str, vocab: int, tokens: int):
  """(dot_general lines with a float32 operand that has the vocabulary's dimension, float32 array types
  holding `tokens` x vocab elements or more) of a StableHLO text."""
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line
          and re.search(rf"tensor<(\d+x)*{vocab}(x\d+)*xf32>", line.split(" : ")[-1].split("->")[0])]
  big = set()
  for dims in re.findall(r"tensor<((?:\d+x)+)f32>", text):
    shape = [int(d) for d in dims.rstrip("x").split("x")]
    if vocab in shape and np.prod(shape) >= tokens * vocab:
      big.add("x".join(map(str, shape)))
  return dots, sorted(big)


def _largest_threefry(text: str) -> int:
  """Elements of the largest operand of any threefry2x32 call: the bulk of dropout's random bits, or
  key arithmetic (an rbg key's fold_in and split are threefry on a few words)."""
  sizes = [0]
  for line in text.splitlines():
    if re.search(r"call @threefry2x32\w*\(", line):
      sizes += [int(np.prod([int(d) for d in dims.rstrip("x").split("x")]))
                for dims in re.findall(r"tensor<((?:\d+x)+)ui32>", line.split(" : ")[-1])]
  return max(sizes)


def _ops(text: str):
  """The operations of a StableHLO text with their types, as a multiset; without what
  jax.lax.platform_dependent wraps its lowered branch in (a case on a constant index)."""
  from collections import Counter
  ops = Counter()
  for line in text.splitlines():
    line = re.sub(r"loc\([^)]*\)", "", line)
    found = re.search(r"\b((?:stablehlo|chlo|mhlo)\.[a-z_]+|call @[\w.$]+|custom_call @[\w.$]+)", line)
    if found and found.group(1) not in ("stablehlo.case", "stablehlo.return", "stablehlo.constant"):
      ops[(found.group(1), line.split(" : ")[-1].strip() if " : " in line else "")] += 1
  return ops


# The default suite lowers a representative few (bfloat16 throughout, as on an accelerator); `-m slow`
# every remat x scan setting of both sizes.
_FAST = {("base", "none", False), ("big", REMAT[-1], SCAN[-1])}
_CASES = [pytest.param(preset, remat, scan, marks=() if (preset, remat, scan) in _FAST else pytest.mark.slow,
                       id=f"{preset}-remat_{remat}-{'scanned' if scan else 'unrolled'}")
          for preset in ("base", "big") for remat in REMAT for scan in SCAN]


@pytest.mark.parametrize("preset, remat, scan", _CASES)
def test_train_step_lowers_for_gpu_and_tpu_without_cpu_kernels(preset, remat, scan):
  model = _model(preset, config_lib.Compute(dtype="bfloat16", remat=remat, scan_layers=scan))
  texts = _train_step_texts(model)
  for platform, text in texts.items():
    _assert_none_of_ours(text)
    # The output layer reads bfloat16 and the loss is chunked: no float32 matmul of the vocabulary's
    # size and no [tokens, vocab] float32 array, forward or backward (8 x 256 = 2,048 target tokens).
    dots, arrays = _float32_vocab_arrays(text, model.cfg.vocab_size, tokens=8 * 256)
    assert not dots, f"{platform}: float32 dot_generals over the vocabulary: {dots[:2]}"
    assert not arrays, f"{platform}: [tokens, vocab] float32 arrays: {arrays}"
    # dropout draws from the configured PRNG (threefry by default)
    assert _largest_threefry(text) >= 8 * 256 and "rng_bit_generator" not in text
  # attention_impl="auto" chose splash attention where lowered for a TPU (lengths of 256: whole blocks).
  assert "tpu_custom_call" in _custom_calls(texts["tpu"])
  assert "tpu_custom_call" not in _custom_calls(texts["cuda"])


def test_eval_step_lowers_for_gpu_and_tpu_without_cpu_kernels():
  model = _model("base", config_lib.Compute(dtype="bfloat16"))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  params = _abstract_params(model)
  shardings = jax.tree_util.tree_map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                                     params)
  step = step_lib.jit_eval_step(model, mesh, shardings, label_smoothing=0.1)
  for platform in PLATFORMS:
    _assert_none_of_ours(_lower(step, params, _abstract_batch(8, 256), platforms=(platform,)))


def _search_text(cfg, beam_size, sampling=(), platforms=PLATFORMS, allow=()):
  model = Transformer(cfg)
  search = translate_lib.search_fn(cfg, beam_size, 0.6, 0, 24, sampling)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  src, limits = jax.ShapeDtypeStruct((4, 16), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32)
  return _lower(search, _abstract_params(model), src, limits, rng, platforms=platforms, allow=allow)


@pytest.mark.parametrize("beam_size, sampling", [(4, ()), (1, (("temperature", 0.0),))],
                         ids=["beam4", "greedy"])
def test_float32_search_lowers_for_gpu_and_tpu_without_cpu_kernels(beam_size, sampling):
  """The base model in float32, which on this host decodes with every C++ kernel (attention, panel
  products, beam top-k): lowered for GPU and TPU, the XLA ops stand in their place."""
  _assert_none_of_ours(_search_text(config_lib.base(), beam_size, sampling))


def test_the_same_search_lowered_for_this_cpu_carries_the_cpu_kernels():
  """The check above can fail: lowered for the CPU, the same kind of program holds our custom calls."""
  if not cpu_decoding.available():
    pytest.skip("the C++ decoding kernels are not built here (no C++ compiler): nothing to find")
  cfg = TransformerConfig(vocab_size=64, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1,
                          num_decoder_layers=1, max_len=64)
  text = _search_text(cfg, 4, platforms=("cpu",), allow=OURS)
  assert {"aiayn_slot_attention", "aiayn_masked_attention", "aiayn_panel_matmul",
          "aiayn_beam_extensions"} <= _custom_calls(text)


def test_auto_lowered_for_a_gpu_or_tpu_is_the_step_a_gpu_or_tpu_host_traces():
  """kernels="auto" is resolved where the program is lowered (jax.lax.platform_dependent), not by this
  CPU host: exported for cuda (or tpu), the auto step carries exactly the operations of the step traced
  with kernels="reference", and none of the CPU path's; exported for the CPU, it carries the CPU path's."""
  small = dict(vocab_size=512, d_model=64, d_ff=128, num_heads=4, num_encoder_layers=1, num_decoder_layers=1)
  bf16 = config_lib.Compute(dtype="bfloat16")
  auto = _train_step_texts(_model("base", bf16, **small), rows=4, length=128, platforms=("cuda", "tpu", "cpu"))
  reference = _train_step_texts(Transformer(config_lib.base(compute=bf16.replace(kernels="reference"), **small)),
                                rows=4, length=128, platforms=("cuda", "tpu"))
  cpu = _train_step_texts(Transformer(config_lib.base(compute=bf16.replace(kernels="cpu"), **small)), rows=4,
                          length=128, platforms=("cpu",))
  for platform in ("cuda", "tpu"):
    assert _ops(auto[platform]) == _ops(reference[platform]), platform
  assert _ops(auto["cpu"]) == _ops(cpu["cpu"])
  assert _ops(auto["cpu"]) != _ops(auto["cuda"])   # the check can fail: the two paths differ


def _branch_recorder(traced: list):
  """fn(cfg, x) for on_lowering_platform that records the kernels it is traced with: sin(x) for "cpu",
  cos(x) for "reference"."""
  def fn(cfg, x):
    traced.append(cfg.compute.kernels)
    return jnp.sin(x) if cfg.compute.kernels == "cpu" else jnp.cos(x)
  return fn


def test_a_plain_jit_traces_only_its_platforms_branch_and_an_export_every_platforms():
  """A plain jit on this CPU traces kernels="auto" as "cpu" only; exported for cuda, alone or beside the
  cpu and tpu, the same jitted function is traced again with both branches, and cuda's is the reference.
  Neither trace leaks into the other through jit's cache, in either order."""
  assert jax.default_backend() == "cpu"
  cfg = TransformerConfig(vocab_size=8, d_model=8, d_ff=16, num_heads=2, num_encoder_layers=1,
                          num_decoder_layers=1)
  assert cfg.compute.kernels == "auto"
  x = jnp.arange(3.0)
  for plain_first in (True, False):
    traced = []
    step = jax.jit(lambda x: kernels.on_lowering_platform(_branch_recorder(traced), cfg, x))
    if plain_first:
      np.testing.assert_allclose(step(x), jnp.sin(x))
      assert traced == ["cpu"]
    traced.clear()
    cuda = kernels.export(step, x, platforms=("cuda",)).mlir_module()
    assert sorted(traced) == ["cpu", "reference"]   # platform_dependent, not this host's choice
    assert "stablehlo.cosine" in cuda and "stablehlo.sine" not in cuda   # lowered for cuda: the reference
    traced.clear()
    every = kernels.export(step, x, platforms=("cpu", "cuda", "tpu"))
    assert sorted(traced) == ["cpu", "reference"]
    text = every.mlir_module()
    assert "stablehlo.cosine" in text and "stablehlo.sine" in text   # each platform keeps its branch
    np.testing.assert_allclose(every.call(x), jnp.sin(x))   # run here, on the CPU: the cpu branch
    traced.clear()
    np.testing.assert_allclose(step(x), jnp.sin(x))   # the plain call: its own trace, cpu only (traced
    assert traced == ["cpu"] or (plain_first and not traced)   # again once lowering_for is first used)
  with pytest.raises(ValueError, match="gpu"):
    kernels.lowering_for(("gpu",)).__enter__()


def test_every_export_enters_lowering_for():
  """A program exported for another machine must be traced inside kernels.lowering_for, or a choice made
  while tracing follows this host: every jax.export in the code base goes through kernels.export."""
  root = pathlib.Path(__file__).resolve().parents[1]
  direct = re.compile(r"\bjax\.export\.export\(|\bfrom jax import export\b|\bfrom jax\.export import\b")
  allowed = {pathlib.Path("kernels/__init__.py"), pathlib.Path("tests/test_lowering.py")}   # it; this test
  offenders = []
  for path in sorted(root.rglob("*.py")):
    relative = path.relative_to(root)
    if relative.parts[0].startswith(".") or relative.parts[0] in ("build", "dist") or relative in allowed:
      continue
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
      if direct.search(line):
        offenders.append(f"{relative}:{number}: {line.strip()}")
  assert not offenders, ("export with kernels.export(fn, *args, platforms=...), which traces inside "
                         f"kernels.lowering_for: {offenders}")


def test_dropout_draws_from_the_configured_prng():
  small = dict(vocab_size=512, d_model=64, d_ff=128, num_heads=4, num_encoder_layers=1, num_decoder_layers=1)
  texts = _train_step_texts(_model("base", config_lib.Compute(dtype="bfloat16"), **small), rows=4, length=128,
                            rng_impl="rbg")
  for text in texts.values():   # the bits from rng_bit_generator; threefry only on the key's few words
    assert "rng_bit_generator" in text and _largest_threefry(text) <= 4


def test_an_imported_marian_models_switches_lower_for_gpu_and_tpu():
  """What export/load_hf.py sets (swish, the logits bias, untied tables, epsilon 1e-5): the train step
  and beam search lower for both, and the search reads the logits bias."""
  cfg = config_lib.TransformerConfig(vocab_size=512, d_model=64, d_ff=128, num_heads=4, num_encoder_layers=1,
                                     num_decoder_layers=1, activation="swish", logits_bias=True,
                                     share_embeddings=False, layer_norm_epsilon=1e-5)
  for text in _train_step_texts(Transformer(cfg.with_compute(dtype="bfloat16")), rows=4, length=128).values():
    _assert_none_of_ours(text)
  text = _search_text(cfg, 4, ())
  _assert_none_of_ours(text)
  assert "final_logits_bias" in text   # the search reads the bias (locations name the parameters)
