"""What the layers compute with, and what decoding runs on: the plain operations, or a backend's.

model/'s one door to kernels/ (tests/test_imports.py holds it to that): the layers take their pieces from
`ops_for` and `attention`, decoding from `decoding_for`, none knowing which backend filled them in.
Compute.kernels chooses: "reference" is the plain pieces below and model/cache.py; "cpu" is
kernels/cpu_backend.py's XLA:CPU fast paths (same results: tests/test_kernels.py, test_cpu_decoding.py);
"auto" is "cpu" on the CPU: where the train and eval steps are lowered for it (kernels.on_lowering_platform),
and for decoding, whose cache layout is chosen before tracing, where JAX runs (kernels.resolve).

Each fast path holds its own declaration of the TransformerConfig fields it implements (CPU decoding:
cpu_backend.DECODING and CACHES; the fused attentions: fused_attention.CUDNN and SPLASH; the fused
output layer and loss: FUSED_LOSS below); declaring a field for one declares it for no other. A config
that sets a field a fast path does not declare runs on the plain pieces instead, which is said once, as
a warning naming the fast path and the field (model.config.unimplemented).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

import kernels
from kernels import cpu_backend, fused_attention
from model.cache import KVCache
from model.config import TransformerConfig, as_dtype, unimplemented

log = logging.getLogger(__name__)
_SAID: set = set()
# What the fused output layer and loss (train/chunked_loss.py) implement: they compute the logits of the
# decoder's outputs as Transformer.output_inputs gives them (the shared or separate table, the logits bias).
FUSED_LOSS = kernels.declare(
    "attention_dropout_rate", "relu_dropout_rate", "pre_norm", "share_embeddings", "attention_bias",
    "num_kv_heads", "logits_bias", "relative_buckets", "relative_max_distance", "num_classes",
    arch=("encoder_decoder", "decoder_only"), positions=("sinusoidal", "learned", "rope", "alibi", "relative"),
    activation=("relu", "gelu", "swish", "swiglu", "geglu"), norm=("layernorm", "rmsnorm"))

MASKED = kernels.MASKED   # the logit of a key a query may not see, in every XLA attention
# attention(impl, q, k, v, mask, bias, dropout, reference): the teacher-forced attention that
# Compute.attention_impl chooses (see attention_impl): cuDNN's or splash's fused kernel where it can take it.
attention = fused_attention.attention
PackedMask = fused_attention.PackedMask   # a teacher-forced mask with its segment ids (packed_mask)


def rounded_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                        dtype):
  """Mixed precision as written: both operands rounded to `dtype`, products accumulated in float32."""
  del preferred_element_type
  return lax.dot_general(lhs.astype(dtype), rhs.astype(dtype), dimension_numbers, precision,
                         preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Ops:
  """The pieces the layers are built from."""
  matmul_dtype: Any              # the matmul operand dtype where it differs from the compute dtype, else None
  dot_general: Callable | None   # for every matmul (None: lax.dot_general in the compute dtype)
  dropout: type                  # an nn.Dropout-style module class
  # Whether train/ fuses the output layer with the loss (train/chunked_loss.py): every architecture with
  # a decoder, on every path, for the fields FUSED_LOSS declares; the masked LM's head keeps full logits.
  fused_loss: bool

  @property
  def float32_dot_general(self):
    """A dot_general whose result is float32 whatever the operands (the output layer's)."""
    if self.matmul_dtype is not None:   # both mixed-precision dot_generals return float32
      return self.dot_general
    return functools.partial(self.dot_general or lax.dot_general, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class Decoding:
  """What incremental decoding runs on; a backend replaces the pieces it runs faster."""
  cache: Callable[[bool], Any]   # beam_slots -> the decoding cache object (model/cache.py's KVCache methods)
  decoding_weights: Callable     # the [vocab, d_model] output table -> the weights decoding_logits reads
  decoding_logits: Callable      # decoder outputs [n, d_model], those weights -> float32 logits [n, vocab]
  # None, or a backend's kernel with the signature of decode.beam_search.select_extensions.
  beam_extensions: Callable | None = None
  # select_extensions -> what a search picks a step's candidates with (None: select_extensions itself).
  extensions: Callable = lambda select_extensions: None
  # None, or the decoder's parameters -> a dict of what else a step reads (Transformer.decoding_weights).
  layer_weights: Callable | None = None
  # The decoding memory -> the context the decoder's step runs in (where a backend may intercept the
  # layers' calls, nn.intercept_methods).
  step_scope: Callable = lambda memory: contextlib.nullcontext()


def _reference_logits(dot_general, y, table):
  return jnp.einsum("nd,vd->nv", y.astype(table.dtype), table, preferred_element_type=jnp.float32,
                    _dot_general=dot_general or lax.dot_general)


def _mixed(cfg: TransformerConfig):
  """(compute dtype, the matmul operand dtype where it is below the compute dtype, else None)."""
  dtype, matmul = as_dtype(cfg.compute.dtype), as_dtype(cfg.compute.matmul_dtype)
  return dtype, (matmul if matmul is not None and matmul != dtype else None)


def _falls_back(cfg, implements: dict, what: str) -> bool:
  """Whether cfg sets a field that a fast path does not declare in `implements`; if so, says once, as a
  warning (the level the console shows), that `what` runs on the plain path, naming the fields."""
  missing = unimplemented(cfg, implements)
  if missing:
    message = f"{what} does not implement {', '.join(missing)}: the plain path (model/) runs instead"
    if message not in _SAID:
      _SAID.add(message)
      log.warning(message)
  return bool(missing)


def attention_impl(cfg: TransformerConfig) -> tuple[str, tuple[str, ...]]:
  """(Compute.attention_impl for the layers of cfg, the fused kernels that may compute them). A kernel
  whose own declaration (fused_attention.CUDNN, SPLASH) does not take cfg is left out, which is said
  once naming it and the field; the impl is "xla" where that leaves none that was asked for."""
  impl = cfg.compute.attention_impl
  asked = tuple(fused_attention.KERNELS) if impl == "auto" else () if impl == "xla" else (impl,)
  declared = tuple(name for name in asked if not _falls_back(
      cfg, fused_attention.KERNELS[name], f"attention_impl={impl!r}: {name} (kernels/fused_attention.py's "
      f"{name.upper()})"))
  return ("xla" if asked and not declared else impl), declared


def ops_for(cfg: TransformerConfig) -> Ops:
  """The reference or fast pieces for `cfg` (see the module docstring). Builds nothing."""
  _, mixed = _mixed(cfg)
  if kernels.resolve(cfg.compute.kernels) == "cpu":
    dot_general, dropout = cpu_backend.layer_ops(mixed)
  else:
    dot_general = None if mixed is None else functools.partial(rounded_dot_general, dtype=mixed)
    dropout = nn.Dropout
  fused_loss = cfg.arch != "encoder_only" and not _falls_back(
      cfg, FUSED_LOSS, "the fused output layer and loss (train/chunked_loss.py, model/ops.py's FUSED_LOSS)")
  return Ops(matmul_dtype=mixed, dot_general=dot_general, dropout=dropout, fused_loss=fused_loss)


def decoding_for(cfg: TransformerConfig) -> Decoding:
  """What decoding `cfg` runs on (see the module docstring). With the CPU backend in float32, this builds
  and registers its C++ kernels the first time it is called in the process."""
  dtype, mixed = _mixed(cfg)
  plain = Decoding(cache=lambda beam_slots: KVCache(cfg.num_decoder_layers, cfg.kv_heads, cfg.head_dim_k,
                                                    cfg.head_dim_v, dtype),
                   decoding_weights=lambda table: table,
                   decoding_logits=functools.partial(_reference_logits, ops_for(cfg).dot_general))
  if (kernels.resolve(cfg.compute.kernels) != "cpu"
      or _falls_back(cfg, cpu_backend.DECODING, "kernels='cpu' decoding (kernels/cpu_backend.py's DECODING)")):
    return plain
  # The family's switches beyond the paper's model decode with the CPU step's pieces and the plain cache.
  caches = not _falls_back(cfg, cpu_backend.CACHES, "the CPU decoding caches (kernels/cpu_backend.py's CACHES)")
  return cpu_backend.decoding(cfg, plain, dtype, mixed, caches)
