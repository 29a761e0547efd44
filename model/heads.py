"""Heads of the encoder-only model (BERT, Devlin et al. 2019): masked-LM and pooled classification."""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from model.config import TransformerConfig, as_dtype
from model.layers import dense, layer_norm


class MaskedLMHead(nn.Module):
  """Encoder outputs -> GELU(x W + b) -> norm, before the (tied) output matrix; `add_bias` adds the
  per-token output bias to the logits."""
  cfg: TransformerConfig

  def setup(self):
    self.transform = dense(self.cfg, self.cfg.d_model, "transform")
    self.norm = layer_norm(self.cfg)
    self.output_bias = self.param("output_bias", nn.initializers.zeros, (self.cfg.vocab_size,),
                                  as_dtype(self.cfg.param_dtype))

  def __call__(self, x):
    """x [b, len, d_model] -> [b, len, d_model]."""
    return self.norm(nn.gelu(self.transform(x)))

  def add_bias(self, logits):
    """logits float32 [..., vocab] -> logits + output bias."""
    return logits + self.output_bias.astype(jnp.float32)


class ClassificationHead(nn.Module):
  """BERT's pooler and classifier: tanh(x_0 W + b), dropout, then a linear layer to num_classes."""
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, enc_out, deterministic=True):
    """enc_out [b, len, d_model] -> float32 logits [b, num_classes]."""
    pooled = jnp.tanh(dense(self.cfg, self.cfg.d_model, "pooler")(enc_out[:, 0]))
    pooled = nn.Dropout(self.cfg.dropout_rate)(pooled, deterministic=deterministic)
    return dense(self.cfg, self.cfg.num_classes, "classifier")(pooled).astype(jnp.float32)
