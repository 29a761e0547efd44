"""Sampling and greedy decoding against python loops, known distributions and scripted fake models."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode.sampling import greedy, sample
from kernels import cpu_decoding

BOS, EOS = 1, 2


class Markov:
  """Logits table[row, prev]: every row of the batch is its own Markov chain over the vocabulary.

  The cache holds each row's chain id and counts the calls; `log`, when given, records (call, ids) of every
  call made by the compiled loop.
  """

  def __init__(self, table, log=None):
    self.table = jnp.asarray(table, jnp.float32)   # [chains, vocab, vocab]
    self.log = log

  @classmethod
  def random(cls, chains, vocab, seed=0, eos_bias=0.0, **kw):
    table = np.random.default_rng(seed).normal(scale=2.0, size=(chains, vocab, vocab)).astype(np.float32)
    table[:, :, EOS] += eos_bias
    return cls(table, **kw)

  def init_cache(self, chains):
    chains = jnp.asarray(chains, jnp.int32)
    return {"chain": chains, "calls": jnp.zeros_like(chains)}

  def __call__(self, ids, cache):
    if self.log is not None:
      jax.debug.callback(lambda c, i: self.log.append((int(c[0]), np.asarray(i))), cache["calls"], ids)
    return self.table[cache["chain"], ids], {"chain": cache["chain"], "calls": cache["calls"] + 1}


class Scripted:
  """Logits fixed by the step alone: table[step], whatever was generated."""

  def __init__(self, table):
    self.table = jnp.asarray(table, jnp.float32)   # [steps, vocab]

  def __call__(self, ids, cache):
    return jnp.broadcast_to(self.table[cache], (ids.shape[0], self.table.shape[1])), cache + 1


def _key(seed):
  # XLA compiles threefry inside the loop 2-3x slower than rbg; the determinism test keeps the default.
  return jax.random.key(seed, impl="rbg")


def _run(fn, model, cache, *args, **kw):
  b = jax.tree_util.tree_leaves(cache)[0].shape[0]
  out = jax.jit(lambda c, *a: fn(model, c, *a, batch_size=b, eos_id=EOS, bos_id=BOS, **kw))(cache, *args)
  seqs, scores = jax.device_get(out)
  return np.asarray(seqs), np.asarray(scores)


def _lengths(seqs):
  """Tokens up to and including the first eos of every row (token 0 is a real token here)."""
  return np.array([list(q).index(EOS) + 1 for q in seqs])


def _check_rows(seqs, limits, min_len=0):
  """Every row ends in eos within its limit, not before min_len tokens (unless forced), zeros after."""
  lengths = _lengths(seqs)
  limits = np.broadcast_to(limits, lengths.shape)
  assert np.all(lengths <= limits)
  assert np.all(lengths >= np.minimum(min_len + 1, limits))
  for q, n in zip(seqs, lengths):
    assert np.all(q[n:] == 0)
  return lengths


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  return x - x.max() - np.log(np.exp(x - x.max()).sum())


def _logprob(model, chain, tokens):
  prev, total = BOS, 0.0
  for t in tokens:
    total += _log_softmax(model.table[chain, prev])[t]
    prev = t
  return total


def _python_greedy(model, chain, limit, min_len):
  prev, out = BOS, []
  for i in range(limit):
    logits = np.array(model.table[chain, prev], np.float64)
    if i < min_len:
      logits[EOS] = -np.inf
    if i == limit - 1:                                   # forced eos wins over min_len
      logits = np.where(np.arange(logits.size) == EOS, 0.0, -np.inf)
    prev = int(np.argmax(logits))
    out.append(prev)
    if prev == EOS:
      break
  return out


def _extensions(name):
  """None (the XLA ops) or "cpu": kernels/cpu_decoding.py's custom call, which greedy uses on the CPU."""
  if name is None:
    return None
  if not cpu_decoding.available():
    pytest.skip("no C++ compiler (c++, g++ or $CXX): decoding uses XLA ops")
  return cpu_decoding.beam_extensions


@pytest.mark.parametrize("extensions", [None, "cpu"])
@pytest.mark.parametrize("min_len", [0, 3])
def test_greedy_equals_a_python_argmax_loop_with_per_row_limits(min_len, extensions):
  model = Markov.random(8, 10, seed=1, eos_bias=1.0)
  limits = np.array([1, 2, 5, 12, 12, 12, 7, 12], np.int32)
  seqs, scores = _run(greedy, model, model.init_cache(np.arange(8)), max_len=limits, min_len=min_len,
                      extensions=_extensions(extensions))
  assert seqs.shape == (8, 12)
  lengths = _check_rows(seqs, limits, min_len)
  assert np.any(lengths < limits), "some rows should end by choice, not by the limit"
  for r in range(8):
    expected = _python_greedy(model, r, int(limits[r]), min_len)
    assert list(seqs[r, :lengths[r]]) == expected
    np.testing.assert_allclose(scores[r], _logprob(model, r, expected), rtol=1e-5, atol=1e-5)


def test_settings_that_leave_one_token_equal_greedy():
  model = Markov.random(6, 9, seed=2, eos_bias=-1.0)
  cache = model.init_cache(np.arange(6))
  expected = _run(greedy, model, cache, max_len=10, min_len=1)
  for kw in [dict(temperature=0.0), dict(top_k=1), dict(top_k=1, temperature=3.0), dict(top_p=1e-3)]:
    got = _run(sample, model, cache, _key(5), max_len=10, min_len=1, **kw)
    np.testing.assert_array_equal(got[0], expected[0], err_msg=str(kw))
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-6, err_msg=str(kw))


def test_scores_are_raw_model_log_probs_of_the_returned_tokens_whatever_the_filters():
  model = Markov.random(4, 12, seed=3, eos_bias=0.5)
  chains = np.arange(32) % 4
  limits = np.arange(32) % 9 + 3
  seqs, scores = _run(sample, model, model.init_cache(chains), _key(0), max_len=limits,
                      min_len=2, temperature=1.5, top_k=6, top_p=0.9, repetition_penalty=1.3)
  lengths = _check_rows(seqs, limits, min_len=2)
  assert len(set(lengths)) > 3
  for r in range(32):
    np.testing.assert_allclose(scores[r], _logprob(model, chains[r], seqs[r, :lengths[r]]), rtol=1e-5,
                               atol=1e-5)


def test_eos_is_forced_at_each_rows_max_len():
  model = Markov.random(3, 8, seed=4, eos_bias=-30.0)    # eos is never chosen freely
  limits = np.array([1, 4, 9, 6, 2, 9], np.int32)
  seqs, _ = _run(sample, model, model.init_cache(np.arange(6) % 3), _key(1), max_len=limits)
  np.testing.assert_array_equal(_check_rows(seqs, limits), limits)


def test_min_len_holds_eos_back_but_the_limit_still_forces_it():
  model = Markov.random(3, 8, seed=5, eos_bias=30.0)     # eos is always chosen when allowed
  limits = np.array([2, 4, 5, 9, 9, 3], np.int32)
  seqs, _ = _run(sample, model, model.init_cache(np.arange(6) % 3), _key(2), max_len=limits,
                 min_len=3)
  np.testing.assert_array_equal(_lengths(seqs), np.minimum(limits, 4))
  for extensions in (None, "cpu"):
    seqs, _ = _run(greedy, model, model.init_cache(np.arange(6) % 3), max_len=limits, min_len=3,
                   extensions=_extensions(extensions))
    np.testing.assert_array_equal(_lengths(seqs), np.minimum(limits, 4))
    seqs, _ = _run(greedy, model, model.init_cache(np.arange(6) % 3), max_len=limits,
                   extensions=_extensions(extensions))
    np.testing.assert_array_equal(_lengths(seqs), np.ones(6))


def test_the_loop_stops_once_every_row_ended_and_feeds_eos_to_finished_rows():
  log = []
  model = Markov.random(4, 8, seed=6, eos_bias=2.0, log=log)
  seqs, _ = _run(sample, model, model.init_cache(np.arange(16) % 4), _key(3), max_len=50)
  lengths = _check_rows(seqs, 50)
  assert max(lengths) < 50 and len(set(lengths)) > 1
  assert sorted(c for c, _ in log) == list(range(max(lengths))), "one call per step, no more"
  for call, ids in log:
    fed = seqs[:, call - 1] if call > 0 else np.full(16, BOS)
    fed = np.where(call > lengths, EOS, fed)
    np.testing.assert_array_equal(ids, fed)


# One step of a known distribution: the first token is drawn from P, then eos follows with certainty.
P = {0: 0.40, 3: 0.25, 4: 0.15, 5: 0.10, 6: 0.06, 7: 0.04}


def _first_step_model():
  table = np.full((1, 8, 8), -40.0, np.float32)
  table[0, :, EOS] = 0.0
  table[0, BOS, EOS] = -40.0
  for t, p in P.items():
    table[0, BOS, t] = np.log(p)
  return Markov(table)


def _first_tokens(n, rng, **kw):
  model = _first_step_model()
  seqs, _ = _run(sample, model, model.init_cache(np.zeros(n)), rng, max_len=2, **kw)
  assert np.all(seqs[:, 1] == EOS)
  return seqs[:, 0]


def _chi_square(tokens, expected):
  """Pearson's statistic of token counts against `expected` {token: probability}; off-support is fatal."""
  counts = {t: int(np.sum(tokens == t)) for t in np.unique(tokens)}
  assert set(counts) <= set(expected), f"sampled outside the support: {set(counts) - set(expected)}"
  n = len(tokens)
  return sum((counts.get(t, 0) - n * q) ** 2 / (n * q) for t, q in expected.items())


def _expected(support, temperature=1.0):
  q = np.array([P[t] for t in support]) ** (1.0 / temperature)
  return dict(zip(support, q / q.sum()))


# 0.1% critical value of chi-square with 5 degrees of freedom (6 tokens at most).
CHI2 = 20.5


def test_frequencies_follow_the_model_and_higher_temperature_flattens_them():
  entropies = []
  for temperature in (0.5, 1.0, 2.0):
    tokens = _first_tokens(3000, _key(8), temperature=temperature)
    assert _chi_square(tokens, _expected(list(P), temperature)) < CHI2, temperature
    f = np.bincount(tokens, minlength=8) / len(tokens)
    entropies.append(-np.sum(f[f > 0] * np.log(f[f > 0])))
  assert entropies[0] < entropies[1] < entropies[2]


@pytest.mark.parametrize("temperature,top_k,top_p,support", [
    (1.0, 2, 1.0, [0, 3]),
    (1.0, 0, 0.75, [0, 3, 4]),     # 0.40, 0.65, 0.80: the third token reaches 0.75
    (2.0, 0, 0.6, [0, 3, 4]),      # temperature first: p**0.5 normalised is 0.28, 0.22, 0.17 (at 1: 0, 3)
    (1.0, 3, 0.7, [0, 3]),         # top-k first: renormalised over 3 tokens, 0.50 + 0.31 reaches 0.7
])
def test_top_k_and_top_p_sample_the_renormalised_survivors(temperature, top_k, top_p, support):
  tokens = _first_tokens(3000, _key(7), temperature=temperature, top_k=top_k, top_p=top_p)
  assert _chi_square(tokens, _expected(support, temperature)) < CHI2
  assert set(np.unique(tokens)) == set(support)


def test_top_k_never_samples_outside_the_k_most_probable():
  model = Markov.random(8, 12, seed=9, eos_bias=-2.0)
  chains = np.arange(256) % 8
  seqs, _ = _run(sample, model, model.init_cache(chains), _key(9), max_len=8, top_k=3)
  lengths = _check_rows(seqs, 8)
  table = np.asarray(model.table)
  ranks = []
  for r in range(256):
    prev = BOS
    for t in seqs[r, :lengths[r]][:7]:                   # the last position, 7, is forced eos
      ranks.append(int(np.sum(table[chains[r], prev] > table[chains[r], prev, t])))
      prev = t
  assert max(ranks) == 2 and min(ranks) == 0


def test_repetition_penalty_stops_a_greedy_model_that_repeats():
  vocab = 10
  table = np.random.default_rng(10).uniform(1.0, 2.0, size=(4, vocab, vocab)).astype(np.float32)
  table[:, np.arange(vocab), np.arange(vocab)] += 4.0   # the previous token again, by far
  table[:, :, EOS] = -5.0
  model = Markov(table)
  cache = model.init_cache(np.arange(4))
  seqs, _ = _run(greedy, model, cache, max_len=8)
  assert np.all(seqs[:, 1:7] == seqs[:, :1])
  seqs, _ = _run(greedy, model, cache, max_len=8, repetition_penalty=10.0)
  for q in seqs:
    assert len(set(q[:7])) == 7 and q[7] == EOS


def test_repetition_penalty_is_once_per_distinct_token_for_both_signs_and_spares_bos():
  a, b, c, d = 3, 4, 5, 6
  steps = [{a: 4.0, b: 1.0},
           {a: 10.0, b: 1.0},      # a again even when penalised: 5 > 1
           {a: 3.0, b: 1.0},       # a seen twice: 3 / 2 = 1.5 > 1 once per token; 0.75 per occurrence
           {a: 3.0, b: 2.5},       # penalised, a loses: 1.5 < 2.5
           {a: -1.0, c: -1.5},     # negative logits are multiplied: -2 < -1.5
           {BOS: 2.0, d: 1.5},     # bos is not among the generated tokens
           {}]
  table = np.full((len(steps), 8), -5.0, np.float32)
  for i, logits in enumerate(steps):
    for t, v in logits.items():
      table[i, t] = v
  cache = jnp.zeros((2,), jnp.int32)
  seqs, _ = _run(greedy, Scripted(table), cache, max_len=7, repetition_penalty=2.0)
  np.testing.assert_array_equal(seqs, [[a, a, a, b, c, BOS, EOS]] * 2)
  seqs, _ = _run(greedy, Scripted(table), cache, max_len=7)
  np.testing.assert_array_equal(seqs, [[a, a, a, a, a, BOS, EOS]] * 2)


def test_the_same_rng_repeats_itself_and_another_rng_does_not():
  model = Markov.random(4, 10, seed=11, eos_bias=-1.0)
  cache = model.init_cache(np.arange(32) % 4)
  run = jax.jit(lambda r: sample(model, cache, r, batch_size=32, max_len=10, eos_id=EOS, bos_id=BOS))
  first, again, other = (jax.device_get(run(jax.random.key(k))) for k in (12, 12, 13))   # threefry
  np.testing.assert_array_equal(first[0], again[0])
  np.testing.assert_array_equal(first[1], again[1])
  assert not np.array_equal(first[0], other[0])


def test_per_row_keys_make_a_rows_samples_independent_of_its_batch():
  """With a key per row, a row draws the same tokens alone, in any batch, at any position in it."""
  model = Markov.random(4, 10, seed=14, eos_bias=-1.0)
  # threefry, translate()'s: rbg draws other bits for a row when it is vmapped in a batch than alone.
  keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(5), jnp.arange(8))   # [8]

  def run(rows):
    rows = np.asarray(rows)
    fn = lambda c, k: sample(model, c, k, batch_size=len(rows), max_len=10, eos_id=EOS, bos_id=BOS)
    return tuple(np.asarray(x) for x in jax.device_get(jax.jit(fn)(model.init_cache(rows % 4), keys[rows])))

  together = run(np.arange(8))
  for rows in ([3], [5, 2], [7, 6, 5, 4, 3, 2, 1, 0]):
    seqs, scores = run(rows)
    np.testing.assert_array_equal(seqs, together[0][rows])
    np.testing.assert_allclose(scores, together[1][rows], rtol=1e-6)
  assert len({tuple(row) for row in together[0]}) > 4          # the rows' keys differ, and so do samples
  with pytest.raises(ValueError, match="one per row"):
    sample(model, model.init_cache(np.arange(3)), keys[:2], batch_size=3, max_len=4, eos_id=EOS, bos_id=BOS)


def test_traced_max_len_needs_max_steps():
  model = Markov.random(2, 6, seed=12, eos_bias=-30.0)
  cache, limits = model.init_cache([0, 1]), jnp.array([3, 5], jnp.int32)
  with pytest.raises(ValueError, match="max_steps"):
    jax.jit(lambda c, m: greedy(model, c, batch_size=2, max_len=m, eos_id=EOS, bos_id=BOS))(cache, limits)
  seqs, _ = jax.jit(lambda c, m: greedy(model, c, batch_size=2, max_len=m, max_steps=7, eos_id=EOS,
                                        bos_id=BOS))(cache, limits)
  assert seqs.shape == (2, 7)
  np.testing.assert_array_equal(_lengths(np.asarray(seqs)), [3, 5])


def test_bad_settings_fail_with_a_message():
  model = Markov.random(1, 6)
  cache = model.init_cache([0])
  with pytest.raises(ValueError, match="needs an rng"):
    sample(model, cache, None, batch_size=1, max_len=4, eos_id=EOS, bos_id=BOS)
  with pytest.raises(ValueError, match="top_p"):
    sample(model, cache, _key(0), batch_size=1, max_len=4, eos_id=EOS, bos_id=BOS, top_p=0.0)


def test_first_argmax_is_argmax_with_ties_and_masked_logits():
  from decode.sampling import first_argmax
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 50)).astype(np.float32)
  x[3, [7, 20, 41]] = 9.0                        # a tie: the first index wins, as in argmax
  x[5, :] = -np.inf                              # everything masked
  x[6, :] = -np.inf
  x[6, 33] = -2.0                                # one survivor
  x[7, :] = 1.5                                  # all equal
  x = jnp.asarray(x)
  np.testing.assert_array_equal(jax.jit(first_argmax)(x), jnp.argmax(x, axis=-1))
  assert int(first_argmax(x)[3]) == 7 and int(first_argmax(x)[6]) == 33
