"""Encoder and decoder layers: attention and FFN sub-layers wrapped in residual + LayerNorm.

Post-norm (the paper): x = LayerNorm(x + Dropout(Sublayer(x))).
Pre-norm (switch):     x = x + Dropout(Sublayer(LayerNorm(x))), with a final LayerNorm per stack.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.attention import MultiHeadAttention
from model.dropout import Dropout
from model.config import TransformerConfig
from model import precision


class FeedForward(nn.Module):
  """max(0, x W1 + b1) W2 + b2."""
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, x, deterministic=True):
    cfg = self.cfg
    dense = lambda n, name: nn.Dense(n, dtype=cfg.compute_dtype, param_dtype=cfg.weights_dtype,
                                     kernel_init=nn.initializers.xavier_uniform(),
                                     dot_general=precision.dot_general_for(cfg.mixed_dtype), name=name)
    h = nn.relu(dense(cfg.d_ff, "wi")(x))                 # [b, len, d_ff]
    h = Dropout(cfg.relu_dropout_rate)(h, deterministic=deterministic)
    return dense(cfg.d_model, "wo")(h)                    # [b, len, d_model]


def _attention(cfg: TransformerConfig):
  return MultiHeadAttention(num_heads=cfg.num_heads, d_k=cfg.head_dim_k, d_v=cfg.head_dim_v,
                            d_model=cfg.d_model, use_bias=cfg.attention_bias,
                            dropout_rate=cfg.attention_dropout_rate, dtype=cfg.compute_dtype,
                            param_dtype=cfg.weights_dtype, matmul_dtype=cfg.mixed_dtype)


def layer_norm(cfg: TransformerConfig, name=None):
  return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.compute_dtype,
                      param_dtype=cfg.weights_dtype, name=name)


class Residual(nn.Module):
  """Applies one sub-layer with dropout, the residual connection and the norm in the chosen order."""
  cfg: TransformerConfig

  def setup(self):
    self.norm = layer_norm(self.cfg)
    self.dropout = Dropout(self.cfg.dropout_rate)

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
  key/value cache for self-attention and precomputed cross-attention keys/values (`cross_kv`).
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

  def cross_kv(self, enc_out):
    """Cross-attention keys [b, h, src_len, d_k] and values [b, h, src_len, d_v] (head-major, the layout
    `cached_attention` reads without a transpose), once per source."""
    keys, values = self.cross_attention.project_kv(enc_out)             # [b, src_len, h, d]
    # With mixed precision the attention matmuls read them rounded: round them once, here.
    dtype = self.cfg.mixed_dtype or keys.dtype
    return jnp.swapaxes(keys, 1, 2).astype(dtype), jnp.swapaxes(values, 1, 2).astype(dtype)

  def step(self, x, layer_cache, index, cross, src_mask, history=None):
    """One decoding step for n = b * k rows (k hypotheses per source sentence, adjacent rows).

    x: [n, 1, d_model], the embedded current tokens; layer_cache: {'k': [n, h, L, d_k], 'v': [n, h, L, d_v]};
    index: int32 scalar, the position being decoded (all rows decode in lockstep);
    cross: (keys [b, h, src_len, d_k], values [b, h, src_len, d_v]); src_mask: bool [b, src_len].
    history: None (row r's cache holds row r's own history), or for beam-slot caches that beam search
    never reorders, bool [b, k, 1, k, L]: history[r, s, 0, j, t] says whether slot s's entry at position
    t belongs to hypothesis j of sentence r (see model.attention.beam_attention).
    Returns (y [n, 1, d_model], new layer_cache).
    """
    new_cache = {}

    def self_attend(y):
      k_new, v_new = self.self_attention.project_kv(y)                 # [n, 1, h, d]
      write = lambda cache, new: jax.lax.dynamic_update_slice_in_dim(
          cache, jnp.swapaxes(new, 1, 2).astype(cache.dtype), index, axis=2)
      k, v = write(layer_cache["k"], k_new), write(layer_cache["v"], v_new)   # [n, h, L, d]
      new_cache.update(k=k, v=v)
      q = self.self_attention.project_q(y)                             # [n, 1, h, d_k]
      if history is None:
        visible = (jnp.arange(k.shape[2]) <= index)[None, None, None, :]  # [1, 1, 1, L]
        return self.self_attention.attend_cached(q, k, v, visible)
      b, beams = history.shape[:2]
      slots = lambda c: c.reshape((b, beams) + c.shape[1:])              # [b, k, h, L, d] (no copy)
      out = self.self_attention.attend_beams(q.reshape(b, beams, *q.shape[2:]), slots(k), slots(v),
                                             history)                  # [b, k, d_model]
      return out.reshape(y.shape)

    def cross_attend(y):
      keys, values = cross
      b = keys.shape[0]
      n = y.shape[0]
      # The k hypotheses of one sentence become k queries against that sentence's keys: no copy of
      # the encoder memory per hypothesis.
      q = self.cross_attention.project_q(y).reshape(
          b, n // b, self.cfg.num_heads, self.cfg.head_dim_k)           # [b, k, h, d_k]
      mask = src_mask[:, None, None, :]                                 # [b, 1, 1, src_len]
      out = self.cross_attention.attend_cached(q, keys, values, mask)   # [b, k, d_model]
      return out.reshape(n, 1, -1)

    x = self.residual_self(x, self_attend)
    x = self.residual_cross(x, cross_attend)
    x = self.residual_ffn(x, self.ffn)
    return x, new_cache
