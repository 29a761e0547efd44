"""The encoder-decoder Transformer (Vaswani et al., 2017), as pure Linen modules.

    model = Transformer(cfg)
    params = model.init({'params': key}, src, tgt_in)['params']
    logits = model.apply({'params': params}, src, tgt_in)                    # [b, tgt_len, vocab] f32

Incremental decoding (what decode/ uses):
    enc_out = model.apply({'params': params}, src, method='encode')          # [b, src_len, d_model]
    cross = model.apply({'params': params}, enc_out, method='cross_kv')      # per layer (k, v), [b, ...]
    cache = init_cache(cfg, batch_size=n, max_len=L)
    logits, cache = model.apply({'params': params}, ids, cache, cross, src != 0, method='decode_step')
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import precision
from model.attention import causal_mask, segment_mask
from model.config import TransformerConfig
from model.embedding import Embedder
from model.layers import DecoderLayer, EncoderLayer, layer_norm


def _segments_and_positions(ids, segments, positions):
  """Unpacked inputs: segment 1 on tokens, 0 on padding; positions 0, 1, 2, ... per row."""
  if segments is None:
    segments = (ids != 0).astype(jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
  return segments, positions


class Encoder(nn.Module):
  cfg: TransformerConfig
  shared_embedding: nn.Module | None = None

  def setup(self):
    cfg = self.cfg
    self.embed = Embedder(cfg.d_model, cfg.max_len, cfg.dropout_rate, cfg.learned_positions,
                          self.shared_embedding, cfg.vocab_size, cfg.compute_dtype, cfg.weights_dtype)
    self.layers = [EncoderLayer(cfg) for _ in range(cfg.num_encoder_layers)]
    if cfg.pre_norm:
      self.final_norm = layer_norm(cfg)

  def __call__(self, src, src_segments, src_positions, deterministic=True):
    """src, src_segments, src_positions: int [b, src_len]. Returns enc_out [b, src_len, d_model]."""
    x = self.embed(src, src_positions, deterministic)
    mask = segment_mask(src_segments, src_segments)            # [b, 1, src_len, src_len]
    for layer in self.layers:
      x = layer(x, mask, deterministic)
    return self.final_norm(x) if self.cfg.pre_norm else x


class Decoder(nn.Module):
  cfg: TransformerConfig
  shared_embedding: nn.Module | None = None

  def setup(self):
    cfg = self.cfg
    self.embed = Embedder(cfg.d_model, cfg.max_len, cfg.dropout_rate, cfg.learned_positions,
                          self.shared_embedding, cfg.vocab_size, cfg.compute_dtype, cfg.weights_dtype)
    self.layers = [DecoderLayer(cfg) for _ in range(cfg.num_decoder_layers)]
    if cfg.pre_norm:
      self.final_norm = layer_norm(cfg)

  def _finish(self, x):
    return self.final_norm(x) if self.cfg.pre_norm else x

  def __call__(self, tgt_in, tgt_segments, tgt_positions, enc_out, src_segments, deterministic=True):
    """Teacher-forced pass. Returns decoder outputs [b, tgt_len, d_model] (before the softmax layer)."""
    x = self.embed(tgt_in, tgt_positions, deterministic)
    self_mask = segment_mask(tgt_segments, tgt_segments) & causal_mask(tgt_in.shape[1])
    cross_mask = segment_mask(tgt_segments, src_segments)      # [b, 1, tgt_len, src_len]
    for layer in self.layers:
      x = layer(x, enc_out, self_mask, cross_mask, deterministic)
    return self._finish(x)

  def cross_kv(self, enc_out):
    return [layer.cross_kv(enc_out) for layer in self.layers]

  def step(self, ids, cache, cross, src_mask):
    """ids int32 [n] at position cache['index']; returns (outputs [n, d_model], new cache)."""
    index = cache["index"][0]
    positions = jnp.broadcast_to(index, ids.shape)[:, None]   # [n, 1]
    x = self.embed(ids[:, None], positions)                    # [n, 1, d_model]
    new_cache = {"index": cache["index"] + 1}
    history = None
    if "slot_history" in cache:
      # Beam-slot caches: row r writes its entry at `index` into its own slot, and reads its earlier
      # entries from the slots that wrote them (slot_history[r, t]).
      n, b = ids.shape[0], src_mask.shape[0]
      beams = n // b
      slot_history = jax.lax.dynamic_update_slice_in_dim(
          cache["slot_history"], (jnp.arange(n, dtype=jnp.int32) % beams)[:, None], index, axis=1)
      new_cache["slot_history"] = slot_history
      length = slot_history.shape[1]
      wrote = slot_history.reshape(b, 1, 1, beams, length) == jnp.arange(beams)[None, :, None, None, None]
      history = wrote & (jnp.arange(length) <= index)          # [b, k(slot), 1, k(hyp), L]
    new_layers = []
    for layer, layer_cache, layer_cross in zip(self.layers, cache["layers"], cross):
      x, new_layer_cache = layer.step(x, layer_cache, index, layer_cross, src_mask, history)
      new_layers.append(new_layer_cache)
    new_cache["layers"] = new_layers
    return self._finish(x)[:, 0], new_cache


class Transformer(nn.Module):
  """Encoder-decoder with (by default) one embedding matrix shared by both inputs and the output."""
  cfg: TransformerConfig

  def setup(self):
    cfg = self.cfg
    if cfg.share_embeddings:
      shared = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.compute_dtype,
                        param_dtype=cfg.weights_dtype,
                        embedding_init=nn.initializers.normal(stddev=cfg.d_model ** -0.5),
                        name="shared_embedding")
      self.shared_embedding = shared
      self.encoder = Encoder(cfg, shared)
      self.decoder = Decoder(cfg, shared)
    else:
      self.encoder = Encoder(cfg)
      self.decoder = Decoder(cfg)
      self.output_projection = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.compute_dtype,
                                        param_dtype=cfg.weights_dtype,
                                        dot_general=precision.dot_general_for(cfg.mixed_dtype),
                                        name="output_projection")

  def logits(self, y):
    """Decoder outputs [..., d_model] -> float32 logits [..., vocab], whatever the compute dtype."""
    # The matmul reads its inputs in the compute dtype but accumulates and returns float32, so the
    # softmax and the loss are float32 even when the model computes in bfloat16.
    if self.cfg.share_embeddings:
      return precision.einsum("...d,vd->...v", y.astype(self.cfg.compute_dtype), self.output_table(),
                              self.cfg.mixed_dtype)
    return self.output_projection(y).astype(jnp.float32)

  def output_table(self):
    """The pre-softmax weights as [vocab, d_model] in the compute dtype: logits = y @ table^T."""
    dtype = self.cfg.compute_dtype
    if self.cfg.share_embeddings:
      return self.shared_embedding.embedding.astype(dtype)
    return self.output_projection.variables["params"]["kernel"].T.astype(dtype)

  def features(self, src, tgt_in, src_segments=None, tgt_segments=None, src_positions=None,
               tgt_positions=None, deterministic=True):
    """Like __call__, but stops before the output projection (for a fused output layer and loss).

    Returns (decoder outputs [b, tgt_len, d_model] in the compute dtype, output_table() [vocab, d_model]).
    """
    y = self._teacher_forced(src, tgt_in, src_segments, tgt_segments, src_positions, tgt_positions,
                             deterministic)
    if not self.cfg.share_embeddings and self.is_initializing():
      self.output_projection(y[:, :1])   # creates its parameters when init goes through here
    return y.astype(self.cfg.compute_dtype), self.output_table()

  def encode(self, src, src_segments=None, src_positions=None, deterministic=True):
    """src int [b, src_len] -> enc_out [b, src_len, d_model]."""
    src_segments, src_positions = _segments_and_positions(src, src_segments, src_positions)
    return self.encoder(src, src_segments, src_positions, deterministic)

  def decode(self, tgt_in, enc_out, src_segments, tgt_segments=None, tgt_positions=None,
             deterministic=True):
    """Teacher-forced decoder: tgt_in [b, tgt_len] -> logits float32 [b, tgt_len, vocab]."""
    return self.logits(self._decoder_outputs(tgt_in, enc_out, src_segments, tgt_segments, tgt_positions,
                                             deterministic))

  def _decoder_outputs(self, tgt_in, enc_out, src_segments, tgt_segments, tgt_positions, deterministic):
    """Decoder outputs [b, tgt_len, d_model] (before the output projection)."""
    tgt_segments, tgt_positions = _segments_and_positions(tgt_in, tgt_segments, tgt_positions)
    return self.decoder(tgt_in, tgt_segments, tgt_positions, enc_out, src_segments, deterministic)

  def _teacher_forced(self, src, tgt_in, src_segments, tgt_segments, src_positions, tgt_positions,
                      deterministic):
    """Encoder then decoder over whole sequences: decoder outputs [b, tgt_len, d_model]."""
    src_segments, src_positions = _segments_and_positions(src, src_segments, src_positions)
    enc_out = self.encoder(src, src_segments, src_positions, deterministic)
    return self._decoder_outputs(tgt_in, enc_out, src_segments, tgt_segments, tgt_positions, deterministic)

  def __call__(self, src, tgt_in, src_segments=None, tgt_segments=None, src_positions=None,
               tgt_positions=None, deterministic=True):
    """src [b, src_len], tgt_in [b, tgt_len] (BOS + target, shifted right) -> logits [b, tgt_len, vocab]."""
    return self.logits(self._teacher_forced(src, tgt_in, src_segments, tgt_segments, src_positions,
                                            tgt_positions, deterministic))

  def cross_kv(self, enc_out):
    """enc_out [b, src_len, d_model] -> per decoder layer (keys [b, h, src_len, d_k], values [b, h, src_len, d_v])."""
    return self.decoder.cross_kv(enc_out)

  def decode_step(self, ids, cache, cross, src_mask, output_kernel=None):
    """One incremental step for n = b * k rows (rows r*k .. r*k+k-1 translate source sentence r).

    ids int32 [n]; cache from `init_cache(cfg, n, max_len)`; cross from `cross_kv` ([b, ...] leaves);
    src_mask bool [b, src_len]. Returns (logits float32 [n, vocab], new cache).
    output_kernel: None, or `output_kernel()` computed once before the decoding loop.
    """
    y, cache = self.decoder.step(ids, cache, cross, src_mask)
    if output_kernel is None:
      return self.logits(y), cache
    return jnp.dot(y.astype(output_kernel.dtype), output_kernel, preferred_element_type=jnp.float32), cache

  def output_kernel(self):
    """The pre-softmax weights as [d_model, vocab] (logits = y @ kernel), for decoding: computed once
    outside the loop, the matmul reads it in the layout it wants, where `logits` reads the shared
    [vocab, d_model] table transposed at every step (greedy decoding 1.2x faster per output matmul at
    8-16 rows; logits then differ in float rounding, ~1e-5)."""
    return jnp.swapaxes(self.output_table(), 0, 1).astype(self.cfg.mixed_dtype or self.cfg.compute_dtype)


def init_cache(cfg: TransformerConfig, batch_size: int, max_len: int, beam_slots: bool = False):
  """An empty self-attention cache for `batch_size` rows and up to `max_len` decoded tokens.

  Every leaf has leading dimension batch_size (so beam search can tile and reorder it): per layer
  'k' [batch_size, h, max_len, d_k] and 'v' [batch_size, h, max_len, d_v] (head-major: see
  model.attention.cached_attention), and 'index' int32 [batch_size], the position the next token is
  written to (equal across rows).
  beam_slots=True adds 'slot_history' int32 [batch_size, max_len] for beam search: row r*k + j's cache
  is then the k-th beam *slot* j of sentence r, written by whichever hypothesis held the slot at each
  step, and slot_history[row, t] names the slot holding the row's entry at position t. Such a cache must
  be reordered with `reorder_cache` (beam_search(..., reorder=reorder_cache)), never gathered whole.
  """
  if max_len > cfg.max_len and cfg.learned_positions:
    raise ValueError(f"max_len={max_len} exceeds the model's learned positions (cfg.max_len={cfg.max_len})")
  # With mixed precision only matmuls read the cache, in the matmul dtype: it is stored rounded.
  dtype = cfg.mixed_dtype or cfg.compute_dtype
  layer = lambda: {"k": jnp.zeros((batch_size, cfg.num_heads, max_len, cfg.head_dim_k), dtype),
                   "v": jnp.zeros((batch_size, cfg.num_heads, max_len, cfg.head_dim_v), dtype)}
  cache = {"index": jnp.zeros((batch_size,), jnp.int32),
           "layers": [layer() for _ in range(cfg.num_decoder_layers)]}
  if beam_slots:
    cache["slot_history"] = jnp.zeros((batch_size, max_len), jnp.int32)
  return cache


def reorder_cache(cache, rows):
  """Beam search's reorder for a cache from `init_cache`: new row i continues old row rows[i].

  A plain cache is gathered whole. A beam-slot cache (`beam_slots=True`) only gathers its slot history
  (int32 [n, L]): the keys and values stay where they were written, which saves copying every layer's
  cache at every step.
  """
  take = lambda x: jnp.take(x, rows, axis=0)
  if "slot_history" not in cache:
    return jax.tree_util.tree_map(take, cache)
  return dict(cache, index=take(cache["index"]), slot_history=take(cache["slot_history"]))
