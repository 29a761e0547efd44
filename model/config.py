"""Architecture hyperparameters of the Transformer, as one frozen dataclass.

Layers take what they need from it as constructor arguments; nothing reads a global config.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from kernels import CHOICES as KERNELS

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
  dtype: Any = "float32"               # compute dtype; logits and softmax are always float32
  param_dtype: Any = "float32"
  # Operands of every matmul (None: the compute dtype). "bfloat16" with dtype "float32" is mixed
  # precision: bfloat16 operands, float32 accumulation and activations, also in the backward pass.
  matmul_dtype: Any = None
  # Which implementation computes the model: "reference" (model/ as written), "cpu" (the XLA:CPU fast
  # paths of kernels/, same results) or "auto" (cpu on the CPU backend, reference elsewhere).
  kernels: str = "auto"
  # Switches. Defaults are the paper's choices.
  pre_norm: bool = False               # LayerNorm before each sub-layer, plus final norms
  learned_positions: bool = False      # Table 3 row E
  share_embeddings: bool = True        # one matrix: encoder input, decoder input, pre-softmax
  attention_bias: bool = True          # biases on the Q, K, V and output projections
  layer_norm_epsilon: float = 1e-6

  def __post_init__(self):
    def fail(msg):
      raise ValueError(f"TransformerConfig: {msg}")

    for name in ("vocab_size", "d_model", "d_ff", "num_heads", "max_len"):
      if int(getattr(self, name)) <= 0:
        fail(f"{name} must be positive, got {getattr(self, name)}")
    for name in ("num_encoder_layers", "num_decoder_layers"):
      if int(getattr(self, name)) < 0:
        fail(f"{name} must be >= 0, got {getattr(self, name)}")
    if self.num_decoder_layers == 0:
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
    if self.kernels not in KERNELS:
      fail(f"kernels={self.kernels!r} is not one of {list(KERNELS)}")
    as_dtype(self.dtype)
    as_dtype(self.param_dtype)
    if self.matmul_dtype is not None:
      matmul = as_dtype(self.matmul_dtype)
      if matmul != as_dtype(self.dtype) and as_dtype(self.dtype) != jnp.float32:
        fail(f"matmul_dtype={self.matmul_dtype!r} with dtype={self.dtype!r}: mixed precision rounds the "
             f"operands of float32 activations; with dtype={self.dtype!r} they are {self.dtype} already. "
             f"Leave matmul_dtype unset, or use dtype='float32'")

  @property
  def head_dim_k(self) -> int:
    return self.d_k if self.d_k is not None else self.d_model // self.num_heads

  @property
  def head_dim_v(self) -> int:
    return self.d_v if self.d_v is not None else self.d_model // self.num_heads

  def replace(self, **changes) -> "TransformerConfig":
    return dataclasses.replace(self, **changes)


def base(**overrides) -> TransformerConfig:
  """The paper's base model (Table 3, first row): 6+6 layers, d_model 512, 8 heads."""
  return TransformerConfig(**overrides)


def big(**overrides) -> TransformerConfig:
  """The paper's big model: d_model 1024, d_ff 4096, 16 heads, dropout 0.3 (EN-DE)."""
  settings = dict(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
  settings.update(overrides)
  return TransformerConfig(**settings)


PRESETS = {"base": base, "big": big}


def num_params(cfg: TransformerConfig) -> int:
  """Exact parameter count of the model `cfg` describes (what `init` creates), in closed form."""
  d, f, h, dk, dv = cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.head_dim_k, cfg.head_dim_v
  bias = 1 if cfg.attention_bias else 0
  # Q and K: d -> h*dk; V: d -> h*dv; output: h*dv -> d.
  attention = 2 * (d * h * dk + bias * h * dk) + (d * h * dv + bias * h * dv) + (h * dv * d + bias * d)
  ffn = d * f + f + f * d + d
  norm = 2 * d
  encoder_layer = attention + ffn + 2 * norm
  decoder_layer = 2 * attention + ffn + 3 * norm
  total = cfg.num_encoder_layers * encoder_layer + cfg.num_decoder_layers * decoder_layer
  embeddings = cfg.vocab_size * d
  total += embeddings if cfg.share_embeddings else 3 * embeddings
  if cfg.learned_positions:
    total += 2 * cfg.max_len * d  # one table for the encoder, one for the decoder
  if cfg.pre_norm:
    total += (norm if cfg.num_encoder_layers else 0) + norm
  return total
