"""The Transformer's hyperparameters: what the model is (`TransformerConfig`, the architecture) and how
it is computed (`Compute`, which it carries as `cfg.compute`).

Layers take what they need from them as constructor arguments; nothing reads a global config. A run may
resume with other compute settings (run/config.py), never with another architecture.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax.numpy as jnp

from kernels import CHOICES as KERNELS

ARCHS = ("encoder_decoder", "decoder_only", "encoder_only")
POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "relative")
ACTIVATIONS = ("relu", "gelu", "swish", "swiglu", "geglu")
NORMS = ("layernorm", "rmsnorm")
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")   # kernels/fused_attention.py
REMATS = ("none", "minimal", "full")   # model/stack.py: what the backward pass recomputes per layer
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _refuse(owner: str, checks) -> None:
  """Raises ValueError("owner: message") for the first (wrong, message) in checks that is wrong."""
  for wrong, message in checks:
    if wrong:
      raise ValueError(f"{owner}: {message}")


def _choices(config, **allowed):
  """(wrong, message) for each field of config that must be one of allowed[field]."""
  return [(getattr(config, name) not in choices, f"{name}={getattr(config, name)!r} is not one of {list(choices)}")
          for name, choices in allowed.items()]


def as_dtype(dtype: Any):
  """Accepts a dtype or its name ('float32', 'bfloat16') and returns the jnp dtype; None stays None."""
  if dtype is None:
    return None
  if isinstance(dtype, str):
    if dtype not in _DTYPES:
      raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]
  return jnp.dtype(dtype).type


@dataclasses.dataclass(frozen=True)
class Compute:
  """How a model is computed. None of these changes the parameters it has or the function it computes
  (beyond rounding), so a run may resume with other values; scan_layers changes only their layout."""
  dtype: Any = "float32"               # activations; logits, softmax, norms and the loss stay float32
  # Operands of every matmul (None: dtype). "bfloat16" with dtype "float32" is mixed precision:
  # bfloat16 operands, float32 accumulation and activations, also in the backward pass.
  matmul_dtype: Any = None
  # Which implementation computes the model: "reference" (model/ as written), "cpu" (the XLA:CPU fast
  # paths of kernels/, same results) or "auto" (cpu on the CPU backend, reference elsewhere).
  kernels: str = "auto"
  # The teacher-forced attention's kernel (kernels/fused_attention.py): "xla" (model/attention.py as
  # written), "cudnn", "splash", or "auto": by the platform lowered for. Where a kernel cannot, xla.
  attention_impl: str = "auto"
  # Memory and compile time (docs/accelerators.md).
  remat: str = "none"                  # | "minimal" (keep the layers' matmul outputs) | "full" (keep inputs)
  scan_layers: bool = False            # one nn.scan per stack: parameters stacked [layers, ...]

  def __post_init__(self):
    _refuse("Compute", _choices(self, kernels=KERNELS, attention_impl=ATTENTION_IMPLS, remat=REMATS))
    dtype, matmul = as_dtype(self.dtype), as_dtype(self.matmul_dtype)
    if matmul not in (None, dtype) and dtype != jnp.float32:
      raise ValueError(f"Compute: matmul_dtype={self.matmul_dtype!r} with dtype={self.dtype!r}: mixed precision "
                       f"rounds the operands of float32 activations; with dtype={self.dtype!r} they are "
                       f"{self.dtype} already. Leave matmul_dtype unset, or use dtype='float32'")

  def replace(self, **changes) -> "Compute":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """The paper's encoder-decoder (defaults: the base model of Table 3, Vaswani et al. 2017). d_k and d_v
  default to d_model // num_heads; Table 3 row B sets d_k alone."""
  vocab_size: int = 37000
  d_model: int = 512
  d_ff: int = 2048
  num_heads: int = 8
  d_k: int | None = None
  d_v: int | None = None
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout_rate: float = 0.1            # P_drop: sub-layer outputs and embeddings + positions
  attention_dropout_rate: float = 0.0  # on attention weights (not in the paper)
  relu_dropout_rate: float = 0.0       # inside the FFN (not in the paper)
  max_len: int = 256                   # longest sequence positions are defined for
  param_dtype: Any = "float32"         # what init creates and checkpoints store
  # Switches. Defaults are the paper's choices.
  pre_norm: bool = False               # LayerNorm before each sub-layer, plus final norms
  share_embeddings: bool = True        # one matrix: encoder input, decoder input, pre-softmax
  attention_bias: bool = True          # biases on the Q, K, V and output projections
  layer_norm_epsilon: float = 1e-6
  # The family (docs/family.md). Defaults are the paper's; every other choice runs on model/'s
  # reference pieces where kernels/ has no fast path for it (model/ops.py).
  arch: str = "encoder_decoder"        # | "decoder_only" (causal LM, no cross-attention) | "encoder_only"
  positions: str = "sinusoidal"        # | "learned" (Table 3 row E) | "rope" | "alibi" | "relative" (T5's)
  num_kv_heads: int | None = None      # key/value heads: None = num_heads (MHA), 1 = MQA, between = GQA
  activation: str = "relu"             # FFN: | "gelu" | "swish" (SiLU, Marian's) | "swiglu" | "geglu" (gated)
  logits_bias: bool = False            # a learned bias [vocab] added to the logits (Marian's final_logits_bias)
  norm: str = "layernorm"              # | "rmsnorm"
  relative_buckets: int = 32           # positions="relative": buckets per stack (T5)
  relative_max_distance: int = 128     # positions="relative": distances beyond share the last bucket
  num_classes: int = 0                 # encoder_only: > 0 adds the pooled-output classification head
  compute: Compute = Compute()         # how it is computed: dtypes, kernels, remat, scan

  def __post_init__(self):
    value = lambda name: getattr(self, name)
    positive = ("vocab_size", "d_model", "d_ff", "num_heads", "max_len", "d_k", "d_v", "num_kv_heads")
    counts = ("num_encoder_layers", "num_decoder_layers", "num_classes")
    rates = ("dropout_rate", "attention_dropout_rate", "relu_dropout_rate")
    _refuse("TransformerConfig", [(value(n) is not None and not isinstance(value(n), numbers.Integral),
                                   f"{n} must be a whole number, got {value(n)!r}") for n in positive + counts])
    _refuse("TransformerConfig", (   # d_k, d_v, num_kv_heads None: derived (the properties below)
        [(value(n) is not None and value(n) <= 0, f"{n} must be positive, got {value(n)}") for n in positive]
        + [(value(n) < 0, f"{n} must be >= 0, got {value(n)}") for n in counts]
        + [(not 0.0 <= value(n) < 1.0, f"{n} must be in [0, 1), got {value(n)}") for n in rates]))
    _refuse("TransformerConfig", _choices(self, arch=ARCHS, positions=POSITIONS, activation=ACTIVATIONS, norm=NORMS) + [
        (self.num_decoder_layers == 0 and self.arch != "encoder_only", "num_decoder_layers must be >= 1"),
        ((self.d_k is None or self.d_v is None) and self.d_model % self.num_heads,
         f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; set d_k and d_v explicitly "
         f"or change num_heads"),
        (self.num_heads % self.kv_heads, f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"),
        (self.positions == "rope" and self.head_dim_k % 2,
         f"positions='rope' rotates pairs of dimensions: d_k={self.head_dim_k} must be even"),
        (self.arch == "encoder_only" and self.num_encoder_layers == 0,
         "arch='encoder_only' needs num_encoder_layers >= 1"),
        (self.num_classes and self.arch != "encoder_only",
         f"num_classes={self.num_classes}: a classification head is for arch='encoder_only' only"),
        (not isinstance(self.compute, Compute), f"compute must be a Compute, got {type(self.compute).__name__}")])
    as_dtype(self.param_dtype)

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

  @property
  def head_dim_k(self) -> int:
    return self.d_k if self.d_k is not None else self.d_model // self.num_heads

  @property
  def head_dim_v(self) -> int:
    return self.d_v if self.d_v is not None else self.d_model // self.num_heads

  def replace(self, **changes) -> "TransformerConfig":
    return dataclasses.replace(self, **changes)

  def with_compute(self, **changes) -> "TransformerConfig":
    """The same model computed otherwise: cfg.with_compute(kernels="reference")."""
    return self.replace(compute=self.compute.replace(**changes))


ANY = None   # in an `implements` declaration: every value of the field


def unimplemented(cfg, implements: dict) -> list[str]:
  """What a fast path or an exporter cannot compute, from what it declares it implements: {field: ANY, a
  tuple of the values it takes, or a predicate of cfg}. Returns 'field=value' for every field of cfg (a
  TransformerConfig, or a subclass with more fields) that differs from its default and is not declared,
  or not with this value. A field added tomorrow is in no declaration, so it sends every fast path to the
  plain model and every exporter to a refusal until someone declares it there."""
  missing = []
  for field in dataclasses.fields(cfg):
    value, allowed = getattr(cfg, field.name), implements.get(field.name, ())
    default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
    if field.name in implements and allowed is ANY or value == default:
      continue
    if not (allowed(cfg) if callable(allowed) else value in allowed):
      missing.append(f"{field.name}={value!r}")
  return missing


def base(**overrides) -> TransformerConfig:
  """The paper's base model (Table 3, first row): 6+6 layers, d_model 512, 8 heads."""
  return TransformerConfig(**overrides)


def big(**overrides) -> TransformerConfig:
  """The paper's big model: d_model 1024, d_ff 4096, 16 heads, dropout 0.3 (EN-DE)."""
  settings = dict(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
  settings.update(overrides)
  return TransformerConfig(**settings)


PRESETS = {"base": base, "big": big}

