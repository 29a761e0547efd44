"""Encoder and decoder layers: attention and FFN sub-layers wrapped in residual + LayerNorm.

Post-norm (the paper): x = LayerNorm(x + Dropout(Sublayer(x))).
Pre-norm (switch):     x = x + Dropout(Sublayer(LayerNorm(x))), with a final LayerNorm per stack.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax

from model.attention import MultiHeadAttention
from model.config import TransformerConfig, as_dtype
from model.ops import attention_impl, ops_for

_ACTIVATIONS = {"relu": nn.relu, "gelu": nn.gelu, "swish": nn.silu, "swiglu": nn.silu, "geglu": nn.gelu}


def dense(cfg: TransformerConfig, features: int, name: str, dot_general=None):
  """A dense layer [..., d_in] -> [..., features] with Glorot-uniform weights, in cfg's dtypes."""
  return nn.Dense(features, dtype=as_dtype(cfg.compute.dtype), param_dtype=as_dtype(cfg.param_dtype),
                  kernel_init=nn.initializers.xavier_uniform(), dot_general=dot_general, name=name)


class FeedForward(nn.Module):
  """max(0, x W1 + b1) W2 + b2 (the paper), or GELU ("gelu") or SiLU x * sigmoid(x) ("swish", Marian's) in
  place of max(0, .); the gated "swiglu" and "geglu" (Shazeer 2020): (act(x W1 + b1) * (x V + c)) W2 + b2."""
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x, deterministic=True):
    """x [b, len, d_model] -> [b, len, d_model]."""
    cfg, ops = self.cfg, ops_for(self.cfg)
    h = _ACTIVATIONS[cfg.activation](dense(cfg, cfg.d_ff, "wi", ops.dot_general)(x))   # [b, len, d_ff]
    if cfg.activation in ("swiglu", "geglu"):
      h = h * dense(cfg, cfg.d_ff, "wi_linear", ops.dot_general)(x)
    h = ops.dropout(cfg.relu_dropout_rate, name="Dropout_0")(h, deterministic=deterministic)
    return dense(cfg, cfg.d_model, "wo", ops.dot_general)(h)                          # [b, len, d_model]


def _attention(cfg: TransformerConfig, cross: bool = False):
  ops, (impl, fused) = ops_for(cfg), attention_impl(cfg)
  return MultiHeadAttention(num_heads=cfg.num_heads, d_k=cfg.head_dim_k, d_v=cfg.head_dim_v,
                            d_model=cfg.d_model, use_bias=cfg.attention_bias,
                            dropout_rate=cfg.attention_dropout_rate, dtype=as_dtype(cfg.compute.dtype),
                            param_dtype=as_dtype(cfg.param_dtype), dot_general=ops.dot_general,
                            dropout_cls=ops.dropout, num_kv_heads=cfg.kv_heads,
                            rope=cfg.positions == "rope" and not cross, impl=impl, fused=fused,
                            cfg=cfg)


def layer_norm(cfg: TransformerConfig):
  """The norm cfg.norm names: LayerNorm (the paper) or RMSNorm (a scale, no centring, no bias)."""
  norm = nn.RMSNorm if cfg.norm == "rmsnorm" else nn.LayerNorm
  return norm(epsilon=cfg.layer_norm_epsilon, dtype=as_dtype(cfg.compute.dtype),
              param_dtype=as_dtype(cfg.param_dtype))


class Residual(nn.Module):
  """Applies one sub-layer with dropout, the residual connection and the norm in the chosen order."""
  cfg: TransformerConfig

  def setup(self):
    self.norm = layer_norm(self.cfg)
    self.dropout = ops_for(self.cfg).dropout(self.cfg.dropout_rate)

  def __call__(self, x, sublayer, deterministic=True):
    if self.cfg.pre_norm:
      return x + self.dropout(sublayer(self.norm(x)), deterministic=deterministic)
    return self.norm(x + self.dropout(sublayer(x), deterministic=deterministic))


class EncoderLayer(nn.Module):
  cfg: TransformerConfig

  def setup(self):
    self.self_attention = _attention(self.cfg)
    self.ffn = FeedForward(self.cfg)
    self.residual_attention = Residual(self.cfg)
    self.residual_ffn = Residual(self.cfg)

  def __call__(self, x, mask, deterministic=True, positions=None, bias=None):
    """x [b, src_len, d_model]; mask bool [b, 1, src_len, src_len]; positions int [b, src_len] and
    bias float [b, h, src_len, src_len] for the position switches (model/positions.py)."""
    x = self.residual_attention(
        x, lambda y: self.self_attention(y, y, mask, deterministic, positions, bias), deterministic)
    return self.residual_ffn(x, lambda y: self.ffn(y, deterministic), deterministic)


@dataclasses.dataclass(frozen=True)
class Step:
  """What every decoder layer of one decoding step reads besides its input and its own cache."""
  index: jax.Array                    # int32 [], the position being decoded (all rows in lockstep)
  kv: Any                             # the decoding cache object (model/cache.py's KVCache methods)
  context: Any                        # kv.start_step's, for kv.attend_self
  positions: jax.Array                # int32 [n, 1], each row's position (rope)
  self_mask: jax.Array                # bool [n, 1, 1, L]: the cache entries each row sees (attention.visible)
  cross_mask: jax.Array | None = None   # bool [b, 1, 1, src_len]; None without cross-attention
  bias: jax.Array | None = None       # float32 [n, h, 1, L] over the cache's positions (alibi, relative)


class DecoderLayer(nn.Module):
  """Masked self-attention, encoder-decoder attention (none with arch="decoder_only"), FFN: over a whole
  target (`__call__`), or one token per row (`step`) with a key/value cache and the cross-attention's
  keys and values computed once (`Decoder.cross_kv`)."""
  cfg: TransformerConfig

  def setup(self):
    self.has_cross = self.cfg.arch != "decoder_only"
    self.self_attention = _attention(self.cfg)
    if self.has_cross:
      self.cross_attention = _attention(self.cfg, cross=True)
      self.residual_cross = Residual(self.cfg)
    self.ffn = FeedForward(self.cfg)
    self.residual_self = Residual(self.cfg)
    self.residual_ffn = Residual(self.cfg)

  def __call__(self, x, enc_out, self_mask, cross_mask, deterministic=True, positions=None, bias=None):
    """x [b, tgt_len, d_model]; enc_out [b, src_len, d_model] (None without cross-attention); masks
    bool [b, 1, q, k]; positions int [b, tgt_len] and self-attention bias [b, h, tgt_len, tgt_len]."""
    x = self.residual_self(
        x, lambda y: self.self_attention(y, y, self_mask, deterministic, positions, bias), deterministic)
    if self.has_cross:
      x = self.residual_cross(
          x, lambda y: self.cross_attention(y, enc_out, cross_mask, deterministic), deterministic)
    return self.residual_ffn(x, lambda y: self.ffn(y, deterministic), deterministic)

  def prefill(self, x, layer_cache, mask, positions, bias):
    """The teacher-forced pass over a prompt x [n, P, d_model] (decoder-only, plain cache) that also
    writes its keys and values at positions 0..P-1 of layer_cache. Returns (y, new layer cache)."""
    new = {}

    def self_attend(y):
      k, v = self.self_attention.project_kv(y, positions)               # [n, P, g, d]
      q = self.self_attention.project_q(y, positions)
      write = lambda cache, part: jax.lax.dynamic_update_slice_in_dim(cache, part.astype(cache.dtype),
                                                                      0, axis=1)
      new["k"], new["v"] = write(layer_cache["k"], k), write(layer_cache["v"], v)
      return self.self_attention.out(self.self_attention.heads(q, k, v, mask, bias=bias))

    x = self.residual_self(x, self_attend)
    return self.residual_ffn(x, self.ffn), new

  def step(self, x, layer_cache, cross, step: Step):
    """One decoding step for n = b * k rows (k hypotheses per source sentence, adjacent rows): the
    embedded tokens x [n, 1, d_model], this layer's cache, its cross-attention keys and values from
    `step.kv.prepare_cross` (None without cross-attention). Returns (y [n, 1, d_model], new layer cache)."""
    new_cache, kv = {}, step.kv
    attend = self.self_attention.heads
    if step.bias is not None:
      attend = lambda q, k, v, mask: self.self_attention.heads(q, k, v, mask, bias=step.bias)

    def self_attend(y):
      k_new, v_new = self.self_attention.project_kv(y, step.positions)      # [n, 1, g, d]
      q = self.self_attention.project_q(y, step.positions)                  # [n, 1, h, d_k]
      heads, new_cache["layer"] = kv.attend_self(attend, q, k_new, v_new, layer_cache, step.index,
                                                 step.context, step.self_mask)
      return self.self_attention.out(heads).reshape(y.shape)

    def cross_attend(y):
      keys, values = cross
      b, n = step.cross_mask.shape[0], y.shape[0]
      q = self.cross_attention.project_q(y).reshape(
          b, n // b, self.cfg.num_heads, self.cfg.head_dim_k)           # [b, k, h, d_k]
      heads = kv.attend_cross(self.cross_attention.heads, q, keys, values, step.cross_mask)   # [b, k, h, d_v]
      return self.cross_attention.out(heads).reshape(n, 1, -1)

    x = self.residual_self(x, self_attend)
    if self.has_cross:
      x = self.residual_cross(x, cross_attend)
    return self.residual_ffn(x, self.ffn), new_cache["layer"]
