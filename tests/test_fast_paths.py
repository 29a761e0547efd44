"""Every fast path against every switch of the model (model/config.py's TransformerConfig): cuDNN's fused
attention (lowered for cuda with jax.export), splash (lowered for tpu, and run here in Pallas interpret
mode) and the fused output layer and loss each either compute what the plain path computes, or fall back
to it saying so, naming the field. Each fast path holds its own declaration: declaring a field for one
declares it for no other. (CPU decoding over the switches: tests/test_family.py's cached-decoding tests;
a switch added at test time: tests/test_adding_a_switch.py.)"""
import dataclasses
import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo

import kernels
from export import weights as export_weights
from export.weights import UnsupportedOption, check_exportable
from kernels import cpu_backend, cpu_decoding, fused_attention, output_layer
from model import Compute, Transformer, TransformerConfig, config as config_lib, ops
from model.cache import KVCache
from train import step as step_lib

BASE = dict(vocab_size=40, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1, num_decoder_layers=1,
            max_len=256, dropout_rate=0.0)
# One entry per switch value of the family (a field beyond the paper's sizes, kernels.PAPER), each on the
# paper's model; test_the_switches_are_every_field_and_value_of_the_config holds the list to the config.
SWITCHES = {
    "attention_dropout": dict(attention_dropout_rate=0.1),
    "relu_dropout": dict(relu_dropout_rate=0.1),
    "pre_norm": dict(pre_norm=True),
    "unshared": dict(share_embeddings=False),
    "no_attention_bias": dict(attention_bias=False),
    "decoder_only": dict(arch="decoder_only"),
    "encoder_only": dict(arch="encoder_only"),
    "classifier": dict(arch="encoder_only", num_classes=3),
    "learned": dict(positions="learned"),
    "rope": dict(positions="rope"),
    "alibi": dict(positions="alibi"),
    "relative": dict(positions="relative", relative_buckets=8, relative_max_distance=16),
    "decoder_only_alibi": dict(arch="decoder_only", positions="alibi"),   # every attention has a bias
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "gelu": dict(activation="gelu"),
    "swish": dict(activation="swish"),
    "swiglu": dict(activation="swiglu"),
    "geglu": dict(activation="geglu"),
    "logits_bias": dict(logits_bias=True),
    "rmsnorm": dict(norm="rmsnorm"),
    "new_switch": dict(new_switch=1),   # a field no fast path declares (NewConfig below)
}
# The default suite lowers for every switch, and runs the compiled comparisons on two each (the paper's
# model, grouped heads and packing: tests/test_fused_attention.py, test_train_step.py); `-m slow` all.
SPLASH_DEFAULT = ("alibi", "new_switch")   # a score bias: cross-attention takes splash, self-attention not
LOSS_DEFAULT = ("logits_bias", "new_switch")


@dataclasses.dataclass(frozen=True)
class NewConfig(TransformerConfig):
  new_switch: int = 0   # a switch added after every declaration was written (no model logic reads it)


def _cfg(name, **compute):
  return NewConfig(**BASE, **SWITCHES[name], compute=Compute(**compute))


def _named(changes) -> list:
  """What a fallback must name: 'field=value' of each changed field."""
  return [f"{field}={value!r}" for field, value in changes.items()]


def _switches(names, default):
  return [pytest.param(n, marks=() if n in default else pytest.mark.slow) for n in names]


@pytest.fixture
def said(caplog, monkeypatch):
  """The log lines of model/ops.py and kernels/fused_attention.py from here on, each once-only message
  said afresh (what an earlier test said is said again)."""
  monkeypatch.setattr(ops, "_SAID", set())
  monkeypatch.setattr(fused_attention, "_SAID", set())
  caplog.set_level(logging.INFO, logger="model.ops")
  caplog.set_level(logging.INFO, logger=fused_attention.__name__)
  return lambda: [r for r in caplog.records if r.name in ("model.ops", fused_attention.__name__)]


def test_the_switches_are_every_field_and_value_of_the_config():
  """A switch added to TransformerConfig, or a value to one of its choices, must be added above."""
  fields = {f.name for f in dataclasses.fields(TransformerConfig)} - set(kernels.PAPER)
  changed = {field for changes in SWITCHES.values() for field in changes}
  assert fields <= changed, f"switches with no entry in SWITCHES: {sorted(fields - changed)}"
  for field, values in (("arch", config_lib.ARCHS), ("positions", config_lib.POSITIONS),
                        ("activation", config_lib.ACTIVATIONS), ("norm", config_lib.NORMS)):
    default = getattr(TransformerConfig(), field)
    missing = {v for v in values if v != default} - {c.get(field) for c in SWITCHES.values()}
    assert not missing, f"{field}: values with no entry in SWITCHES: {sorted(missing)}"


# ---------------------------------------------------------------------------- each its own declaration
def _takes(cfg) -> dict:
  """{fast path: whether it computes cfg} for every fast path and export format, read from what each
  does (nothing compiled): CPU decoding's step pieces and its caches, each fused attention with "auto",
  the fused loss, each export format."""
  with pytest.MonkeyPatch.context() as patch:   # the XLA pieces: no C++ kernels built for this
    patch.setattr(cpu_decoding, "available", lambda: False)
    decoding = ops.decoding_for(cfg.with_compute(kernels="cpu"))
  _, fused = ops.attention_impl(cfg.with_compute(attention_impl="auto"))

  def exports(fmt):
    try:
      check_exportable(cfg, fmt)
      return True
    except UnsupportedOption:
      return False
  return {"cpu_backend.DECODING": decoding.decoding_logits is output_layer.logits,
          "cpu_backend.CACHES": not isinstance(decoding.cache(True), KVCache),
          "fused_attention.CUDNN": "cudnn" in fused, "fused_attention.SPLASH": "splash" in fused,
          "ops.FUSED_LOSS": ops.ops_for(cfg).fused_loss,
          "export HF": exports("hf"), "export CTRANSLATE2": exports("ctranslate2")}


DECLARATIONS = {"cpu_backend.DECODING": (cpu_backend, "DECODING"), "cpu_backend.CACHES": (cpu_backend, "CACHES"),
                "fused_attention.CUDNN": (fused_attention, "CUDNN"),
                "fused_attention.SPLASH": (fused_attention, "SPLASH"), "ops.FUSED_LOSS": (ops, "FUSED_LOSS"),
                "export HF": (export_weights, "HF"), "export CTRANSLATE2": (export_weights, "CTRANSLATE2")}


def _declaration(name):
  module, attr = DECLARATIONS[name]
  return getattr(module, attr)


def test_declaring_a_field_for_one_fast_path_declares_it_for_no_other(said):
  """The dummy field (NewConfig.new_switch), declared in one declaration's own dict, is taken by that
  fast path alone; every other still falls back (or refuses). The paper's base is read-only."""
  cfg = NewConfig(**BASE, new_switch=1)
  assert not any(_takes(cfg).values())
  assert all(_takes(NewConfig(**BASE)).values())   # the paper's model: every path takes it
  for name in DECLARATIONS:
    # (CPU decoding asks its caches only for what its step takes: the caches' field goes in both)
    declared = (name, "cpu_backend.DECODING") if name == "cpu_backend.CACHES" else (name,)
    with pytest.MonkeyPatch.context() as patch:
      for each in declared:
        patch.setitem(_declaration(each), "new_switch", config_lib.ANY)
      takes = _takes(cfg)
    assert {path for path, taken in takes.items() if taken} == set(declared), (name, takes)
  ids = [id(_declaration(name)) for name in DECLARATIONS]
  assert len(set(ids)) == len(ids)
  with pytest.raises(TypeError):
    kernels.PAPER["new_switch"] = None


def test_every_fallback_is_a_warning_naming_the_path_and_the_field(said):
  _takes(NewConfig(**BASE, new_switch=1))
  lines = [r for r in said() if "new_switch=1" in r.getMessage()]
  for path in ("kernels/cpu_backend.py's DECODING", "cudnn (kernels/fused_attention.py's CUDNN)",
               "splash (kernels/fused_attention.py's SPLASH)", "FUSED_LOSS"):
    assert [r for r in lines if path in r.getMessage()], path
  assert lines and all(r.levelno == logging.WARNING for r in lines)
  count = len(said())
  _takes(NewConfig(**BASE, new_switch=1))
  assert len(said()) == count   # said once


# ------------------------------------------------------------------------ the fused attention kernels
CUDNN_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaScaleBiasSoftmax")


def _lowered(cfg, platform: str) -> set:
  """The custom calls of the model's teacher-forced logits (two rows of 128 tokens), exported for
  `platform` from this host with jax.export (as kernels.export exports for another machine)."""
  model = Transformer(cfg)
  ids = jnp.ones((2, 128), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids))
  abstract = jax.ShapeDtypeStruct(ids.shape, ids.dtype)
  checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in CUDNN_CALLS]
  text = kernels.export(jax.jit(model.apply), params, abstract, abstract, platforms=(platform,),
                        disabled_checks=checks).mlir_module()
  return set(re.findall(r"custom_call @([\w$.]+)", text))


@pytest.mark.parametrize("name", SWITCHES)
def test_cudnn_and_splash_lowered_take_each_switch_or_fall_back_naming_it(name, said, monkeypatch):
  """attention_impl="auto" in bfloat16 exported for cuda holds cuDNN's custom call, and for tpu splash's,
  unless the kernel fell back, which is then said naming the switch. jax's CUDA plugin is absent here, so
  its check for cuDNN is told a version (the one thing that needs a GPU host); the lowering is jax's."""
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90800)
  cfg = _cfg(name, dtype="bfloat16")
  for platform, has_kernel in (("cuda", lambda calls: any(c.startswith("__cudnn$fmha") for c in calls)),
                               ("tpu", lambda calls: "tpu_custom_call" in calls)):
    if not has_kernel(_lowered(cfg, platform)):
      lines = " | ".join(r.getMessage() for r in said())
      assert any(field in lines for field in _named(SWITCHES[name])), (platform, lines)
    elif name == "new_switch":
      pytest.fail(f"{platform}: a fused kernel took a field it does not declare")
  if name == "decoder_only_alibi":   # the check can fail: here splash takes no attention
    assert "tpu_custom_call" not in _lowered(cfg, "tpu")


def _logits(cfg):
  """The model's logits on two rows of 128 tokens (the second padded) and where they are real."""
  rng = np.random.default_rng(0)
  src = jnp.asarray(rng.integers(3, 40, size=(2, 128)), jnp.int32).at[1, 100:].set(0)
  tgt = jnp.asarray(rng.integers(3, 40, size=(2, 128)), jnp.int32).at[1, 90:].set(0)
  params = Transformer(cfg.with_compute(attention_impl="xla")).init(jax.random.key(0), src, tgt)
  logits = np.asarray(jax.jit(Transformer(cfg).apply)(params, src, tgt))
  return logits, np.asarray((src if cfg.arch == "encoder_only" else tgt) != 0)


@pytest.mark.parametrize("name", _switches(SWITCHES, SPLASH_DEFAULT))
def test_splash_in_interpret_mode_computes_each_switch_as_the_plain_path(name, said):
  """attention_impl="splash" runs the TPU kernel in Pallas interpret mode here: the logits equal the plain
  attention's, or splash fell back (for every attention) naming the switch."""
  want, real = _logits(_cfg(name, attention_impl="xla"))
  got, _ = _logits(_cfg(name, attention_impl="splash"))
  np.testing.assert_allclose(got[real], want[real], atol=1e-4)
  if name == "new_switch":
    assert [r for r in said() if "new_switch=1" in r.getMessage() and "SPLASH" in r.getMessage()]


@pytest.mark.parametrize("name", _switches(SWITCHES, SPLASH_DEFAULT))
def test_what_the_model_hands_cudnn_computes_each_switch_as_the_plain_path(name, said, monkeypatch):
  """cuDNN cannot run here, so jax.nn.dot_product_attention is computed with XLA's implementation at that
  boundary: what the model hands cuDNN (queries, keys, values, the mask or lengths, the bias) gives the
  plain attention's logits in bfloat16, or cuDNN fell back naming the switch and was never called."""
  calls = []
  real = jax.nn.dot_product_attention

  def as_xla(*args, implementation=None, **kwargs):
    calls.append(implementation)
    return real(*args, implementation="xla", **kwargs)
  monkeypatch.setattr(jax.nn, "dot_product_attention", as_xla)
  got, real_tokens = _logits(_cfg(name, dtype="bfloat16", attention_impl="cudnn"))
  want, _ = _logits(_cfg(name, dtype="bfloat16", attention_impl="xla"))
  np.testing.assert_allclose(got[real_tokens].astype(np.float32), want[real_tokens].astype(np.float32), atol=5e-2)
  assert bool(calls) == (name != "new_switch") and set(calls) <= {"cudnn"}
  if not calls:
    assert [r for r in said() if "new_switch=1" in r.getMessage() and "CUDNN" in r.getMessage()]


# --------------------------------------------------------------------------- the fused output layer and loss
def _batch(cfg):
  rng = np.random.default_rng(1)
  ids = lambda: jnp.asarray(rng.integers(3, 40, size=(2, 12)), jnp.int32)
  segments = jnp.ones((2, 12), jnp.int32).at[1, 9:].set(0)
  positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
  return dict(src=ids(), tgt_in=ids(), tgt_out=ids(), src_segments=segments, tgt_segments=segments,
              src_positions=positions, tgt_positions=positions)


@pytest.mark.parametrize("name", _switches([n for n in SWITCHES if n not in ("encoder_only", "classifier")],
                                           LOSS_DEFAULT))
def test_the_fused_loss_computes_each_switch_as_the_plain_loss(name, said):
  """The eval step's sums with the output layer fused into the loss (4 tokens a chunk) equal those of the
  full logits, where the fused loss declares the switch; where not, it falls back saying so. (The
  masked LM's head keeps its full logits: encoder-only has no fused loss.)"""
  cfg = _cfg(name)
  model = Transformer(cfg)
  batch = _batch(cfg)
  params = model.init(jax.random.key(0), batch["src"], batch["tgt_in"])["params"]
  sums = lambda chunk: jax.jit(functools.partial(step_lib.eval_step, model=model, label_smoothing=0.1,
                                                 loss_chunk_tokens=chunk))(params, batch)
  fused, plain = sums(4), sums(0)
  for key in plain:
    np.testing.assert_allclose(fused[key], plain[key], rtol=1e-5, err_msg=key)
  if not ops.ops_for(cfg).fused_loss:
    assert [r for r in said() if "FUSED_LOSS" in r.getMessage()
            and any(f in r.getMessage() for f in _named(SWITCHES[name]))]
  assert ops.ops_for(cfg).fused_loss == (name != "new_switch")
