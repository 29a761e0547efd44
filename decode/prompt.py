"""Decoding with a decoder-only model: a cached prefill of the prompt, then the same beam search (or
sampling) and KV cache as the encoder-decoder.

    sequences, scores = prompt_search(model, params, prompts, beam_size=4, max_len=20)

decode.translate translates with a decoder-only model the same way (`translation_prompts`, `prefilled`).

A translation prompt is BOS + source + SEP (data/lm.py), so the search generates target pieces up to
EOS exactly as the model was trained to; a language-model prompt is BOS + text.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from data.lm import SEP
from data.vocab import BOS, EOS
from decode import beam_search as beam_lib
from decode.beam_search import beam_search
from decode.sampling import sample
from model import init_cache
from model.ops import decoding_for


def left_pad(prompts, length: int | None = None) -> np.ndarray:
  """Int sequences -> int32 [n, P], each sequence at the right end (padding 0 on the left); P is
  `length`, or the longest sequence's."""
  length = max(len(p) for p in prompts) if length is None else length
  out = np.zeros((len(prompts), length), np.int32)
  for row, p in enumerate(prompts):
    out[row, length - len(p):] = p
  return out


def translation_prompts(src) -> np.ndarray:
  """Sources int [n, len] (right-padded with 0) -> decoder-only translation prompts BOS + source + SEP,
  int32 [n, len + 2], left-padded (data/lm.py's layout, without the target)."""
  src = np.asarray(src)
  return left_pad([[BOS, *row[row != 0], SEP] for row in src], src.shape[1] + 2)


def prefilled(model, params, prompt, max_len, weights=None):
  """A decoder-only model's search callback and cache after a cached prefill of prompt int32 [n, P]
  (left-padded), with room for max_len generated tokens: (tokens_to_logits, cache) for beam_search or
  sample with bos_id=0. weights: the model's decoding_weights (None: computed here).

  Prefills all but the last prompt token; the search's first call (whatever bos it feeds) reads each
  row's last prompt token instead, so rows of different prompts start together."""
  variables = {"params": params}
  memory = model.apply(variables, None, weights, method="prepare_decoding")
  n, length = prompt.shape
  cache = init_cache(model.cfg, n, length + max_len)
  if length > 1:
    _, cache = model.apply(variables, prompt[:, :-1], cache, memory, method="prefill")
  else:
    cache["offset"] = jnp.zeros((n,), jnp.int32)
  cache["last"] = prompt[:, -1]
  start = length - 1

  def tokens_to_logits(ids, cache):
    cache = dict(cache)
    last = cache.pop("last")
    ids = jnp.where(cache["index"] == start, last, ids)
    logits, cache = model.apply(variables, ids, cache, memory, None, method="decode_step")
    return logits, {**cache, "last": last}
  return tokens_to_logits, cache


@functools.partial(jax.jit, static_argnames=("model", "beam_size", "max_len", "alpha",
                                             "repetition_penalty"))
def prompt_search(model, params, prompt, *, beam_size=4, max_len=20, alpha=0.6, repetition_penalty=1.0):
  """Beam search continuing prompt int32 [n, P] (left-padded; a translation prompt ends in the
  separator): (sequences int32 [n, k, max_len], scores [n, k]), best first."""
  tokens_to_logits, cache = prefilled(model, params, prompt, max_len)
  return beam_search(tokens_to_logits, cache, batch_size=prompt.shape[0], beam_size=beam_size,
                     max_len=max_len, eos_id=EOS, bos_id=0, alpha=alpha,
                     repetition_penalty=repetition_penalty,
                     extensions=decoding_for(model.cfg).extensions(beam_lib.select_extensions))


@functools.partial(jax.jit, static_argnames=("model", "max_len", "temperature", "top_k", "top_p",
                                             "repetition_penalty"))
def prompt_sample(model, params, prompt, rng, *, max_len=20, temperature=1.0, top_k=0, top_p=1.0,
                  repetition_penalty=1.0):
  """Greedy (temperature 0) or sampled continuation of prompt int32 [n, P] (left-padded):
  (sequences int32 [n, max_len], scores [n])."""
  tokens_to_logits, cache = prefilled(model, params, prompt, max_len)
  return sample(tokens_to_logits, cache, rng, batch_size=prompt.shape[0], max_len=max_len, eos_id=EOS,
                bos_id=0, temperature=temperature, top_k=top_k, top_p=top_p,
                repetition_penalty=repetition_penalty,
                extensions=decoding_for(model.cfg).extensions(beam_lib.select_extensions))
