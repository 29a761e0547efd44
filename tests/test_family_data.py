"""Decoder-only translation and masked-LM data (data/lm.py), and decoding after a cached prefill
(decode/prompt.py): no loss on source tokens, BERT's masking rates, beam search == exhaustive search."""
import itertools

import pytest

import jax
import jax.numpy as jnp
import numpy as np

from data.lm import MASK, SEP, decoder_only_pair, lm_text, mlm_mask, pad_rows
from data.vocab import BOS, EOS
from decode.beam_search import length_penalty
from decode.prompt import left_pad, prompt_sample, prompt_search
from model import Compute, Transformer, TransformerConfig


def test_decoder_only_translation_scores_the_target_only():
  tokens_in, tokens_out, weights = decoder_only_pair([10, 11, 12], [20, 21])
  assert list(tokens_in) == [BOS, 10, 11, 12, SEP, 20, 21]
  assert list(tokens_out) == [10, 11, 12, SEP, 20, 21, EOS]
  assert list(tokens_out[weights > 0]) == [20, 21, EOS]        # no loss on source tokens
  batch = pad_rows([(tokens_in, tokens_out, weights), lm_text([5, 6])], length=9)
  assert batch["tgt_weights"].sum() == 3 + 3 and batch["tgt_weights"][:, 7:].sum() == 0
  assert list(batch["tgt_segments"][1]) == [1, 1, 1, 0, 0, 0, 0, 0, 0]


def test_mlm_rates_hold_and_padding_is_never_masked_or_scored():
  rng = np.random.default_rng(0)
  ids = rng.integers(4, 100, (400, 512)).astype(np.int32)
  ids[:, 400:] = 0                                           # padding
  ids[:, 0] = BOS
  inputs, targets, weights = mlm_mask(ids, np.random.default_rng(1), vocab_size=100)
  real = ids >= 4
  chosen = weights > 0
  assert not chosen[~real].any() and np.array_equal(inputs[~real], ids[~real])
  np.testing.assert_array_equal(targets, ids)
  assert abs(chosen[real].mean() - 0.15) < 0.003
  masked = (inputs == MASK)[chosen].mean()
  same = (inputs == ids)[chosen].mean()
  assert abs(masked - 0.8) < 0.01
  assert abs(same - (0.1 + 0.1 / 96)) < 0.01                # kept, or replaced by itself
  assert abs(1 - masked - same - 0.1 * 95 / 96) < 0.01       # replaced by another piece
  assert np.array_equal(inputs[real & ~chosen], ids[real & ~chosen])


def _tiny():
  cfg = TransformerConfig(vocab_size=5, d_model=8, d_ff=16, num_heads=2, num_decoder_layers=1,
                          arch="decoder_only", positions="rope", num_kv_heads=1, dropout_rate=0.0,
                          max_len=32, compute=Compute(kernels="reference"))
  model = Transformer(cfg)
  params = model.init(jax.random.key(3), None, jnp.ones((1, 4), jnp.int32))["params"]
  # Sharpen the logits so that hypotheses differ clearly.
  params = jax.tree_util.tree_map(lambda x: x * 3.0, params)
  return model, params


def _logprob(model, params, prompt, tokens):
  seq = jnp.asarray([list(prompt) + list(tokens[:-1])], jnp.int32)
  # Explicit segments: a generated 0 is a token here, not padding.
  logp = jax.nn.log_softmax(model.apply({"params": params}, None, seq,
                                        tgt_segments=jnp.ones_like(seq))[0])
  start = len(prompt) - 1
  return float(sum(logp[start + i, t] for i, t in enumerate(tokens)))


@pytest.mark.slow
def test_beam_search_after_a_prefill_matches_exhaustive_search():
  model, params = _tiny()
  max_len, alpha = 3, 0.6
  prompts = [[BOS, 4, 4, SEP], [BOS, 4, SEP]]
  seqs, scores = prompt_search(model, params, jnp.asarray(left_pad(prompts)), beam_size=32,
                               max_len=max_len, alpha=alpha)
  others = [t for t in range(5) if t != EOS]
  for row, prompt in enumerate(prompts):
    expected = []
    for n in range(1, max_len + 1):
      for body in itertools.product(others, repeat=n - 1):
        tokens = list(body) + [EOS]
        expected.append((_logprob(model, params, prompt, tokens) / float(length_penalty(n, alpha)),
                         tokens))
    expected.sort(key=lambda x: -x[0])
    upto_eos = lambda q: [int(t) for t in q[:list(q).index(EOS) + 1]]
    got = [(float(s), upto_eos(q)) for s, q in zip(scores[row][:5], seqs[row][:5])]
    assert [q for _, q in got] == [q for _, q in expected[:5]]
    np.testing.assert_allclose([s for s, _ in got], [s for s, _ in expected[:5]], rtol=1e-4, atol=1e-4)


def test_greedy_prompt_sampling_is_the_beam_of_one():
  model, params = _tiny()
  prompt = jnp.asarray(left_pad([[BOS, 4, 4], [BOS, 4]]))
  greedy, _ = prompt_sample(model, params, prompt, jax.random.key(0), max_len=4, temperature=0.0)
  beam, _ = prompt_search(model, params, prompt, beam_size=1, max_len=4, alpha=0.0)
  np.testing.assert_array_equal(greedy, beam[:, 0])


def test_export_refuses_the_family_switches_by_name():
  import pytest
  from export.weights import UnsupportedOption, check_exportable
  base = dict(vocab_size=40, d_model=16, d_ff=32, num_heads=4, num_encoder_layers=1, num_decoder_layers=1)
  check_exportable(TransformerConfig(**base, num_kv_heads=4), "hf")     # MHA spelled out is fine
  for switch, name in [(dict(arch="decoder_only"), "arch"), (dict(positions="rope"), "positions"),
                       (dict(num_kv_heads=2), "num_kv_heads"), (dict(activation="swiglu"), "activation"),
                       (dict(norm="rmsnorm"), "norm"), (dict(positions="learned"), "positions")]:
    with pytest.raises(UnsupportedOption, match=name):
      check_exportable(TransformerConfig(**base, **switch), "hf")


def test_repetition_penalty_in_beam_search_makes_a_beam_of_one_the_penalised_greedy():
  model, params = _tiny()
  prompt = jnp.asarray(left_pad([[BOS, 4, 4], [BOS, 4]]))
  plain, _ = prompt_search(model, params, prompt, beam_size=1, max_len=6, alpha=0.0)
  greedy, _ = prompt_sample(model, params, prompt, jax.random.key(0), max_len=6, temperature=0.0,
                            repetition_penalty=5.0)
  beam, _ = prompt_search(model, params, prompt, beam_size=1, max_len=6, alpha=0.0,
                          repetition_penalty=5.0)
  np.testing.assert_array_equal(greedy, beam[:, 0])
  assert not np.array_equal(plain, beam)          # the penalty changed what was found


def test_attention_maps_are_captured_only_when_asked_and_are_distributions(tmp_path):
  from decode.attention_maps import attention_maps, plot
  cfg = TransformerConfig(vocab_size=20, d_model=8, d_ff=16, num_heads=2, num_encoder_layers=2,
                          num_decoder_layers=1, num_kv_heads=1, positions="alibi", compute=Compute(kernels="reference"))
  model = Transformer(cfg)
  src, tgt = [5, 6, 7, 8], [BOS, 9, 10]
  params = model.init(jax.random.key(0), jnp.asarray([src]), jnp.asarray([tgt]))["params"]
  maps = attention_maps(model, params, src, tgt)
  assert sorted(maps) == [("cross", 0), ("dec_self", 0), ("enc_self", 0), ("enc_self", 1)]
  assert maps[("cross", 0)].shape == (2, 3, 4) and maps[("enc_self", 1)].shape == (2, 4, 4)
  np.testing.assert_allclose(maps[("dec_self", 0)].sum(-1), 1.0, rtol=1e-5)
  assert np.all(np.triu(maps[("dec_self", 0)][0], 1) < 1e-6)        # causal
  plot(maps[("cross", 0)], ["a", "b", "c"], ["w", "x", "y", "z"], "t", tmp_path / "m.png")
  assert (tmp_path / "m.png").stat().st_size > 1000


def test_decode_takes_exactly_one_of_input_and_prompt(capsys):
  import pytest
  from decode.__main__ import main
  for argv in (["--workdir", "w", "--input", "a", "--prompt", "b"], ["--workdir", "w"]):
    with pytest.raises(SystemExit):
      main(argv)
    assert "exactly one of --input" in capsys.readouterr().err
