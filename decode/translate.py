"""Raw text in, translations out: tokenize, bucket by length, beam-search on the model, detokenize.

    hyps = translate(model, params, vocab, ["a sentence", ...], beam_size=4, alpha=0.6, max_extra_len=50)

A decoder-only model (arch="decoder_only", trained with data.task="decoder_only_mt") reads each source
as the prompt BOS source SEP, prefilled in one cached pass, then searches the same way (decode/prompt.py).

Per batch the encoder runs once, and the cross-attention keys and values are computed once per source
sentence and shared by its beams (they live in the callback's closure, not in the beam cache, so the
search never copies or reorders them). Sentences are sorted into length buckets with a few fixed padded
shapes, so jit compiles a bounded number of programs; outputs come back in input order. Training's
periodic and final BLEU use this function.
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from data.batching import bucket_lengths
from data.vocab import BOS, EOS
from decode import DEFAULTS, device_batch_tokens
from decode import beam_search as beam_lib
from decode import prompt as prompt_lib
from decode import sampling as sampling_lib
from model import Transformer, TransformerConfig, init_cache, reorder_cache
from model.ops import decoding_for
from run import programs
from run.mesh import make_mesh


def bucket_length(length: int) -> int:
  """8, 12, 16, 24, 32, 48, 64, 96, ... (data.batching's buckets): padding wastes at most a third, and
  few shapes compile."""
  return next(b for b in bucket_lengths(1 << 30) if b >= length)


def pow2_floor(n: int) -> int:
  return 1 << (max(n, 1).bit_length() - 1)


def batch_rows(count: int, max_rows: int) -> int:
  """Rows for a batch of `count` sentences: max_rows (one shape per bucket, so one compile), or for a
  bucket that is one small batch, the next power of two (a single short sentence stays cheap)."""
  rows = 1
  while rows < count:
    rows *= 2
  return min(rows, max_rows)


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


@functools.lru_cache(maxsize=None)
def search_fn(cfg: TransformerConfig, beam_size: int, alpha: float, min_len: int, steps: int,
               sampling: tuple = (), mesh: Mesh | None = None):
  """The jitted encode + search for one model config and search setting: beam search, or with
  `sampling` (sorted (name, value) pairs of decode.sampling.sample's settings) one sample per sentence.

  With a mesh, the sentences of a batch are split over its 'data' axis and every device searches its own
  share (parameters replicated): data parallelism, with no communication until the results are gathered.
  Sentences do not interact in a search, so beam search and greedy give the same translations on any
  number of devices (scores agree up to float rounding). Sampling draws every row from its own key (rng:
  keys [n], or one key with each row's `index`, int32 [n] (default 0..n-1), folded in), so samples do not
  depend on the number of devices.
  """
  model = Transformer(cfg)
  sharded = mesh is not None and mesh.devices.size > 1
  # How beam search picks a step's candidates, and greedy its token: the decoding backend's (a C++ kernel
  # on the CPU path; None elsewhere: XLA ops).
  fast = decoding_for(cfg).extensions(beam_lib.select_extensions)

  def encoded(params, src, weights):
    """The encoder-decoder's callback and cache: the encoder runs once per batch."""
    variables = {"params": params}
    enc_out = model.apply(variables, src, method="encode")
    memory = model.apply(variables, enc_out, weights, method="prepare_decoding")   # once per batch
    src_mask = src != 0

    def tokens_to_logits(ids, cache):
      return model.apply(variables, ids, cache, memory, src_mask, method="decode_step")

    # Beam search may keep the keys and values where they were written (no per-step reorder copy).
    cache = init_cache(cfg, src.shape[0], steps, beam_slots=not sampling and beam_size > 1)
    return tokens_to_logits, cache, BOS, functools.partial(reorder_cache, cfg)

  def search(params, src, limits, rng, weights=None):
    """src: sources int32 [n, len], or with a decoder-only model their prompts (translation_prompts);
    weights: decoding_weights_fn(cfg, mesh)(params), or None to compute them in every call."""
    if cfg.arch == "decoder_only":   # a cached prefill of BOS source SEP, then the same search
      tokens_to_logits, cache = prompt_lib.prefilled(model, params, src, steps, weights)
      bos, reorder = 0, None
    else:
      tokens_to_logits, cache, bos, reorder = encoded(params, src, weights)
    if sampling:
      seqs, scores = sampling_lib.sample(
          tokens_to_logits, cache, rng, batch_size=src.shape[0], max_len=limits, max_steps=steps,
          eos_id=EOS, bos_id=bos, min_len=min_len, extensions=fast, **dict(sampling))
      return seqs[:, None], scores[:, None]
    return beam_lib.beam_search(
        tokens_to_logits, cache, batch_size=src.shape[0],
        beam_size=beam_size, max_len=limits, max_steps=steps, eos_id=EOS, bos_id=bos, alpha=alpha,
        min_len=min_len, reorder=reorder, extensions=fast)

  def row_keys(rng, n, index):   # [n]: as given, or one key with each row's index (or 0..n-1) folded in
    if rng.ndim:
      return rng
    return jax.vmap(jax.random.fold_in, (None, 0))(rng, jnp.arange(n) if index is None else index)

  if not sharded:
    return programs.jit(lambda params, src, limits, rng, weights=None, index=None:
                        search(params, src, limits, row_keys(rng, src.shape[0], index), weights))
  rows = P("data")
  split = jax.shard_map(search, mesh=mesh, in_specs=(P(), rows, rows, rows, P()), out_specs=rows,
                        check_vma=False)
  return programs.jit(lambda params, src, limits, rng, weights=None, index=None:
                      split(params, src, limits, row_keys(rng, src.shape[0], index), weights))


@functools.lru_cache(maxsize=None)
def decoding_weights_fn(cfg: TransformerConfig, mesh: Mesh | None = None):
  """The jitted params -> the model's decoding_weights (the output layer's table and, on the C++ path,
  the decoder's kernels laid out as panels), replicated over the mesh: what search_fn's searches read
  in every step and that depends on the parameters alone. translate() computes it once for all its
  batches rather than once per batch (docs/performance.md has what that gained)."""
  model = Transformer(cfg)
  weights = lambda params: model.apply({"params": params}, method="decoding_weights")
  if mesh is None:
    return programs.jit(weights)
  return programs.jit(weights, out_shardings=NamedSharding(mesh, P()))


def translate(model, params, vocab, sentences, *, beam_size=DEFAULTS["beam_size"],
              alpha=DEFAULTS["alpha"], max_extra_len=DEFAULTS["max_extra_len"],
              batch_tokens=DEFAULTS["batch_tokens"], nbest=1, min_len=0, sampling=None, seed=0, progress=False,
              mesh=None, source_eos=False, first_index=0, return_lengths=False, full_batches=False):
  """Translates raw sentences with beam search; returns their translations in input order.

  sampling: None (beam search), or a dict of decode.sampling.sample settings (temperature, top_k, top_p,
  repetition_penalty) to draw one translation per sentence instead (temperature 0 is greedy); beam_size
  then only sizes the batches and nbest must be 1. Sentence i is drawn with `seed` and first_index + i
  folded into one key: the same samples on any number of devices, in any batch, and in a shard of a
  larger input that starts at its line first_index (decode/bulk.py).
  max_extra_len: a hypothesis may have up to source length + max_extra_len tokens (the paper: + 50).
  batch_tokens: per device: each device's rows of a batch are chosen so that rows * beam_size * padded
  source length <= this (a batch has that many rows times the mesh's devices); 0: the device's default
  (decode.DEVICE_BATCH_TOKENS: 4,096 on a CPU device, 65,536 on a GPU or TPU chip).
  nbest=1 returns a list of strings; nbest=K (<= beam_size) returns, per sentence, a list of K
  (translation, score) pairs, best first.
  source_eos: end every source with EOS, as the model was trained (config.data.source_eos).
  full_batches: give every batch its bucket's full number of rows, also where a bucket has fewer
  sentences (one program per bucket; decode/bulk.py's parts, where the small buckets' sizes vary from
  part to part and would otherwise compile a program for each power of two they reach).
  return_lengths: also return, per sentence, the number of target tokens of its best hypothesis (EOS
  excluded; 0 for an empty source): (translations, lengths).
  mesh: the devices that share each batch (default: run/mesh.py's mesh over this process's devices; on a
  CPU, `--xla_force_host_platform_device_count=CORES` makes one device per core).
  """
  cfg = model.cfg
  if vocab.size != cfg.vocab_size:
    raise ValueError(f"vocabulary {vocab.path} has {vocab.size} pieces but the model was built for "
                     f"{cfg.vocab_size}; use the run's own vocab.model")
  if not 1 <= nbest <= beam_size:
    raise ValueError(f"nbest={nbest} must be between 1 and beam_size={beam_size}")
  if sampling is not None and nbest != 1:
    raise ValueError("sampling draws one translation per sentence: use nbest=1")
  sampling_key = tuple(sorted((sampling or {}).items()))
  rng = jax.random.key(seed)
  mesh = make_mesh(jax.local_devices()) if mesh is None else mesh
  num_devices = mesh.devices.size
  batch_tokens = device_batch_tokens(batch_tokens, mesh.devices.flat[0].platform)
  params = jax.device_put(params, NamedSharding(mesh, P()))     # replicated once, not per batch
  weights = decoding_weights_fn(cfg, mesh)(params)              # laid out once, not per batch
  if vocab.eos_id != EOS or vocab.bos_id != BOS:
    raise ValueError(f"translate expects bos={BOS} and eos={EOS} (data.vocab ids)")
  sentences = list(sentences)
  ids = vocab.encode_batch(sentences) if sentences else []
  # Source tokens the model can read: a decoder-only model reads BOS source SEP and its translation in
  # its max_len positions (the prompt's room below is the source's + 2).
  prompts = cfg.arch == "decoder_only"
  limit = cfg.max_len // 2 - 2 if prompts else cfg.max_len
  too_long = [i for i, s in enumerate(ids) if len(s) > limit]
  if too_long:
    warnings.warn(f"translate: {len(too_long)} sources are longer than the {limit} tokens the model's "
                  f"max_len={cfg.max_len} allows and are truncated "
                  f"(first: input line {first_index + too_long[0] + 1})",
                  stacklevel=2)
    ids = [s[:limit] for s in ids]
  if source_eos:   # after the truncation, so that the source the model sees always ends with EOS
    ids = [s[:limit - 1] + [vocab.eos_id] if s else s for s in ids]

  results: list = [None] * len(sentences)
  tgt_lengths = [0] * len(sentences)
  buckets: dict[int, list[int]] = {}
  for i, s in enumerate(ids):
    if not s:   # nothing to translate
      results[i] = [("", 0.0)] * nbest
      continue
    buckets.setdefault(min(bucket_length(len(s)), limit), []).append(i)   # len(s) <= limit

  bar = tqdm.tqdm(total=len(sentences), desc="translate", unit="sent", disable=not progress,
                  leave=False)
  bar.update(len(sentences) - sum(len(v) for v in buckets.values()))
  for padded in sorted(buckets):
    members = sorted(buckets[padded], key=lambda i: len(ids[i]))
    # Rows per batch: a power of two per device (so few shapes compile), times the devices.
    max_rows = pow2_floor(batch_tokens // (padded * beam_size)) * num_devices
    steps = min(padded + max_extra_len, cfg.max_len - padded - 2 if prompts else limit)
    search = search_fn(cfg, beam_size, float(alpha), int(min_len), steps, sampling_key, mesh)
    for start in range(0, len(members), max_rows):
      chunk = members[start:start + max_rows]
      small = len(members) <= max_rows and not full_batches   # the bucket is one batch of its own size
      rows = batch_rows(len(chunk) if small else max_rows, max_rows)
      rows = _round_up(rows, num_devices)
      src = np.zeros((rows, padded), np.int32)
      src[:, 0] = vocab.eos_id        # filler rows: a one-token source, discarded
      lengths = np.ones((rows,), np.int32)
      for r, i in enumerate(chunk):
        src[r, :] = 0
        src[r, :len(ids[i])] = ids[i]
        lengths[r] = len(ids[i])
      limits = np.minimum(lengths + max_extra_len, steps).astype(np.int32)
      if prompts:
        src = prompt_lib.translation_prompts(src)
      # Filler rows: keys no sentence of this call uses (their samples are discarded).
      index = np.arange(first_index + len(sentences), first_index + len(sentences) + rows)
      index[:len(chunk)] = np.asarray(chunk) + first_index
      # Host arrays straight into the search (jnp.asarray would compile a program per shape to stage them).
      seqs, scores = jax.device_get(search(params, src, limits, rng, weights, index.astype(np.int32)))
      best_len = (seqs[:, 0] == EOS).argmax(axis=1)   # [rows]: every hypothesis ends in EOS
      for r, i in enumerate(chunk):
        results[i] = [(vocab.decode(seqs[r, j]), float(scores[r, j])) for j in range(nbest)]
        tgt_lengths[i] = int(best_len[r])
      bar.update(len(chunk))
  bar.close()
  if nbest == 1:
    results = [r[0][0] for r in results]
  return (results, tgt_lengths) if return_lengths else results
