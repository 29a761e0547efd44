"""Beam search's top-k over every extension, pruned by chunks for XLA:CPU.

    values, index = beam_top_k.top_extensions(alive_logp, logp, dead, n)

Exactly decode.beam_search.top_extensions (one jax.lax.top_k over the flattened [b, k * vocab] scores),
faster on XLA:CPU, whose TopK runs at about a nanosecond an element: a third of a decoding step of the
default model. kernels/cpu_backend.py hands it to the search where the C++ choice of candidates
(kernels/cpu_decoding.py) did not build.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 32         # tokens per chunk
NEG_INF = -1.0e9   # a dead sentence's scores: decode.beam_search.NEG_INF


def top_extensions(alive_logp, logp, dead, n, chunk=CHUNK):
  """The n best extensions of every sentence: exactly jax.lax.top_k over the flattened [b, k * vocab]
  scores total = where(dead, NEG_INF, alive_logp[:, :, None] + logp), ties to the lower flat index.

  alive_logp float32 [b, k]; logp float32 [b, k, vocab]; dead bool [b]. Returns (values [b, n], flat
  indices int32 [b, n]), best first.

  Rather than one top-k over all b * k * vocab scores, it splits every vocabulary row into chunks of
  `chunk` tokens, takes the n best chunks of a sentence by their maximum score, and runs the exact top-k
  over those n * chunk scores only. Exact: an extension among the n best lies in one of the n best
  chunks (a chunk ranking above its chunk holds an extension ranking above it, ties included, as chunks
  are runs of consecutive indices), and rounding alive + x is monotone in x, so a chunk's best score is
  alive + its best log-probability.
  """
  b, k, vocab = logp.shape
  chunks = -(-vocab // chunk)
  if chunks <= n:        # a small vocabulary: nothing to prune
    total = jnp.where(dead[:, None, None], NEG_INF, alive_logp[:, :, None] + logp)
    values, idx = jax.lax.top_k(total.reshape(b, k * vocab), n)
    return values, idx.astype(jnp.int32)
  padded = chunks * chunk
  if padded != vocab:    # pad every row to whole chunks with -inf, which no real score ties
    logp = jnp.pad(logp, ((0, 0), (0, 0), (0, padded - vocab)), constant_values=-jnp.inf)
  logp = logp.reshape(b, k, chunks, chunk)
  best = alive_logp[:, :, None] + jnp.max(logp, axis=-1)                     # [b, k, chunks]
  best = jnp.where(dead[:, None], NEG_INF, best.reshape(b, k * chunks))
  _, picked = jax.lax.top_k(best, n)
  picked = jnp.sort(picked, axis=-1)           # in index order, so that ties still go to the lower index
  scores = jnp.take_along_axis(logp.reshape(b, k * chunks, chunk), picked[:, :, None], axis=1)
  alive = jnp.take_along_axis(alive_logp, picked // chunks, axis=1)          # [b, n]: each chunk's parent
  scores = jnp.where(dead[:, None, None], NEG_INF, alive[:, :, None] + scores)   # [b, n, chunk]
  values, pos = jax.lax.top_k(scores.reshape(b, n * chunk), n)
  chunk_id = jnp.take_along_axis(picked, pos // chunk, axis=1)                # [b, n] in k * chunks
  parent, within = chunk_id // chunks, (chunk_id % chunks) * chunk + pos % chunk
  return values, (parent * vocab + within).astype(jnp.int32)
