"""Beam search as one `jax.lax.while_loop`: pure, jittable, and exact about when it may stop.

    sequences, scores = beam_search(tokens_to_logits, cache, batch_size=b, beam_size=k, max_len=l,
                                    eos_id=3, bos_id=2, alpha=0.6)

`tokens_to_logits(ids, cache) -> (logits, cache)` gets the last token of every hypothesis, int32
[b * k] (rows r*k .. r*k+k-1 belong to sentence r; the first call gets bos_id), and returns logits
[b * k, vocab]. Every array leaf of `cache` has leading dimension b; the search tiles it to b * k and
reorders it by parent hypothesis after every step, so the callback may keep per-hypothesis state there.
A cache that knows a cheaper way to follow the parents passes `reorder(cache, rows) -> cache` (new row i
continues old row rows[i]); model.reorder_cache can keep the keys and values in place that way.

Scores: the sum of the token log-probabilities (eos included) divided by the GNMT length penalty
((5 + length) / 6) ** alpha, length counting eos (Wu et al. 2016; the paper uses alpha = 0.6).

How it searches (the rule fairseq uses, which makes beam 1 exactly greedy): every step extends the k live
hypotheses of a sentence by every token and keeps the 2k best extensions by log-probability. Those among
the first k that end in eos are finished (and compete for the k finished slots by score); the k best that
do not end in eos stay live. A sentence stops when no live hypothesis can still beat its k-th finished
one: log-probabilities only fall as a hypothesis grows, so a live hypothesis's best possible score is its
log-probability so far over the most favourable length penalty it could still reach. At a sentence's
max_len only eos is allowed, so every returned hypothesis ends in eos.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1.0e9   # finite, so that no arithmetic on a dead hypothesis makes a NaN
# What a sentence's next step may append (select_extensions' mode): any token; any but eos (before
# min_len); only eos (its last step); nothing (finished, or past its limit).
FREE, NO_EOS, ONLY_EOS, DEAD = 0, 1, 2, 3


def length_penalty(length, alpha):
  """GNMT length penalty ((5 + length) / 6) ** alpha; length counts eos."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def static_len(max_len, max_steps, who="beam_search"):
  """The loop length L: max_steps if given, else max(max_len), which must then be concrete."""
  if max_steps is not None:
    return int(max_steps)
  try:
    return int(np.max(np.asarray(max_len)))
  except jax.errors.TracerArrayConversionError as e:
    raise ValueError(f"{who}: max_len is a traced array; pass max_steps= (a Python int, at least "
                     "max(max_len)) to fix the length of the output") from e


def tile_beams(tree, beam_size):
  """Every leaf [b, ...] -> [b * beam_size, ...], row r*k + j a copy of row r."""
  return jax.tree_util.tree_map(lambda x: jnp.repeat(x, beam_size, axis=0), tree)


def gather_rows(tree, rows):
  """Every leaf's rows in the order `rows` (the default reorder)."""
  return jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0), tree)


def apply_repetition_penalty(logits, seq, length, penalty):
  """Penalises, once each, the tokens among the first `length` of every row of seq [b, L] (logits [b, vocab]);
  used by beam search and by decode/sampling.py."""
  b, vocab = logits.shape
  ids = jnp.where(jnp.arange(seq.shape[1]) < length, seq, vocab)   # [b, L]; vocab: out of range, dropped
  seen = jnp.zeros((b, vocab), bool).at[jnp.arange(b)[:, None], ids].set(True, mode="drop")
  return jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)


def top_extensions(alive_logp, logp, dead, n):
  """The n best extensions of every sentence: jax.lax.top_k over the flattened [b, k * vocab] scores
  where(dead, NEG_INF, alive_logp[:, :, None] + logp), ties to the lower flat index.

  alive_logp float32 [b, k]; logp float32 [b, k, vocab]; dead bool [b]. Returns (values [b, n], flat
  indices int32 [b, n]), best first."""
  b, k, vocab = logp.shape
  total = jnp.where(dead[:, None, None], NEG_INF, alive_logp[:, :, None] + logp)   # [b, k, vocab]
  values, idx = jax.lax.top_k(total.reshape(b, k * vocab), n)
  return values, idx.astype(jnp.int32)


def select_extensions(logits, alive_logp, mode, n, eos_id, top=top_extensions):
  """The n best extensions of every sentence by log-probability so far.

  logits float32 [b, k, vocab]; alive_logp float32 [b, k]; mode int32 [b]: FREE, NO_EOS (eos gets
  NEG_INF), ONLY_EOS (every other token gets NEG_INF) or DEAD (every extension NEG_INF). Scores are
  alive_logp + log_softmax(logits); returns (values float32 [b, n], flat indices int32 [b, n] into
  k * vocab), best first, ties to the lower index. top: top_extensions, or a function that computes
  the same (a decoding backend's, model/ops.py's Decoding.extensions).
  """
  vocab = logits.shape[-1]
  logp = jax.nn.log_softmax(logits, axis=-1)
  is_eos = jnp.arange(vocab) == eos_id
  m = mode[:, None, None]
  logp = jnp.where(((m == ONLY_EOS) & ~is_eos) | ((m == NO_EOS) & is_eos), NEG_INF, logp)
  return top(alive_logp, logp, mode == DEAD, n)


@flax.struct.dataclass
class BeamState:
  """The search's loop state: b sentences, k hypotheses each, L steps at most. (Fields in the order of
  the dict this state was, so that the compiled loop is the same program.)"""
  alive_logp: jax.Array   # float32 [b, k], the live hypotheses' log-probabilities, best first (NEG_INF: none)
  alive_seq: jax.Array    # int32 [b, k, L], their tokens, 0 past step
  cache: Any              # the callback's cache, every array leaf [b * k, ...]
  done_score: jax.Array   # float32 [b, k], the finished hypotheses' length-penalized scores, best first
  done_seq: jax.Array     # int32 [b, k, L], their tokens, eos included
  finished: jax.Array     # bool [b], whether the sentence's search has stopped
  last: jax.Array         # int32 [b * k], every live hypothesis's last token (bos_id at first)
  step: jax.Array         # int32 [], the position every hypothesis extends next


def beam_search(tokens_to_logits, cache, *, batch_size, beam_size, max_len, eos_id, bos_id, alpha=0.6,
                min_len=0, max_steps=None, reorder=None, repetition_penalty=1.0, extensions=None):
  """Returns (sequences int32 [b, k, L], scores float32 [b, k]), best first.

  max_len: an int, or int32 [b] per-sentence limits on the generated length (eos included); L is its
  maximum (or max_steps when max_len is traced). min_len: eos is not allowed before min_len tokens
  (except at a sentence's limit, where only eos is). reorder: see the module docstring (default: gather
  every leaf by parent row). repetition_penalty: as in decode/sampling.py (CTRL's), applied to each
  hypothesis's logits for the tokens it has generated; 1.0 is off. extensions: how a step picks its
  candidates, a function with select_extensions' signature and results (model/ops.py's
  Decoding.extensions, a backend's); None is select_extensions.
  sequences hold the generated tokens (bos excluded, eos included, 0 after it). A sentence whose search
  found fewer than k finished hypotheses (a tiny vocabulary) fills the rest with score NEG_INF.
  """
  b, k = int(batch_size), int(beam_size)
  steps = static_len(max_len, max_steps)
  if k < 1 or steps < 1:
    raise ValueError(f"beam_search: need beam_size >= 1 and max_len >= 1 (got {k}, {steps})")
  if reorder is None:
    reorder = gather_rows
  if extensions is None:
    extensions = select_extensions
  limits = jnp.broadcast_to(jnp.asarray(max_len, jnp.int32), (b,))
  limits = jnp.minimum(limits, steps)
  # The best penalty a live hypothesis can still reach: the largest one up to its sentence's limit.
  best_penalty = (length_penalty(limits, alpha) if alpha >= 0 else jnp.ones((b,)))

  state = BeamState(
      step=jnp.zeros((), jnp.int32),
      cache=tile_beams(cache, k),
      last=jnp.full((b * k,), bos_id, jnp.int32),
      alive_seq=jnp.zeros((b, k, steps), jnp.int32),
      # Only the first hypothesis of a sentence is live at the start, so the k beams do not repeat it.
      alive_logp=jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (b, 1)),
      done_seq=jnp.zeros((b, k, steps), jnp.int32),
      done_score=jnp.full((b, k), NEG_INF, jnp.float32),
      finished=jnp.zeros((b,), bool),
  )

  def cond(s: BeamState):
    return (s.step < steps) & ~jnp.all(s.finished)

  def body(s: BeamState) -> BeamState:
    i = s.step
    logits, cache = tokens_to_logits(s.last, s.cache)
    if repetition_penalty != 1.0:
      logits = apply_repetition_penalty(logits.astype(jnp.float32), s.alive_seq.reshape(b * k, steps),
                                        i, repetition_penalty)
    vocab = logits.shape[-1]
    # A finished sentence (or one past its limit) extends nothing; at its limit it may only end; the
    # limit wins over min_len, so every hypothesis ends in eos.
    mode = jnp.where(s.finished | (i >= limits), DEAD,
                     jnp.where(i + 1 >= limits, ONLY_EOS, jnp.where(i < min_len, NO_EOS, FREE)))
    n_cand = min(2 * k, k * vocab)
    cand_logp, cand_idx = extensions(logits.astype(jnp.float32).reshape(b, k, vocab), s.alive_logp,
                                     mode, n_cand, eos_id)                     # [b, 2k], best first
    parent, token = cand_idx // vocab, (cand_idx % vocab).astype(jnp.int32)
    cand_eos = token == eos_id
    cand_seq = jnp.take_along_axis(s.alive_seq, parent[:, :, None], axis=1)
    cand_seq = cand_seq.at[:, :, i].set(token)

    # Finished: eos among the first k candidates, scored with the length penalty, merged by score.
    first_k = jnp.arange(n_cand) < k
    new_done = jnp.where(cand_eos & first_k & (cand_logp > NEG_INF / 2),
                         cand_logp / length_penalty(i + 1, alpha), NEG_INF)
    all_score = jnp.concatenate([s.done_score, new_done], axis=1)
    all_seq = jnp.concatenate([s.done_seq, cand_seq], axis=1)
    done_score, pick = jax.lax.top_k(all_score, k)
    done_seq = jnp.take_along_axis(all_seq, pick[:, :, None], axis=1)

    # Live: the k best candidates that do not end in eos.
    live_logp = jnp.where(cand_eos, NEG_INF, cand_logp)
    alive_logp, pick = jax.lax.top_k(live_logp, k)
    alive_parent = jnp.take_along_axis(parent, pick, axis=1)   # [b, k]
    alive_token = jnp.take_along_axis(token, pick, axis=1)
    alive_seq = jnp.take_along_axis(cand_seq, pick[:, :, None], axis=1)
    rows = (jnp.arange(b)[:, None] * k + alive_parent).reshape(b * k)
    cache = reorder(cache, rows)

    # Stop a sentence when its best live hypothesis cannot beat its k-th finished one.
    bound = alive_logp[:, 0] / best_penalty
    finished = (s.finished | (done_score[:, -1] >= bound) | (i + 1 >= limits)
                | (alive_logp[:, 0] <= NEG_INF / 2))
    return BeamState(step=i + 1, cache=cache, last=alive_token.reshape(b * k), alive_seq=alive_seq,
                     alive_logp=alive_logp, done_seq=done_seq, done_score=done_score, finished=finished)

  out = jax.lax.while_loop(cond, body, state)
  return out.done_seq, out.done_score
