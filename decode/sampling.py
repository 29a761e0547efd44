"""Sampling and greedy decoding as one `jax.lax.while_loop`, with the beam search's callback contract.

    sequences, scores = sample(tokens_to_logits, cache, rng, batch_size=b, max_len=l, eos_id=3, bos_id=2,
                               temperature=0.8, top_k=40, top_p=0.95)
    sequences, scores = greedy(tokens_to_logits, cache, batch_size=b, max_len=l, eos_id=3, bos_id=2)

`tokens_to_logits(ids, cache) -> (logits, cache)` gets the last token of every row, int32 [b] (bos_id on
the first call, eos_id once a row has finished), and returns logits [b, vocab] and the cache, a pytree
whose array leaves keep leading dimension b.

Every step turns the raw logits into a token in this order:
  1. repetition penalty (CTRL, Keskar et al. 2019): the logit of a token the row has already generated
     (bos excluded) is divided by the penalty if positive and multiplied by it if negative, once per
     distinct token;
  2. eos masking: no eos before min_len tokens; nothing but eos at a row's last position, max_len - 1;
  3. temperature (0 takes the argmax, which no later filter changes);
  4. top-k: only the k largest logits survive;
  5. top-p (nucleus): only the smallest set of most probable tokens whose mass reaches top_p survives;
  6. `jax.random.categorical`, with the step folded into rng: one key for the batch, or a key per row
     (keys [b]), so that a row's samples depend on its own key alone and not on the batch it is in.

Returns sequences int32 [b, L] (generated tokens, bos excluded, eos included, 0 after it; every row ends in
eos) and scores float32 [b]: the sum of the chosen tokens' log-probabilities under the model's own
distribution (log_softmax of the raw logits), whatever filtering chose them. The loop stops as soon as every
row has finished. The sampling settings are Python numbers (static under jit).
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from decode.beam_search import FREE, NO_EOS, ONLY_EOS, apply_repetition_penalty, static_len


def first_argmax(x):
  """jnp.argmax(x, axis=-1) for float [b, vocab] without NaN: the first index holding the row's maximum.

  A max and a min over indices vectorize where XLA's CPU argmax (a reduce over (value, index) pairs)
  does not, so it is the faster of the two on a decoding step's few rows.
  """
  top = jnp.max(x, axis=-1, keepdims=True)
  vocab = x.shape[-1]
  return jnp.min(jnp.where(x == top, jnp.arange(vocab, dtype=jnp.int32), vocab - 1), axis=-1)


def top_k_filter(logits, k):
  """Keeps the k largest logits of every row (exactly k, ties broken by index); the rest become -inf."""
  b, vocab = logits.shape
  if k <= 0 or k >= vocab:
    return logits
  _, idx = jax.lax.top_k(logits, k)                                # [b, k]
  keep = jnp.zeros((b, vocab), bool).at[jnp.arange(b)[:, None], idx].set(True)
  return jnp.where(keep, logits, -jnp.inf)


def top_p_filter(logits, p):
  """Keeps the smallest set of most probable tokens whose probability reaches p (at least one)."""
  if p >= 1.0:
    return logits
  b, _ = logits.shape
  order = jnp.argsort(logits, axis=-1, descending=True)           # [b, vocab], most probable first
  probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
  # A token is in the nucleus when the mass before it has not reached p yet; the first one always is.
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep_sorted = (mass_before < p).at[:, 0].set(True)
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(b)[:, None], order].set(keep_sorted)
  return jnp.where(keep, logits, -jnp.inf)


@flax.struct.dataclass
class SampleState:
  """The sampling loop's state: b rows, L steps at most. (Fields in the order of the dict this state
  was, so that the compiled loop is the same program.)"""
  cache: Any         # the callback's cache, every array leaf [b, ...]
  done: jax.Array    # bool [b], whether the row has produced eos
  last: jax.Array    # int32 [b], the token fed to the next call (bos_id at first, eos_id once done)
  score: jax.Array   # float32 [b], the sum of the generated tokens' log-probabilities
  seq: jax.Array     # int32 [b, L], the generated tokens, 0 after eos
  step: jax.Array    # int32 [], the position every row generates next


def sample(tokens_to_logits, cache, rng, *, batch_size, max_len, eos_id, bos_id, temperature=1.0, top_k=0,
           top_p=1.0, repetition_penalty=1.0, min_len=0, max_steps=None, extensions=None):
  """Returns (sequences int32 [b, L], scores float32 [b]); see the module docstring.

  max_len: an int, or int32 [b] per-row limits on the generated length (eos included, values below 1 count
  as 1); L is its maximum, or max_steps when max_len is traced. min_len: eos is not allowed before min_len
  tokens (the forced eos at max_len wins). temperature 0 is greedy and needs no rng. top_k 0 and top_p 1.0
  are off; repetition_penalty 1.0 is off. extensions: a function with the signature of
  decode.beam_search.select_extensions (model/ops.py's Decoding.extensions, a backend's); given,
  greedy decoding without a repetition penalty takes each step's token and its log-probability from it,
  one hypothesis per row, instead of from the XLA ops below (the same token: the first maximum).
  rng: a key (jax.random.key) for the batch, or keys [b], one per row.
  """
  b = int(batch_size)
  steps = static_len(max_len, max_steps, who="sample")
  if steps < 1:
    raise ValueError(f"sample: need max_len >= 1 (got {steps})")
  if temperature < 0 or top_k < 0 or not 0 < top_p <= 1 or repetition_penalty <= 0:
    raise ValueError(f"sample: need temperature >= 0, top_k >= 0, 0 < top_p <= 1 and repetition_penalty > 0 "
                     f"(got {temperature}, {top_k}, {top_p}, {repetition_penalty})")
  if temperature > 0 and rng is None:
    raise ValueError("sample: temperature > 0 needs an rng; use greedy() or temperature=0 for argmax")
  if rng is not None and jnp.shape(rng) not in ((), (b,)):
    raise ValueError(f"sample: rng must be one key or {b} keys, one per row (got shape {jnp.shape(rng)})")
  limits = jnp.clip(jnp.broadcast_to(jnp.asarray(max_len, jnp.int32), (b,)), 1, steps)

  state = SampleState(step=jnp.zeros((), jnp.int32), cache=cache, last=jnp.full((b,), bos_id, jnp.int32),
                      seq=jnp.zeros((b, steps), jnp.int32), score=jnp.zeros((b,), jnp.float32),
                      done=jnp.zeros((b,), bool))

  def cond(s: SampleState):
    return (s.step < steps) & ~jnp.all(s.done)

  def body(s: SampleState) -> SampleState:
    i = s.step
    logits, cache = tokens_to_logits(s.last, s.cache)
    logits = logits.astype(jnp.float32)                          # [b, vocab]
    if temperature == 0 and repetition_penalty == 1.0 and extensions is not None:
      mode = jnp.where(i + 1 >= limits, ONLY_EOS, jnp.where(i < min_len, NO_EOS, FREE))   # [b]
      values, index = extensions(logits[:, None], jnp.zeros((b, 1), jnp.float32), mode, 1, eos_id)
      return advance(s, cache, index[:, 0], values[:, 0])
    logp = jax.nn.log_softmax(logits, axis=-1)                   # the score is under the raw model
    if repetition_penalty != 1.0:
      logits = apply_repetition_penalty(logits, s.seq, i, repetition_penalty)
    is_eos = jnp.arange(logits.shape[-1]) == eos_id              # [vocab]
    at_limit = (i + 1 >= limits)[:, None]                        # [b, 1]
    logits = jnp.where((i < min_len) & ~at_limit & is_eos, -jnp.inf, logits)
    logits = jnp.where(at_limit & ~is_eos, -jnp.inf, logits)
    if temperature == 0:
      token = first_argmax(logits)
    else:
      logits = top_p_filter(top_k_filter(logits / temperature, top_k), top_p)
      token = draw(rng, i, logits)
    token_logp = jnp.take_along_axis(logp, token[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return advance(s, cache, token, token_logp)

  def advance(s: SampleState, cache, token, token_logp) -> SampleState:
    """The state after appending token int32 [b], of log-probability token_logp [b], to every row."""
    i = s.step
    token = jnp.where(s.done, 0, token.astype(jnp.int32))        # [b]
    done = s.done | (token == eos_id)
    return SampleState(step=i + 1, cache=cache, last=jnp.where(done, eos_id, token),
                       seq=s.seq.at[:, i].set(token), score=s.score + jnp.where(s.done, 0.0, token_logp),
                       done=done)

  def draw(rng, i, logits):
    """Tokens int32 [b] from logits [b, vocab], with the step i folded into the batch's or each row's key."""
    if jnp.ndim(rng) == 0:
      return jax.random.categorical(jax.random.fold_in(rng, i), logits, axis=-1)
    return jax.vmap(lambda key, row: jax.random.categorical(jax.random.fold_in(key, i), row))(rng, logits)

  out = jax.lax.while_loop(cond, body, state)
  return out.seq, out.score


def greedy(tokens_to_logits, cache, *, batch_size, max_len, eos_id, bos_id, min_len=0, repetition_penalty=1.0,
           max_steps=None, extensions=None):
  """`sample` at temperature 0: the argmax at every step, no rng. Returns (sequences [b, L], scores [b])."""
  return sample(tokens_to_logits, cache, None, batch_size=batch_size, max_len=max_len, eos_id=eos_id,
                bos_id=bos_id, temperature=0.0, min_len=min_len, repetition_penalty=repetition_penalty,
                max_steps=max_steps, extensions=extensions)
