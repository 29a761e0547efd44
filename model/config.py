"""The Transformer's hyperparameters: what the model is (`TransformerConfig`, the architecture) and how
it is computed (`Compute`, which it carries as `cfg.compute`).

Layers take what they need from them as constructor arguments; nothing reads a global config. A run may
resume with other compute settings (run/config.py), never with another architecture.
"""
from __future__ import annotations

import dataclasses
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
  # Which kernel computes the teacher-forced attention (docs/accelerators.md): "xla" (model/attention.py
  # as written), "cudnn" (jax.nn.dot_product_attention's cuDNN flash attention), "splash" (Pallas TPU
  # splash attention), or "auto": cudnn on a GPU, splash on a TPU, xla on a CPU, chosen by the platform
  # the program is lowered for. A setting a kernel cannot take falls back.
  attention_impl: str = "auto"
  # Memory and compile time (docs/accelerators.md).
  remat: str = "none"                  # | "minimal" (keep the layers' matmul outputs) | "full" (keep inputs)
  scan_layers: bool = False            # one nn.scan per stack: parameters stacked [layers, ...]

  def __post_init__(self):
    def fail(msg):
      raise ValueError(f"Compute: {msg}")

    for name, allowed in dict(kernels=KERNELS, attention_impl=ATTENTION_IMPLS, remat=REMATS).items():
      if getattr(self, name) not in allowed:
        fail(f"{name}={getattr(self, name)!r} is not one of {list(allowed)}")
    as_dtype(self.dtype)
    if self.matmul_dtype is not None:
      matmul = as_dtype(self.matmul_dtype)
      if matmul != as_dtype(self.dtype) and as_dtype(self.dtype) != jnp.float32:
        fail(f"matmul_dtype={self.matmul_dtype!r} with dtype={self.dtype!r}: mixed precision rounds the "
             f"operands of float32 activations; with dtype={self.dtype!r} they are {self.dtype} already. "
             f"Leave matmul_dtype unset, or use dtype='float32'")

  def replace(self, **changes) -> "Compute":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """The paper's encoder-decoder (defaults: the base model of Table 3, Vaswani et al. 2017).

  d_k and d_v default to d_model // num_heads; Table 3 row B sets d_k alone.
  """
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
    def fail(msg):
      raise ValueError(f"TransformerConfig: {msg}")

    for name in ("vocab_size", "d_model", "d_ff", "num_heads", "max_len"):
      if int(getattr(self, name)) <= 0:
        fail(f"{name} must be positive, got {getattr(self, name)}")
    for name in ("num_encoder_layers", "num_decoder_layers"):
      if int(getattr(self, name)) < 0:
        fail(f"{name} must be >= 0, got {getattr(self, name)}")
    if self.num_decoder_layers == 0 and self.arch != "encoder_only":
      fail("num_decoder_layers must be >= 1")
    for name in ("d_k", "d_v"):
      value = getattr(self, name)
      if value is None:
        if self.d_model % self.num_heads:
          fail(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
               f"set {name} explicitly or change num_heads")
      elif value <= 0:
        fail(f"{name} must be positive, got {value}")
    for name in ("dropout_rate", "attention_dropout_rate", "relu_dropout_rate"):
      rate = getattr(self, name)
      if not 0.0 <= rate < 1.0:
        fail(f"{name} must be in [0, 1), got {rate}")
    choices = dict(arch=ARCHS, positions=POSITIONS, activation=ACTIVATIONS, norm=NORMS)
    for name, allowed in choices.items():
      if getattr(self, name) not in allowed:
        fail(f"{name}={getattr(self, name)!r} is not one of {list(allowed)}")
    if self.num_kv_heads is not None and (self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads):
      fail(f"num_kv_heads={self.num_kv_heads} must be positive and divide num_heads={self.num_heads}")
    if self.positions == "rope" and self.head_dim_k % 2:
      fail(f"positions='rope' rotates pairs of dimensions: d_k={self.head_dim_k} must be even")
    if self.arch == "encoder_only" and self.num_encoder_layers == 0:
      fail("arch='encoder_only' needs num_encoder_layers >= 1")
    if self.num_classes < 0 or (self.num_classes and self.arch != "encoder_only"):
      fail(f"num_classes={self.num_classes}: a classification head is for arch='encoder_only' only")
    as_dtype(self.param_dtype)
    if not isinstance(self.compute, Compute):
      fail(f"compute must be a Compute, got {type(self.compute).__name__}")

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

  @property
  def is_paper_family(self) -> bool:
    """True when no family switch is set beyond what the paper's model (and kernels/) handle."""
    return (self.arch == "encoder_decoder" and self.positions in ("sinusoidal", "learned")
            and self.kv_heads == self.num_heads)

  @property
  def num_encoder_stack_layers(self) -> int:
    return 0 if self.arch == "decoder_only" else self.num_encoder_layers

  @property
  def num_decoder_stack_layers(self) -> int:
    return 0 if self.arch == "encoder_only" else self.num_decoder_layers

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


def base(**overrides) -> TransformerConfig:
  """The paper's base model (Table 3, first row): 6+6 layers, d_model 512, 8 heads."""
  return TransformerConfig(**overrides)


def big(**overrides) -> TransformerConfig:
  """The paper's big model: d_model 1024, d_ff 4096, 16 heads, dropout 0.3 (EN-DE)."""
  settings = dict(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
  settings.update(overrides)
  return TransformerConfig(**settings)


PRESETS = {"base": base, "big": big}

