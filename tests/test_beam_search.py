"""Beam search against exhaustive enumeration, greedy, rescoring and one-by-one decoding (fake models)."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decode.beam_search import NEG_INF, beam_search, length_penalty
from kernels.beam_top_k import CHUNK, top_extensions

BOS, EOS = 1, 2


class PrefixModel:
  """Logits that depend on the whole prefix and on the sentence, through per-row state in the cache.

  The cache holds a hash of (sentence, prefix) per row: correct results need the search to tile and
  reorder it by parent hypothesis.
  """

  def __init__(self, vocab, seed=0, table_size=997, eos_bias=0.0):
    self.vocab = vocab
    table = np.random.default_rng(seed).normal(scale=2.0, size=(table_size, vocab)).astype(np.float32)
    table[:, EOS] += eos_bias
    self.table = jnp.asarray(table)

  def init_cache(self, sentence_ids):
    return {"h": jnp.asarray(sentence_ids, jnp.int32) * 7919 + 17}

  def __call__(self, ids, cache):
    h = (cache["h"] * 31 + ids * 101 + 3) % self.table.shape[0]
    return self.table[h], {"h": h}

  def logprob(self, sentence_id, tokens):
    """Sum of log-probabilities of `tokens` (a list ending in eos) for one sentence, in numpy."""
    h, last, total = sentence_id * 7919 + 17, BOS, 0.0
    for t in tokens:
      h = (h * 31 + last * 101 + 3) % self.table.shape[0]
      total += float(jax.nn.log_softmax(self.table[h])[t])
      last = t
    return total


def _search(model, sentence_ids, **kw):
  b = len(sentence_ids)
  fn = jax.jit(lambda cache: beam_search(model, cache, batch_size=b, eos_id=EOS, bos_id=BOS, **kw))
  seqs, scores = jax.device_get(fn(model.init_cache(sentence_ids)))
  return np.asarray(seqs), np.asarray(scores)


def _strip(seq):
  """Generated tokens up to and including eos (token 0 is a real token in these fake vocabularies)."""
  seq = list(map(int, seq))
  return tuple(seq[:seq.index(EOS) + 1]) if EOS in seq else tuple(seq)


def _exhaustive(model, sentence_id, vocab, max_len, alpha, min_len=0):
  """Every hypothesis (non-eos tokens then eos, at most max_len tokens) with its score, best first."""
  others = [t for t in range(vocab) if t != EOS]
  out = []
  for n in range(1 + min_len, max_len + 1):
    for body in itertools.product(others, repeat=n - 1):
      tokens = list(body) + [EOS]
      out.append((model.logprob(sentence_id, tokens) / float(length_penalty(n, alpha)), tuple(tokens)))
  return sorted(out, key=lambda x: -x[0])


@pytest.mark.parametrize("alpha,min_len", [(0.0, 0), (0.6, 0), (1.0, 2)])
def test_a_beam_holding_every_hypothesis_returns_the_exhaustive_top_k(alpha, min_len):
  vocab, max_len, k = 3, 5, 32        # at most 2**4 live hypotheses, 48 extensions: the beam holds all
  model = PrefixModel(vocab, seed=1)
  seqs, scores = _search(model, [0, 1], beam_size=k, max_len=max_len, alpha=alpha, min_len=min_len)
  for b in range(2):
    expected = _exhaustive(model, b, vocab, max_len, alpha, min_len)
    got = [(s, _strip(q)) for s, q in zip(scores[b], seqs[b]) if s > -1e8]
    assert len(got) == len(expected) == sum(2 ** (n - 1) for n in range(1 + min_len, max_len + 1))
    assert [q for _, q in got] == [q for _, q in expected]
    np.testing.assert_allclose([s for s, _ in got], [s for s, _ in expected], rtol=1e-5, atol=1e-5)


def test_top_k_of_a_narrower_beam_are_the_exhaustive_best_when_the_beam_cannot_miss_them():
  # Beam 16 over max_len 4 (15 hypotheses): holds every live hypothesis, so its top 5 are the true top 5.
  model = PrefixModel(3, seed=4)
  seqs, scores = _search(model, [3], beam_size=16, max_len=4, alpha=0.6)
  expected = _exhaustive(model, 3, 3, 4, 0.6)[:5]
  assert [_strip(q) for q in seqs[0][:5]] == [q for _, q in expected]


def _greedy(model, sentence_id, max_len, vocab):
  h, last, out = sentence_id * 7919 + 17, BOS, []
  for i in range(max_len):
    h = (h * 31 + last * 101 + 3) % model.table.shape[0]
    logits = np.array(model.table[h])
    if i == max_len - 1:
      logits[np.arange(vocab) != EOS] = -np.inf
    last = int(np.argmax(logits))
    out.append(last)
    if last == EOS:
      break
  return tuple(out)


@pytest.mark.parametrize("vocab", [12, 20 * CHUNK + 5])   # the second prunes by chunks (top_extensions)
def test_beam_one_with_alpha_zero_is_greedy(vocab):
  model = PrefixModel(vocab, seed=2, eos_bias=-1.0)
  ids = list(range(8))
  seqs, _ = _search(model, ids, beam_size=1, max_len=20, alpha=0.0)
  for b in ids:
    assert _strip(seqs[b, 0]) == _greedy(model, b, 20, vocab)


@pytest.mark.parametrize("vocab", [10, 12 * CHUNK])
def test_returned_scores_equal_scores_recomputed_from_the_sequences(vocab):
  model = PrefixModel(vocab, seed=3, eos_bias=0.5)
  seqs, scores = _search(model, [0, 1, 2], beam_size=4, max_len=12, alpha=0.6)
  for b in range(3):
    assert np.all(np.diff(scores[b]) <= 1e-6), "best first"
    for j in range(4):
      tokens = _strip(seqs[b, j])
      assert tokens[-1] == EOS and all(t == 0 for t in seqs[b, j, len(tokens):])
      expected = model.logprob(b, list(tokens)) / float(length_penalty(len(tokens), 0.6))
      np.testing.assert_allclose(scores[b, j], expected, rtol=1e-5)


def test_a_batch_equals_its_sentences_decoded_one_by_one_with_per_sentence_limits():
  vocab = 9
  model = PrefixModel(vocab, seed=5, eos_bias=-0.5)
  ids, limits = [4, 5, 6], np.array([3, 9, 6], np.int32)
  seqs, scores = _search(model, ids, beam_size=3, max_len=limits, alpha=0.6)
  assert seqs.shape == (3, 3, 9)
  for b, sentence in enumerate(ids):
    one_seqs, one_scores = _search(model, [sentence], beam_size=3, max_len=int(limits[b]), alpha=0.6)
    np.testing.assert_allclose(scores[b], one_scores[0], rtol=1e-6)
    for j in range(3):
      assert _strip(seqs[b, j]) == _strip(one_seqs[0, j])
      assert len(_strip(seqs[b, j])) <= limits[b]


def test_min_len_and_forced_eos_at_max_len():
  model = PrefixModel(6, seed=6, eos_bias=4.0)     # eos is very likely from the first step
  seqs, _ = _search(model, [0, 1], beam_size=2, max_len=10, alpha=0.6, min_len=4)
  assert all(len(_strip(q)) >= 5 for q in seqs.reshape(-1, 10))
  model = PrefixModel(6, seed=6, eos_bias=-8.0)    # eos very unlikely: the limit forces it
  seqs, _ = _search(model, [0, 1], beam_size=2, max_len=7, alpha=0.6)
  assert all(_strip(q)[-1] == EOS and len(_strip(q)) == 7 for q in seqs.reshape(-1, 7))
  # min_len >= max_len (how benchmarks force exactly max_len tokens): the limit still ends them in eos.
  model = PrefixModel(6, seed=6, eos_bias=4.0)
  seqs, scores = _search(model, [0, 1], beam_size=2, max_len=5, alpha=0.6, min_len=5)
  assert np.all(scores > -1e8)
  assert all(len(_strip(q)) == 5 and _strip(q)[-1] == EOS for q in seqs.reshape(-1, 5))


def test_the_loop_stops_early_once_no_live_hypothesis_can_win():
  calls = []
  model = PrefixModel(6, seed=7, eos_bias=6.0)

  def counting(ids, cache):
    jax.debug.callback(lambda: calls.append(1))
    return model(ids, cache)

  seqs, _ = jax.device_get(beam_search(counting, model.init_cache([0, 1]), batch_size=2, beam_size=2,
                                       max_len=40, eos_id=EOS, bos_id=BOS, alpha=0.6))
  assert max(len(_strip(q)) for q in np.asarray(seqs).reshape(-1, 40)) < 10
  assert len(calls) < 12


def test_traced_max_len_needs_max_steps():
  model = PrefixModel(5)
  with pytest.raises(ValueError, match="max_steps"):
    jax.jit(lambda c, m: beam_search(model, c, batch_size=1, beam_size=2, max_len=m, eos_id=EOS,
                                     bos_id=BOS))(model.init_cache([0]), jnp.array([4]))
  seqs, _ = jax.jit(lambda c, m: beam_search(model, c, batch_size=1, beam_size=2, max_len=m, max_steps=6,
                                             eos_id=EOS, bos_id=BOS))(model.init_cache([0]), jnp.array([4]))
  assert seqs.shape == (1, 2, 6)


@pytest.mark.parametrize("beam_size", [2, 4])
def test_beam_slot_caches_search_exactly_like_gathered_caches(beam_size):
  """A Transformer's beam search with the CPU kernels' beam-slot caches, whose keys and values stay in
  their slots (kernels/decode_cache.py), finds the same hypotheses as the search with the reference
  cache (model/cache.py), which gathers the whole cache by parent at every step."""
  from model import Compute, Transformer, TransformerConfig, init_cache, reorder_cache
  reference = TransformerConfig(vocab_size=30, d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1,
                                num_decoder_layers=2, dropout_rate=0.0, max_len=32,
                                compute=Compute(kernels="reference"))
  rng = np.random.default_rng(3)
  src = jnp.asarray(rng.integers(4, 30, (3, 6)), jnp.int32).at[1, 3:].set(0)
  params = Transformer(reference).init({"params": jax.random.key(0)}, src, src)["params"]
  limits = jnp.array([9, 5, 12], jnp.int32)

  def search(cfg, beam_slots):
    model = Transformer(cfg)

    def run(params, src):
      variables = {"params": params}
      memory = model.apply(variables, model.apply(variables, src, method="encode"),
                           method="prepare_decoding")
      step = lambda ids, cache: model.apply(variables, ids, cache, memory, src != 0, method="decode_step")
      cache = init_cache(cfg, src.shape[0], 12, beam_slots=beam_slots)
      assert ("slot_history" in cache) == (cfg.compute.kernels == "cpu" and beam_slots)
      return beam_search(step, cache, batch_size=3, beam_size=beam_size, max_len=limits, eos_id=3,
                         bos_id=2, alpha=0.6, reorder=functools.partial(reorder_cache, cfg))
    return jax.device_get(jax.jit(run)(params, src))

  gathered_seqs, gathered_scores = search(reference, False)
  slot_seqs, slot_scores = search(reference.with_compute(kernels="cpu"), True)
  np.testing.assert_array_equal(slot_seqs, gathered_seqs)
  np.testing.assert_allclose(slot_scores, gathered_scores, atol=1e-4)
  assert len({tuple(q) for q in np.asarray(slot_seqs).reshape(-1, 12)}) > 3   # hypotheses do differ


@pytest.mark.parametrize("seed", range(6))
def test_pruned_top_extensions_equal_one_top_k_over_every_extension_ties_and_all(seed):
  # Scores on a coarse grid (many ties), dead hypotheses and sentences, vocabularies that are and are not
  # whole chunks: the flat indices and values must be jax.lax.top_k's, tie order included.
  rng = np.random.default_rng(seed)
  for vocab, chunk in [(1000, 32), (8000, 32), (257, 8), (100, 4), (37, 64)]:
    b, k = 3, int(rng.integers(1, 6))
    grid = [0.5, 1e-3, 0.0][seed % 3]
    logp = rng.standard_normal((b, k, vocab)).astype(np.float32)
    alive = (30 * rng.standard_normal((b, k))).astype(np.float32)
    if grid:
      logp, alive = np.round(logp / grid) * grid, np.round(alive / grid) * grid
    logp[rng.random(logp.shape) < 0.3] = NEG_INF
    alive[rng.random(alive.shape) < 0.3] = NEG_INF
    dead = np.array([False, True, rng.random() < 0.5])
    total = np.where(dead[:, None, None], NEG_INF, alive[:, :, None] + logp).reshape(b, k * vocab)
    want_values, want_idx = jax.lax.top_k(jnp.asarray(total), 2 * k)
    values, idx = jax.jit(top_extensions, static_argnums=(3, 4))(
        jnp.asarray(alive), jnp.asarray(logp), jnp.asarray(dead), 2 * k, chunk)
    np.testing.assert_array_equal(idx, want_idx, err_msg=f"vocab {vocab}, chunk {chunk}")
    np.testing.assert_array_equal(values, want_values)
