"""Encoder and decoder layers: attention and FFN sub-layers wrapped in residual + LayerNorm.

Post-norm (the paper): x = LayerNorm(x + Dropout(Sublayer(x))).
Pre-norm (switch):     x = x + Dropout(Sublayer(LayerNorm(x))), with a final LayerNorm per stack.
"""
from __future__ import annotations

import flax.linen as nn

from model.attention import MultiHeadAttention
from model.config import TransformerConfig, as_dtype
from model.ops import ops_for


class FeedForward(nn.Module):
  """max(0, x W1 + b1) W2 + b2."""
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x, deterministic=True):
    cfg, ops = self.cfg, ops_for(self.cfg)
    dense = lambda n, name: nn.Dense(n, dtype=as_dtype(cfg.dtype), param_dtype=as_dtype(cfg.param_dtype),
                                     kernel_init=nn.initializers.xavier_uniform(),
                                     dot_general=ops.dot_general, name=name)
    h = nn.relu(dense(cfg.d_ff, "wi")(x))                 # [b, len, d_ff]
    h = ops.dropout(cfg.relu_dropout_rate, name="Dropout_0")(h, deterministic=deterministic)
    return dense(cfg.d_model, "wo")(h)                    # [b, len, d_model]


def _attention(cfg: TransformerConfig):
  ops = ops_for(cfg)
  return MultiHeadAttention(num_heads=cfg.num_heads, d_k=cfg.head_dim_k, d_v=cfg.head_dim_v,
                            d_model=cfg.d_model, use_bias=cfg.attention_bias,
                            dropout_rate=cfg.attention_dropout_rate, dtype=as_dtype(cfg.dtype),
                            param_dtype=as_dtype(cfg.param_dtype), dot_general=ops.dot_general,
                            dropout_cls=ops.dropout)


def layer_norm(cfg: TransformerConfig, name=None):
  return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=as_dtype(cfg.dtype),
                      param_dtype=as_dtype(cfg.param_dtype), name=name)


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

  def __call__(self, x, mask, deterministic=True):
    """x [b, src_len, d_model]; mask bool [b, 1, src_len, src_len]."""
    x = self.residual_attention(
        x, lambda y: self.self_attention(y, y, mask, deterministic), deterministic)
    return self.residual_ffn(x, lambda y: self.ffn(y, deterministic), deterministic)


class DecoderLayer(nn.Module):
  """Masked self-attention, encoder-decoder attention, FFN.

  `__call__` is the teacher-forced pass over a whole target; `step` decodes one token per row using a
  key/value cache for self-attention and precomputed cross-attention keys/values (`Decoder.cross_kv`).
  """
  cfg: TransformerConfig

  def setup(self):
    self.self_attention = _attention(self.cfg)
    self.cross_attention = _attention(self.cfg)
    self.ffn = FeedForward(self.cfg)
    self.residual_self = Residual(self.cfg)
    self.residual_cross = Residual(self.cfg)
    self.residual_ffn = Residual(self.cfg)

  def __call__(self, x, enc_out, self_mask, cross_mask, deterministic=True):
    """x [b, tgt_len, d_model]; enc_out [b, src_len, d_model]; masks bool [b, 1, q, k]."""
    x = self.residual_self(
        x, lambda y: self.self_attention(y, y, self_mask, deterministic), deterministic)
    x = self.residual_cross(
        x, lambda y: self.cross_attention(y, enc_out, cross_mask, deterministic), deterministic)
    return self.residual_ffn(x, lambda y: self.ffn(y, deterministic), deterministic)

  def step(self, x, layer_cache, index, cross, src_mask, kv, context):
    """One decoding step for n = b * k rows (k hypotheses per source sentence, adjacent rows).

    x: [n, 1, d_model], the embedded current tokens; layer_cache: this layer's part of the decoding
    cache; index: int32 scalar, the position being decoded (all rows decode in lockstep);
    cross: this layer's cross-attention keys and values from `kv.prepare_cross`; src_mask: bool
    [b, src_len]; kv: the decoding cache object (model/cache.py); context: from its `start_step`.
    Returns (y [n, 1, d_model], new layer_cache).
    """
    new_cache = {}

    def self_attend(y):
      k_new, v_new = self.self_attention.project_kv(y)                 # [n, 1, h, d]
      q = self.self_attention.project_q(y)                             # [n, 1, h, d_k]
      heads, new_cache["layer"] = kv.attend_self(self.self_attention.heads, q, k_new, v_new,
                                                 layer_cache, index, context)
      return self.self_attention.out(heads).reshape(y.shape)

    def cross_attend(y):
      keys, values = cross
      b, n = src_mask.shape[0], y.shape[0]
      q = self.cross_attention.project_q(y).reshape(
          b, n // b, self.cfg.num_heads, self.cfg.head_dim_k)           # [b, k, h, d_k]
      mask = src_mask[:, None, None, :]                                 # [b, 1, 1, src_len]
      heads = kv.attend_cross(self.cross_attention.heads, q, keys, values, mask)   # [b, k, h, d_v]
      return self.cross_attention.out(heads).reshape(n, 1, -1)

    x = self.residual_self(x, self_attend)
    x = self.residual_cross(x, cross_attend)
    x = self.residual_ffn(x, self.ffn)
    return x, new_cache["layer"]
