"""What the layers compute with: the plain reference operations, or the kernels/ fast paths.

TransformerConfig.kernels chooses, once, here: "reference" uses the plain pieces below and model/cache.py;
"cpu" plugs in the XLA:CPU fast paths of kernels/ (same results, see tests/test_kernels.py); "auto" picks
"cpu" on the CPU backend only. The layers receive the chosen pieces as arguments (a `dot_general` for
their matmuls, a dropout module class, a decoding cache), so they read the same either way.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

import kernels
from kernels import cpu_attention, decode_cache, dropout16, flat_matmul, mixed_matmul, output_layer
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
  cache: beam_slots -> the decoding cache (model.cache.KVCache's methods).
  decoding_weights / decoding_logits: the pre-softmax weights as decoding reads them (computed once per
  set of parameters from the [vocab, d_model] table: Transformer.decoding_weights), and decoder outputs
  [n, d_model] x those -> float32 logits.
  layer_panels: None, or how a decoding step's other kernels are laid out once per set of parameters
  ([d_in, d_out] -> panels, model/dense.py): the C++ path in float32, like the output layer's
  decoding_weights.
  fused_loss: train/ may fuse the output layer with the loss (kernels/fused_loss.py).
  beam_extensions: how a beam search step picks its candidates (decode.beam_search.select_extensions'
  signature): None for the XLA ops, kernels/cpu_attention.beam_extensions's custom call on the CPU path.
  matmul_dtype: cfg.matmul_dtype resolved: the operand dtype where it differs from the compute dtype
  (mixed precision), else None.
  """
  matmul_dtype: Any
  dot_general: Callable | None
  dropout: type
  cache: Callable[[bool], Any]
  decoding_weights: Callable
  decoding_logits: Callable
  fused_loss: bool
  beam_extensions: Callable | None = None
  layer_panels: Callable | None = None

  @property
  def float32_dot_general(self):
    """A dot_general whose result is float32 whatever the operands (the output layer's)."""
    if self.matmul_dtype is not None:   # both mixed-precision dot_generals return float32
      return self.dot_general
    return functools.partial(self.dot_general or lax.dot_general, preferred_element_type=jnp.float32)


def _reference_logits(dot_general, y, table):
  return jnp.einsum("nd,vd->nv", y.astype(table.dtype), table, preferred_element_type=jnp.float32,
                    _dot_general=dot_general or lax.dot_general)


def ops_for(cfg: TransformerConfig) -> Ops:
  """The reference or fast pieces for `cfg` (see the module docstring)."""
  dtype = as_dtype(cfg.dtype)
  matmul = as_dtype(cfg.matmul_dtype)
  mixed = matmul if matmul is not None and matmul != dtype else None   # operands rounded below dtype
  shape = dict(num_layers=cfg.num_decoder_layers, num_heads=cfg.num_heads, d_k=cfg.head_dim_k,
               d_v=cfg.head_dim_v, dtype=dtype)
  # The family switches (decoder-only prefill, fewer key/value heads, positions inside attention) decode
  # with the plain cache: the CPU caches lay out num_heads heads and attend without a bias.
  plain_cache = lambda beam_slots: KVCache(**dict(shape, num_heads=cfg.kv_heads))
  if kernels.resolve(cfg.kernels) == "cpu":
    # The C++ attention (one custom call per attention) and output layer where they built; float32 only.
    ffi = mixed is None and dtype == jnp.float32 and cpu_attention.available()

    def cache(beam_slots):
      if not cfg.is_paper_family:
        return plain_cache(beam_slots)
      kind = decode_cache.BeamSlotCache if beam_slots else decode_cache.HeadMajorCache
      return kind(**shape, matmul_dtype=mixed, ffi=ffi)
    if ffi:
      weights = output_layer.decoding_panels
      logits = functools.partial(output_layer.panel_logits, vocab=cfg.vocab_size)
      layer_panels = output_layer.kernel_panels
    else:
      weights = functools.partial(output_layer.decoding_kernel, dtype=mixed or dtype)
      logits, layer_panels = output_layer.logits, None
    return Ops(matmul_dtype=mixed, dot_general=mixed_matmul.dot_general_for(mixed) or flat_matmul.dot_general,
               dropout=dropout16.Dropout, cache=cache, decoding_weights=weights, decoding_logits=logits,
               fused_loss=cfg.arch != "encoder_only",
               beam_extensions=cpu_attention.beam_extensions if cpu_attention.available() else None,
               layer_panels=layer_panels)
  dot_general = None if mixed is None else functools.partial(rounded_dot_general, dtype=mixed)
  return Ops(matmul_dtype=mixed, dot_general=dot_general, dropout=nn.Dropout, cache=plain_cache,
             decoding_weights=lambda table: table,
             decoding_logits=functools.partial(_reference_logits, dot_general), fused_loss=False)
