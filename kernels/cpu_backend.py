"""The CPU backend: what compute.kernels="cpu" plugs into the plain model, in one place.

model/ops.py is the one module of model/ that reaches it, through two functions:

    dot_general, dropout = cpu_backend.layer_ops(matmul_dtype)   # every pass: training, eval, decoding
    decoding = cpu_backend.decoding(cfg, plain, dtype, matmul_dtype)   # decoding: a model.ops.Decoding

`layer_ops` gives the layers' matmuls (kernels/flat_matmul.py in float32, kernels/mixed_matmul.py in
mixed precision) and dropout (kernels/dropout16.py). `decoding` takes the plain model.ops.Decoding and
replaces what a decoding step on a CPU runs on:

  cache            kernels/decode_cache.py's head-major caches, and beam slots that beam search never copies
  output weights   the [vocab, d_model] table transposed once (kernels/output_layer.py), in float32 laid
                   out as panels for the C++ product
  layer weights    in float32, every kernel a decoding step multiplies by, laid out as panels once per set
                   of parameters (`layer_panels`); `step_scope` runs the decoder's step with flax's Dense
                   layers multiplying by them (nn.intercept_methods), so the layers need not know
  extensions       beam search's choice of candidates as one C++ call (kernels/cpu_decoding.py), or
                   without it XLA's ops with a top-k pruned by chunks (kernels/beam_top_k.py)

What it implements is declared (`DECODING`, `CACHES`, each its own kernels.declare); model/ops.py decodes a
config with any other field set (model.config.unimplemented) on the plain path instead, and says so
once. The XLA caches attend with the model's mask (model/attention.py's `visible`); the C++ attention
reads the positions up to the step's index instead, which is what `visible` gives for every config
that CACHES takes.

The C++ kernels are built the first time `decoding` is asked for them, never by model.init or training.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import flax.linen as nn
import jax.numpy as jnp

import kernels
from kernels import beam_top_k, cpu_decoding, decode_cache, dropout16, flat_matmul, mixed_matmul, output_layer

# What CPU decoding implements, each its own declaration (kernels.declare): a config that sets any other
# field decodes on the plain path. The step's pieces (panels, output layer, candidate selection): the
# family as tests/test_family.py decodes it.
DECODING = kernels.declare(
    "attention_dropout_rate", "relu_dropout_rate", "pre_norm", "share_embeddings", "attention_bias",
    "num_kv_heads", "logits_bias", "relative_buckets", "relative_max_distance", "num_classes",
    arch=("encoder_decoder", "decoder_only", "encoder_only"),
    positions=("sinusoidal", "learned", "rope", "alibi", "relative"),
    activation=("relu", "gelu", "swish", "swiglu", "geglu"), norm=("layernorm", "rmsnorm"))
# The head-major and beam-slot caches and the C++ attention, which compute the attention themselves: the
# paper's encoder-decoder (num_heads key and value heads, no prompt, no positions inside attention).
CACHES = kernels.declare(
    "attention_dropout_rate", "relu_dropout_rate", "pre_norm", "share_embeddings", "attention_bias",
    "logits_bias", "relative_buckets", "relative_max_distance", "num_classes",
    arch=("encoder_decoder",), positions=("sinusoidal", "learned"),
    num_kv_heads=lambda cfg: cfg.kv_heads == cfg.num_heads,
    activation=("relu", "gelu", "swish", "swiglu", "geglu"), norm=("layernorm", "rmsnorm"))
PANELS = "panels"   # the decoding memory's key for the layer weights
ATTENTIONS = {"self_attention": ("query", "key", "value", "out"),
              # cross-attention's keys and values are computed once per batch: they keep their kernels
              "cross_attention": ("query", "out")}


def layer_ops(matmul_dtype):
  """(dot_general for every matmul, a dropout module class), for a matmul dtype (None: the compute dtype)."""
  return mixed_matmul.dot_general_for(matmul_dtype) or flat_matmul.dot_general, dropout16.Dropout


def decoding(cfg, plain, dtype, mixed, caches: bool):
  """`plain` (a model.ops.Decoding) with the CPU decoding backend's pieces, for a `cfg` that DECODING
  takes; dtype: the compute dtype, mixed: the matmul operand dtype where it is below it (else None);
  caches: whether CACHES takes cfg too (else the plain cache)."""
  # The C++ attention (one custom call per attention) and panel products where they built; float32 only.
  ffi = mixed is None and dtype == jnp.float32 and cpu_decoding.available()
  shape = dict(num_layers=cfg.num_decoder_layers, num_heads=cfg.num_heads, d_k=cfg.head_dim_k,
               d_v=cfg.head_dim_v, dtype=dtype)

  def cache(beam_slots):
    if not caches:
      return plain.cache(beam_slots)
    kind = decode_cache.BeamSlotCache if beam_slots else decode_cache.HeadMajorCache
    return kind(**shape, matmul_dtype=mixed, ffi=ffi)
  beam_extensions = cpu_decoding.beam_extensions if cpu_decoding.available() else None
  if ffi:
    return dataclasses.replace(
        plain, cache=cache, decoding_weights=output_layer.decoding_panels,
        decoding_logits=functools.partial(output_layer.panel_logits, vocab=cfg.vocab_size),
        beam_extensions=beam_extensions, extensions=functools.partial(extensions, beam_extensions),
        layer_weights=layer_panels, step_scope=step_scope)
  weights = functools.partial(output_layer.decoding_kernel, dtype=mixed or dtype)
  return dataclasses.replace(plain, cache=cache, decoding_weights=weights, decoding_logits=output_layer.logits,
                             beam_extensions=beam_extensions,
                             extensions=functools.partial(extensions, beam_extensions))


def extensions(kernel, select_extensions):
  """What a search picks a step's candidates with: `kernel` (the C++ beam_extensions) where the program
  is lowered for a CPU and select_extensions on every other platform; without the kernel, XLA's ops
  with the top-k pruned by chunks (kernels/beam_top_k.py)."""
  if kernel is None:
    return functools.partial(select_extensions, top=beam_top_k.top_extensions)
  return lambda logits, alive_logp, mode, n, eos_id: cpu_decoding.on_cpu(
      kernel, select_extensions, logits, alive_logp, mode, n=n, eos_id=eos_id)


# ---- The decoder's kernels as panels --------------------------------------------------------------

def _contracted(name: str) -> int:
  """How many leading axes of a kernel its layer contracts: attention's W^O reads heads and d_v."""
  return 2 if name == "out" else 1


def kernel_panels(kernel, contracted: int):
  """A kernel [*d_in axes, *d_out axes] as the panels of x @ kernel [d_in, d_out]."""
  return output_layer.kernel_panels(kernel.reshape(math.prod(kernel.shape[:contracted]), -1))


def layer_panels(decoder_params) -> dict:
  """{PANELS: per decoder layer {sub-layer: {dense layer: panels}}}: every kernel of a decoding step."""
  layers = []
  for i in range(len([name for name in decoder_params if name.startswith("layers_")])):
    params = decoder_params[f"layers_{i}"]
    layer = {"ffn": {name: kernel_panels(p["kernel"], 1) for name, p in params["ffn"].items()}}
    for attention, names in ATTENTIONS.items():
      if attention in params:
        layer[attention] = {name: kernel_panels(params[attention][name]["kernel"], _contracted(name))
                            for name in names}
    layers.append(layer)
  return {PANELS: layers}


def panel_product(module, x, panels):
  """A flax Dense or DenseGeneral `module` applied to x on its kernel laid out as panels."""
  if isinstance(module, nn.DenseGeneral):
    axes = (module.axis,) if isinstance(module.axis, int) else tuple(module.axis)
    if module.batch_dims or sorted(axes) != list(range(-len(axes), 0)):
      raise ValueError(f"kernels/cpu_backend.py: panels need the trailing axes contracted and no batch_dims, "
                       f"not axis={module.axis}, batch_dims={module.batch_dims}")
    contracted = len(axes)
  else:
    contracted = 1
  features = (module.features,) if isinstance(module.features, int) else tuple(module.features)
  lead = x.shape[:x.ndim - contracted]
  rows = x.reshape(math.prod(lead), -1)                                        # [n, d_in]
  y = output_layer.panel_matmul(rows, panels, math.prod(features))           # float32 [n, d_out]
  if module.use_bias:
    y = y + module.get_variable("params", "bias").reshape(-1)
  return y.reshape(lead + features).astype(module.dtype)


def step_scope(memory):
  """The context a decoding step runs in: every Dense layer of a decoder layer (module path
  .../layers_i/sub-layer/name) that has panels in memory[PANELS] multiplies by them instead of its kernel."""
  panels = memory.get(PANELS)
  if panels is None:
    return contextlib.nullcontext()

  def intercept(call, args, kwargs, context):
    module = context.module
    if context.method_name == "__call__" and isinstance(module, (nn.Dense, nn.DenseGeneral)):
      layer, sublayer, name = ("", "", "") if len(module.path) < 3 else module.path[-3:]
      prefix, _, index = layer.rpartition("_")
      if prefix == "layers" and index.isdigit():
        laid_out = panels[int(index)].get(sublayer, {}).get(name)
        if laid_out is not None:
          return panel_product(module, *args, laid_out)
    return call(*args, **kwargs)
  return nn.intercept_methods(intercept)
