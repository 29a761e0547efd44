"""What the layers compute with, and what decoding runs on: the plain reference operations, or the
kernels/ fast paths.

TransformerConfig.kernels chooses, here: "reference" uses the plain pieces below and model/cache.py;
"cpu" plugs in the XLA:CPU fast paths of kernels/ (same results, see tests/test_kernels.py); "auto" picks
"cpu" in a program lowered for the CPU and "reference" in one lowered for a GPU or TPU. The train and
eval steps resolve "auto" where the program is lowered (`on_lowering_platform`, jax.lax.platform_dependent):
a step exported from this CPU host for "cuda" is exactly the step a GPU host traces with "reference".
Decoding, whose cache layout is chosen before anything is traced, resolves it from the devices JAX runs
on (kernels.resolve). The layers receive the chosen pieces as arguments (a `dot_general` for their
matmuls, a dropout module class), so they read the same either way.

Two choices: `ops_for` (what every pass computes with: training, evaluation, decoding) and
`decoding_for` (what decoding alone runs on: the cache, the output layer's weights, the decoder's
kernels as panels and beam search's choice of candidates). With "cpu" the latter is the CPU decoding
backend: kernels/decode_cache.py's caches and, in float32, kernels/cpu_decoding.py's C++ kernels, which
are built the first time `decoding_for` is asked for them, never by model.init or training. Every C++
call is chosen where the program is lowered (cpu_decoding.on_cpu), so a decoding program lowered for a
GPU or TPU carries XLA ops in their place.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

import kernels
from kernels import cpu_decoding, decode_cache, dropout16, flat_matmul, mixed_matmul, output_layer
from model.cache import KVCache
from model.config import TransformerConfig, as_dtype


def rounded_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                        dtype):
  """Mixed precision as written: both operands rounded to `dtype`, products accumulated in float32."""
  del preferred_element_type
  return lax.dot_general(lhs.astype(dtype), rhs.astype(dtype), dimension_numbers, precision,
                         preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Ops:
  """The pieces the layers are built from.

  dot_general: for every matmul (None: lax.dot_general in the compute dtype). The CPU path sets
  kernels.flat_matmul's in float32 and kernels.mixed_matmul's for mixed precision.
  dropout: an nn.Dropout-style module class (rate; deterministic and rng at call time).
  fused_loss: whether train/ fuses the output layer with the loss (train/chunked_loss.py): every
  architecture with a decoder, on every path; the masked LM's head keeps full logits.
  matmul_dtype: cfg.compute.matmul_dtype resolved: the operand dtype where it differs from the compute dtype
  (mixed precision), else None.
  """
  matmul_dtype: Any
  dot_general: Callable | None
  dropout: type
  fused_loss: bool

  @property
  def float32_dot_general(self):
    """A dot_general whose result is float32 whatever the operands (the output layer's)."""
    if self.matmul_dtype is not None:   # both mixed-precision dot_generals return float32
      return self.dot_general
    return functools.partial(self.dot_general or lax.dot_general, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Decoding:
  """What incremental decoding runs on.

  cache: beam_slots -> the decoding cache (model.cache.KVCache's methods).
  decoding_weights / decoding_logits: the pre-softmax weights as decoding reads them (computed once per
  set of parameters from the [vocab, d_model] table: Transformer.decoding_weights), and decoder outputs
  [n, d_model] x those -> float32 logits.
  layer_panels: None, or how a decoding step's other kernels are laid out once per set of parameters
  ([d_in, d_out] -> panels, model/dense.py): the C++ path in float32, like the output layer's weights.
  beam_extensions: how a beam search step picks its candidates (decode.beam_search.select_extensions'
  signature): None for the XLA ops, kernels/cpu_decoding.beam_extensions's custom call on the CPU path.
  """
  cache: Callable[[bool], Any]
  decoding_weights: Callable
  decoding_logits: Callable
  beam_extensions: Callable | None = None
  layer_panels: Callable | None = None


def _reference_logits(dot_general, y, table):
  return jnp.einsum("nd,vd->nv", y.astype(table.dtype), table, preferred_element_type=jnp.float32,
                    _dot_general=dot_general or lax.dot_general)


def _mixed(cfg: TransformerConfig):
  """(compute dtype, the matmul operand dtype where it is below the compute dtype, else None)."""
  dtype, matmul = as_dtype(cfg.compute.dtype), as_dtype(cfg.compute.matmul_dtype)
  return dtype, (matmul if matmul is not None and matmul != dtype else None)


def ops_for(cfg: TransformerConfig) -> Ops:
  """The reference or fast pieces for `cfg` (see the module docstring). Builds nothing."""
  dtype, mixed = _mixed(cfg)
  fused_loss = cfg.arch != "encoder_only"   # the same on every path
  if kernels.resolve(cfg.compute.kernels) == "cpu":
    return Ops(matmul_dtype=mixed, dot_general=mixed_matmul.dot_general_for(mixed) or flat_matmul.dot_general,
               dropout=dropout16.Dropout, fused_loss=fused_loss)
  dot_general = None if mixed is None else functools.partial(rounded_dot_general, dtype=mixed)
  return Ops(matmul_dtype=mixed, dot_general=dot_general, dropout=nn.Dropout, fused_loss=fused_loss)


def on_lowering_platform(fn: Callable, cfg: TransformerConfig, *args):
  """fn(cfg, *args), with cfg.compute.kernels="auto" resolved by the platform the program is lowered for: a
  program lowered for the CPU runs fn with kernels="cpu", one lowered for anything else with
  "reference". Both are traced; only the lowered platform's branch reaches the compiled program.
  args are passed through as arguments: a branch must close over no arrays (jax.export)."""
  if cfg.compute.kernels != "auto":
    return fn(cfg, *args)
  branch = lambda kernels: functools.partial(fn, cfg.with_compute(kernels=kernels))
  return lax.platform_dependent(*args, cpu=branch("cpu"), default=branch("reference"))


def decoding_for(cfg: TransformerConfig) -> Decoding:
  """What decoding `cfg` runs on (see the module docstring): with the CPU path in float32, this builds
  and registers kernels/cpu_decoding.py's C++ kernels the first time it is called in the process."""
  dtype, mixed = _mixed(cfg)
  shape = dict(num_layers=cfg.num_decoder_layers, num_heads=cfg.num_heads, d_k=cfg.head_dim_k,
               d_v=cfg.head_dim_v, dtype=dtype)
  # The family switches (decoder-only prefill, fewer key/value heads, positions inside attention) decode
  # with the plain cache: the CPU caches lay out num_heads heads and attend without a bias.
  plain_cache = lambda beam_slots: KVCache(**dict(shape, num_heads=cfg.kv_heads))
  dot_general = ops_for(cfg).dot_general
  if kernels.resolve(cfg.compute.kernels) != "cpu":
    return Decoding(cache=plain_cache, decoding_weights=lambda table: table,
                    decoding_logits=functools.partial(_reference_logits, dot_general))
  # The C++ attention (one custom call per attention) and panel products where they built; float32 only.
  ffi = mixed is None and dtype == jnp.float32 and cpu_decoding.available()

  def cache(beam_slots):
    if not cfg.is_paper_family:
      return plain_cache(beam_slots)
    kind = decode_cache.BeamSlotCache if beam_slots else decode_cache.HeadMajorCache
    return kind(**shape, matmul_dtype=mixed, ffi=ffi)
  beam_extensions = cpu_decoding.beam_extensions if cpu_decoding.available() else None
  if ffi:
    return Decoding(cache=cache, decoding_weights=output_layer.decoding_panels,
                    decoding_logits=functools.partial(output_layer.panel_logits, vocab=cfg.vocab_size),
                    beam_extensions=beam_extensions, layer_panels=output_layer.kernel_panels)
  weights = functools.partial(output_layer.decoding_kernel, dtype=mixed or dtype)
  return Decoding(cache=cache, decoding_weights=weights, decoding_logits=output_layer.logits,
                  beam_extensions=beam_extensions)
