"""The encoder-decoder Transformer (Vaswani et al., 2017), as pure Linen modules.

    model = Transformer(cfg)
    params = model.init({'params': key}, src, tgt_in)['params']
    logits = model.apply({'params': params}, src, tgt_in)                    # [b, tgt_len, vocab] f32

Incremental decoding (what decode/ uses):
    enc_out = model.apply({'params': params}, src, method='encode')          # [b, src_len, d_model]
    weights = model.apply({'params': params}, method='decoding_weights')   # once per set of parameters
    memory = model.apply({'params': params}, enc_out, weights, method='prepare_decoding')   # once per batch
    cache = init_cache(cfg, batch_size=n, max_len=L)
    logits, cache = model.apply({'params': params}, ids, cache, memory, src != 0, method='decode_step')
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import attention
from model.config import TransformerConfig, as_dtype
from model.embedding import Embedder
from model.heads import ClassificationHead, MaskedLMHead
from model import stack
from model.layers import DecoderLayer, EncoderLayer, Step, layer_norm
from model.ops import decoding_for, ops_for
from model.positions import PositionBias


def _segments_and_positions(ids, segments, positions):
  """Unpacked inputs: segment 1 on tokens, 0 on padding; positions 0, 1, 2, ... per row."""
  if segments is None:
    segments = (ids != 0).astype(jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
  return segments, positions


class _Stack(nn.Module):
  """What the encoder and the decoder share: the embedding, the layers, the position bias (alibi,
  relative) and, with pre_norm, a final norm."""
  cfg: TransformerConfig
  shared_embedding: nn.Module | None = None
  packed: bool = True   # Transformer.packed

  def setup(self):
    cfg, decoder = self.cfg, isinstance(self, Decoder)
    self.embed = Embedder(cfg.d_model, cfg.max_len, cfg.dropout_rate, cfg.positions, self.shared_embedding,
                          cfg.vocab_size, as_dtype(cfg.compute.dtype), as_dtype(cfg.param_dtype), ops_for(cfg).dropout)
    if decoder:
      self.layers = stack.make(cfg, DecoderLayer, cfg.num_decoder_layers, deterministic_argnum=5)
    else:
      self.layers = stack.make(cfg, EncoderLayer, cfg.num_encoder_layers, deterministic_argnum=3)
    self.position_bias = PositionBias(cfg, bidirectional=not decoder)
    if cfg.pre_norm:
      self.final_norm = layer_norm(cfg)

  def _finish(self, x):
    return self.final_norm(x) if self.cfg.pre_norm else x


class Encoder(_Stack):
  """The embedded source through N layers of self-attention and FFN."""

  def __call__(self, src, src_segments, src_positions, deterministic=True):
    """src, src_segments, src_positions: int [b, src_len]. Returns enc_out [b, src_len, d_model]."""
    x = self.embed(src, src_positions, deterministic)
    mask = attention.packed_mask(src_segments, src_segments, False, self.packed, self.cfg, src_positions,
                                 src_positions)                       # dense [b, 1, src_len, src_len]
    bias = self.position_bias(src_positions, src_positions)    # None or [b, h, src_len, src_len]
    return self._finish(stack.apply(self.layers, x, mask, deterministic, src_positions, bias))


class Decoder(_Stack):
  """The embedded target through N layers of masked self-attention, cross-attention and FFN; teacher-forced
  (`__call__`), one token per step (`step`), or a decoder-only prompt in one cached pass (`prefill`)."""

  def __call__(self, tgt_in, tgt_segments, tgt_positions, enc_out, src_segments, deterministic=True):
    """Teacher-forced pass. Returns decoder outputs [b, tgt_len, d_model] (before the softmax layer).
    Without cross-attention (decoder-only) enc_out and src_segments are None."""
    x = self.embed(tgt_in, tgt_positions, deterministic)
    self_mask = attention.packed_mask(tgt_segments, tgt_segments, True, self.packed, self.cfg, tgt_positions,
                                      tgt_positions)                  # dense [b, 1, tgt_len, tgt_len]
    cross_mask = (None if enc_out is None else   # [b, 1, tgt_len, src_len]
                  attention.packed_mask(tgt_segments, src_segments, False, self.packed, self.cfg))
    bias = self.position_bias(tgt_positions, tgt_positions)   # None or [b, h, tgt_len, tgt_len]
    x = stack.apply(self.layers, x, enc_out, self_mask, cross_mask, deterministic, tgt_positions, bias)
    return self._finish(x)

  def prefill(self, prompt, cache):
    """Decoder-only: runs a prompt int [n, P], left-padded with 0, through the stack in one pass and
    writes its keys and values into a plain cache (positions 0..P-1). Returns (outputs of its last
    position [n, d_model], cache at index P with 'offset' [n] = each row's left padding)."""
    length = prompt.shape[1]
    offset = length - jnp.sum(prompt != 0, axis=1).astype(jnp.int32)              # [n]
    positions = jnp.maximum(jnp.arange(length, dtype=jnp.int32)[None] - offset[:, None], 0)
    segments = (prompt != 0).astype(jnp.int32)
    x = self.embed(prompt, positions)
    mask = attention.visible(self.cfg, segments, segments, positions, positions, causal=True)
    bias = self.position_bias(positions, positions)
    new_layers = []
    for layer, layer_cache in zip(self.layers, cache["layers"]):
      x, new_layer_cache = layer.prefill(x, layer_cache, mask, positions, bias)
      new_layers.append(new_layer_cache)
    cache = {"index": cache["index"] + length, "offset": offset, "layers": new_layers}
    return self._finish(x)[:, -1], cache

  def cross_kv(self, enc_out, kv):
    """Per layer, the cross-attention keys and values of enc_out, stored as the cache `kv` reads them."""
    return [kv.prepare_cross(*layer.cross_attention.project_kv(enc_out)) for layer in self.layers]

  def step(self, ids, cache, cross, src_mask, kv):
    """ids int32 [n] at position cache['index']; kv: the decoding cache object (model/cache.py) that
    made `cache`. Returns (outputs [n, d_model], new cache)."""
    index, n, length = cache["index"][0], ids.shape[0], kv.length(cache)
    positions = jnp.broadcast_to(index, ids.shape)[:, None]                              # [n, 1]
    key_positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (n, length))   # [n, L]
    if "offset" in cache:       # a decoder-only prompt, left-padded by offset [n]
      positions = positions - cache["offset"][:, None]
      key_positions = key_positions - cache["offset"][:, None]
    # The cache's entries: real from the prompt's first token on (later ones are hidden as causal).
    self_mask = attention.visible(self.cfg, jnp.ones_like(positions), (key_positions >= 0).astype(jnp.int32),
                                  positions, key_positions, causal=True)                 # [n, 1, 1, L]
    cross_mask = None if src_mask is None else attention.visible(
        self.cfg, jnp.ones((src_mask.shape[0], 1), jnp.int32), src_mask.astype(jnp.int32))   # [b, 1, 1, src]
    x = self.embed(ids[:, None], positions)                    # [n, 1, d_model]
    bias = self.position_bias(positions, key_positions)      # None or [n, h, 1, L]
    carried, context = kv.start_step(cache, index, n if src_mask is None else src_mask.shape[0])
    step = Step(index, kv, context, positions, self_mask, cross_mask, bias)
    cross = cross if cross is not None else [None] * len(self.layers)
    new_layers = []
    for layer, layer_cache, layer_cross in zip(self.layers, cache["layers"], cross):
      x, new_layer_cache = layer.step(x, layer_cache, layer_cross, step)
      new_layers.append(new_layer_cache)
    # Carried over: 'offset'; renewed: 'index', the layers and what start_step renews.
    return self._finish(x)[:, 0], {**cache, **carried, "index": cache["index"] + 1, "layers": new_layers}


class Transformer(nn.Module):
  """Encoder-decoder with (by default) one embedding matrix shared by both inputs and the output.

  packed: whether a teacher-forced batch's rows may hold several sequences (data.pack). False promises one
  sequence a row, padding after it, so that a fused attention kernel takes the mask as lengths and a causal
  flag (kernels/fused_attention.py); on batches that keep the promise it changes nothing."""
  cfg: TransformerConfig
  packed: bool = True

  def setup(self):
    cfg, ops = self.cfg, ops_for(self.cfg)
    dtype, param_dtype = as_dtype(cfg.compute.dtype), as_dtype(cfg.param_dtype)
    shared = None
    if cfg.share_embeddings:
      shared = self.shared_embedding = nn.Embed(
          cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=param_dtype,
          embedding_init=nn.initializers.normal(stddev=cfg.d_model ** -0.5), name="shared_embedding")
    if cfg.arch != "decoder_only":
      self.encoder = Encoder(cfg, shared, self.packed)
    if cfg.arch != "encoder_only":
      self.decoder = Decoder(cfg, shared, self.packed)
    else:
      self.mlm_head = MaskedLMHead(cfg)
      if cfg.num_classes:
        self.classifier = ClassificationHead(cfg)
    if not cfg.share_embeddings:
      # Operands in the compute dtype, products accumulated and returned in float32.
      self.output_projection = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype,
                                        param_dtype=param_dtype, dot_general=ops.float32_dot_general,
                                        name="output_projection")
    if cfg.logits_bias:
      self.final_logits_bias = self.param("final_logits_bias", nn.initializers.zeros, (cfg.vocab_size,),
                                          param_dtype)

  def add_logits_bias(self, logits):
    """float32 logits [..., vocab] + the learned bias of cfg.logits_bias (Marian's final_logits_bias), on
    every path that makes logits; the chunked loss (train/chunked_loss.py) adds it to `features`' itself."""
    return logits + self.final_logits_bias.astype(jnp.float32) if self.cfg.logits_bias else logits

  def logits(self, y):
    """Decoder outputs [..., d_model] -> float32 logits [..., vocab], whatever the compute dtype."""
    # The matmul reads its inputs in the compute dtype but accumulates and returns float32, so the
    # softmax and the loss are float32 even when the model computes in bfloat16.
    if self.cfg.arch == "encoder_only":
      y = self.mlm_head(y)
    if self.cfg.share_embeddings:
      logits = jnp.einsum("...d,vd->...v", y.astype(as_dtype(self.cfg.compute.dtype)), self.output_table(),
                        preferred_element_type=jnp.float32,
                        _dot_general=ops_for(self.cfg).dot_general or jax.lax.dot_general)
    else:
      logits = self.output_projection(y)
    logits = self.add_logits_bias(logits)
    return self.mlm_head.add_bias(logits) if self.cfg.arch == "encoder_only" else logits

  def output_table(self):
    """The pre-softmax weights as [vocab, d_model] in the compute dtype: logits = y @ table^T."""
    dtype = as_dtype(self.cfg.compute.dtype)
    if self.cfg.share_embeddings:
      return self.shared_embedding.embedding.astype(dtype)
    return self.output_projection.variables["params"]["kernel"].T.astype(dtype)

  def features(self, src, tgt_in, src_segments=None, tgt_segments=None, src_positions=None,
               tgt_positions=None, deterministic=True):
    """Like __call__, but stops before the output projection, for a fused output layer and loss: (decoder
    outputs [b, tgt_len, d_model] in the compute dtype, output_table() [vocab, d_model])."""
    y = self._teacher_forced(src, tgt_in, src_segments, tgt_segments, src_positions, tgt_positions,
                             deterministic)
    if not self.cfg.share_embeddings and self.is_initializing():
      self.output_projection(y[:, :1])   # creates its parameters when init goes through here
    return y.astype(as_dtype(self.cfg.compute.dtype)), self.output_table()

  def classify(self, src, src_segments=None, src_positions=None, deterministic=True):
    """Encoder-only with num_classes: src int [b, src_len] -> float32 class logits [b, num_classes],
    from the pooled output (the first position's encoding, as BERT pools its [CLS])."""
    return self.classifier(self.encode(src, src_segments, src_positions, deterministic), deterministic)

  def encode(self, src, src_segments=None, src_positions=None, deterministic=True):
    """src int [b, src_len] -> enc_out [b, src_len, d_model]."""
    src_segments, src_positions = _segments_and_positions(src, src_segments, src_positions)
    return self.encoder(src, src_segments, src_positions, deterministic)

  def _teacher_forced(self, src, tgt_in, src_segments, tgt_segments, src_positions, tgt_positions,
                      deterministic):
    """Encoder then decoder over whole sequences: decoder outputs [b, tgt_len, d_model]. Decoder-only
    reads tgt_* alone (src may be None); encoder-only reads src_* alone and returns encoder outputs."""
    enc_out = None
    if self.cfg.arch != "decoder_only":
      src_segments, src_positions = _segments_and_positions(src, src_segments, src_positions)
      enc_out = self.encoder(src, src_segments, src_positions, deterministic)
    if self.cfg.arch == "encoder_only":
      return enc_out
    tgt_segments, tgt_positions = _segments_and_positions(tgt_in, tgt_segments, tgt_positions)
    return self.decoder(tgt_in, tgt_segments, tgt_positions, enc_out, src_segments, deterministic)

  def __call__(self, src, tgt_in, src_segments=None, tgt_segments=None, src_positions=None,
               tgt_positions=None, deterministic=True):
    """src [b, src_len], tgt_in [b, tgt_len] (BOS + target, shifted right) -> logits [b, tgt_len, vocab].
    Decoder-only: logits over tgt_in (src may be None); encoder-only: masked-LM logits [b, src_len, vocab]
    over src (tgt_in may be None)."""
    return self.logits(self._teacher_forced(src, tgt_in, src_segments, tgt_segments, src_positions,
                                            tgt_positions, deterministic))

  def decoding_weights(self):
    """What every decoding step reads that depends on the parameters alone: the pre-softmax weights
    ('output') and what else the decoding backend lays out (model/ops.py's Decoding.layer_weights).
    decode/translate.py computes them once per set of parameters, not once per batch."""
    stack.check_unrolled(self.cfg, "decoding_weights")
    backend = decoding_for(self.cfg)
    weights = {"output": backend.decoding_weights(self.output_table())}
    if backend.layer_weights is not None:
      weights.update(backend.layer_weights(self.variables["params"]["decoder"]))
    return weights

  def prepare_decoding(self, enc_out, weights=None):
    """What every decoding step reads and nothing changes, computed once per batch: `weights` (from
    `decoding_weights`; None: computed here) and per decoder layer the cross-attention keys and values
    of enc_out [b, src_len, d_model] ('cross', laid out as the decoding cache reads them)."""
    stack.check_unrolled(self.cfg, "prepare_decoding")
    memory = dict(self.decoding_weights() if weights is None else weights)
    if self.cfg.arch != "decoder_only":   # else nothing to cross-attend to; enc_out may be None
      cache = decoding_for(self.cfg).cache(False)   # the keys' and values' layout: the same for every cache kind
      memory["cross"] = self.decoder.cross_kv(enc_out, cache)
    return memory

  def prefill(self, prompt, cache, memory):
    """Decoder-only: a prompt int [n, P] (left-padded with 0) in one cached pass. Returns (logits
    float32 [n, vocab] for the token after the prompt, cache ready for decode_step at index P)."""
    y, cache = self.decoder.prefill(prompt, cache)
    return self.add_logits_bias(decoding_for(self.cfg).decoding_logits(y, memory["output"])), cache

  def decode_step(self, ids, cache, memory, src_mask):
    """One incremental step for n = b * k rows (rows r*k .. r*k+k-1 translate source sentence r): ids int32
    [n]; cache from `init_cache(cfg, n, max_len)`; memory from `prepare_decoding` ([b, ...] leaves); src_mask
    bool [b, src_len] (None without cross-attention). Returns (logits float32 [n, vocab], new cache)."""
    backend = decoding_for(self.cfg)
    with backend.step_scope(memory):
      y, cache = self.decoder.step(ids, cache, memory.get("cross"), src_mask,
                                   backend.cache("slot_history" in cache))
    return self.add_logits_bias(backend.decoding_logits(y, memory["output"])), cache


def init_cache(cfg: TransformerConfig, batch_size: int, max_len: int, beam_slots: bool = False):
  """An empty self-attention cache for `batch_size` rows and up to `max_len` decoded tokens: 'index' int32
  [batch_size] (the position written next, equal across rows) and the chosen cache's entries (model/cache.py,
  or the decoding backend's), every leaf [batch_size, ...] so that beam search can tile and reorder it.
  beam_slots=True: a cache that only `reorder_cache` reorders (a backend may keep keys and values in place).
  """
  if max_len > cfg.max_len and cfg.positions == "learned":
    raise ValueError(f"max_len={max_len} exceeds the model's learned positions (cfg.max_len={cfg.max_len})")
  if cfg.arch == "encoder_only":
    raise ValueError("arch='encoder_only' has no decoder to decode with")
  stack.check_unrolled(cfg, "init_cache")
  cache = decoding_for(cfg).cache(beam_slots).init(batch_size, max_len)
  if cfg.arch == "decoder_only":
    cache["offset"] = jnp.zeros((batch_size,), jnp.int32)   # left padding of the prompt (prefill)
  return cache


def reorder_cache(cfg: TransformerConfig, cache, rows):
  """Beam search's reorder for a cache from `init_cache`: new row i continues old row rows[i].
  Use as beam_search(..., reorder=functools.partial(reorder_cache, cfg))."""
  return decoding_for(cfg).cache("slot_history" in cache).reorder(cache, rows)
