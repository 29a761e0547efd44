"""translate() on a real (randomly initialised) Transformer, and the `python -m decode` command."""
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data import synthetic
from data.vocab import Vocab, train_vocab
from decode import translate as translate_lib
from decode.__main__ import main as decode_main
from decode.beam_search import length_penalty
from experiments import default
from model import Transformer, TransformerConfig
from model.ops import decoding_for
from run import checkpoint as ckpt
from run import config as config_io
from run.mesh import make_mesh

MODEL = dict(d_model=32, d_ff=64, num_heads=2, num_encoder_layers=1, num_decoder_layers=2, max_len=64)


@pytest.fixture(scope="module")
def corpus():
  """Short sentences only: fewer length buckets, fewer programs to compile."""
  pairs = synthetic.generate(0, {"train": 400, "dev": 200, "test": 200})
  short = {k: [p for p in v if len(p[0].split()) <= 9] for k, v in pairs.items()}
  short["train"] = pairs["train"]
  return short


@pytest.fixture(scope="module")
def vocab(corpus):
  texts = [s for pair in corpus["train"] for s in pair]
  return Vocab(train_vocab(texts, 400, seed=0, sample_sentences=len(texts)))


@pytest.fixture(scope="module")
def model_and_params(vocab):
  cfg = TransformerConfig(vocab_size=vocab.size, **MODEL)
  model = Transformer(cfg)
  params = model.init({"params": jax.random.key(3)}, jnp.ones((1, 4), jnp.int32),
                      jnp.ones((1, 4), jnp.int32))["params"]
  # Larger weights than the initialisation gives, so the random model prefers some tokens (and eos)
  params = jax.tree_util.tree_map(lambda x: x * 3.0, params)
  return model, params


def test_a_batch_equals_one_by_one_in_input_order(model_and_params, vocab, corpus):
  model, params = model_and_params
  sources = [s for s, _ in corpus["dev"][:7]] + [""] + [corpus["dev"][8][0]]
  assert len({translate_lib.bucket_length(len(vocab.encode(s))) for s in sources if s}) >= 2
  kw = dict(beam_size=3, alpha=0.6, max_extra_len=6, batch_tokens=3 * 24 * 4, nbest=2)
  together = translate_lib.translate(model, params, vocab, sources, **kw)
  alone = [translate_lib.translate(model, params, vocab, [s], **kw)[0] for s in sources]
  assert len(together) == len(sources)
  assert together[7] == [("", 0.0), ("", 0.0)]
  for a, b in zip(together, alone):
    assert [h for h, _ in a] == [h for h, _ in b]
    np.testing.assert_allclose([s for _, s in a], [s for _, s in b], rtol=1e-4, atol=1e-4)
    assert a[0][1] >= a[1][1]


def test_one_device_equals_eight_devices(model_and_params, vocab, corpus):
  """Sentences split over 8 devices (each searching its share) translate exactly as on one device."""
  model, params = model_and_params
  sources = [s for s, _ in corpus["dev"][:11]]
  kw = dict(beam_size=3, alpha=0.6, max_extra_len=6, batch_tokens=3 * 24 * 4, nbest=2)
  one = translate_lib.translate(model, params, vocab, sources,
                                mesh=make_mesh(jax.local_devices()[:1]), **kw)
  eight = translate_lib.translate(model, params, vocab, sources, mesh=make_mesh(jax.local_devices()), **kw)
  assert make_mesh(jax.local_devices()).devices.size == 8
  for a, b in zip(one, eight):
    assert [h for h, _ in a] == [h for h, _ in b]
    # Per-device batches have other shapes, so matmuls round differently: scores agree to ~1e-5.
    np.testing.assert_allclose([s for _, s in a], [s for _, s in b], rtol=1e-4, atol=1e-4)


def test_sampling_draws_the_same_samples_on_any_number_of_devices(model_and_params, vocab, corpus):
  """Every sentence is sampled from the seed with its index folded in: the same samples on 1 device in
  small batches as on 8 devices in one; another seed draws others."""
  model, params = model_and_params
  sources = [s for s, _ in corpus["dev"][:11]]
  kw = dict(beam_size=1, max_extra_len=6, sampling={"temperature": 2.0}, seed=3)
  one = translate_lib.translate(model, params, vocab, sources, mesh=make_mesh(jax.local_devices()[:1]),
                                batch_tokens=24 * 4, **kw)
  eight = translate_lib.translate(model, params, vocab, sources, mesh=make_mesh(jax.local_devices()), **kw)
  assert one == eight
  other = translate_lib.translate(model, params, vocab, sources, **dict(kw, seed=4))
  assert other != one


@pytest.mark.parametrize("beam_size", [1, 3])
def test_decoding_weights_laid_out_once_search_as_laid_out_per_batch(model_and_params, vocab, corpus,
                                                                     beam_size):
  """translate() lays out the parameters' decoding weights once (decoding_weights_fn) and hands them to
  every batch's search: the same bits as a search that lays them out itself, on two devices."""
  model, params = model_and_params
  mesh = make_mesh(jax.local_devices()[:2])
  weights = translate_lib.decoding_weights_fn(model.cfg, mesh)(params)
  assert "output" in weights and ("panels" in weights) == (decoding_for(model.cfg).layer_weights is not None)
  for leaf in jax.tree.leaves(weights):
    assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 2
  ids = [vocab.encode(s) for s, _ in corpus["test"][:4]]
  src = np.zeros((4, max(map(len, ids))), np.int32)
  for r, s in enumerate(ids):
    src[r, :len(s)] = s
  limits = np.full((4,), src.shape[1] + 4, np.int32)
  sampling = (("temperature", 0.0),) if beam_size == 1 else ()
  search = translate_lib.search_fn(model.cfg, beam_size, 0.6, 0, src.shape[1] + 4, sampling, mesh)
  args = (params, jnp.asarray(src), jnp.asarray(limits), jax.random.key(0))
  given, own = (jax.device_get(search(*args, *extra)) for extra in ([weights], []))
  for a, b in zip(given, own):
    np.testing.assert_array_equal(a, b)
  assert (given[0] > 0).any()


def test_scores_equal_a_teacher_forced_rescoring_of_the_hypotheses(model_and_params, vocab, corpus):
  """The cached incremental decoder inside the search scores exactly what the full model would."""
  model, params = model_and_params
  sources = [s for s, _ in corpus["test"][:4]]
  ids = [vocab.encode(s) for s in sources]
  padded = max(len(s) for s in ids)
  src = np.zeros((4, padded), np.int32)
  for r, s in enumerate(ids):
    src[r, :len(s)] = s
  limits = np.array([len(s) + 5 for s in ids], np.int32)
  search = translate_lib.search_fn(model.cfg, 3, 0.6, 0, padded + 5)
  seqs, scores = jax.device_get(search(params, jnp.asarray(src), jnp.asarray(limits), jax.random.key(0)))
  # Every hypothesis through the full model at once, padded at the end (the decoder is causal, so the
  # padding changes no earlier position), with its source as the search saw it.
  hyps = []
  for r in range(4):
    for j in range(3):
      tokens = list(seqs[r, j])
      assert vocab.eos_id in tokens
      tokens = tokens[:tokens.index(vocab.eos_id) + 1]
      assert len(tokens) <= limits[r]
      hyps.append((r, j, tokens))
  tgt_in = np.zeros((len(hyps), padded + 5), np.int32)
  for row, (_, _, tokens) in enumerate(hyps):
    tgt_in[row, :len(tokens)] = [vocab.bos_id] + tokens[:-1]
  logits = model.apply({"params": params}, jnp.asarray(src[[r for r, _, _ in hyps]]), jnp.asarray(tgt_in))
  logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
  for row, (r, j, tokens) in enumerate(hyps):
    total = float(sum(logp[row, t, tok] for t, tok in enumerate(tokens)))
    np.testing.assert_allclose(scores[r, j], total / float(length_penalty(len(tokens), 0.6)),
                               rtol=2e-4, atol=2e-4)


def test_buckets_and_rows_keep_the_number_of_shapes_small():
  assert [translate_lib.bucket_length(n) for n in (1, 8, 9, 12, 13, 17, 25, 33, 49, 65)] == \
      [8, 8, 12, 12, 16, 24, 32, 48, 64, 96]
  assert [translate_lib.batch_rows(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]


def test_mismatched_vocabulary_size_is_refused(model_and_params, corpus):
  model, params = model_and_params
  texts = [s for pair in corpus["train"] for s in pair]
  other = Vocab(train_vocab(texts, 300, seed=0, sample_sentences=len(texts)))
  with pytest.raises(ValueError, match="vocab.model"):
    translate_lib.translate(model, params, other, ["a cat"])


# ------------------------------------------------------------------------------------------------------
# The command line, on a run directory written the way training writes one.
# ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory, model_and_params, vocab):
  model, params = model_and_params
  workdir = tmp_path_factory.mktemp("run")
  config = default.get_config()
  config.model.update({k: v for k, v in MODEL.items()})
  config.model.dropout_rate = 0.0
  config_io.save_config(config, workdir)
  vocab_bytes = pathlib.Path(vocab.path).read_bytes() if vocab.path != "<memory>" else None
  (workdir / "vocab.model").write_bytes(vocab_bytes or vocab.model_bytes)
  manager = ckpt.make_manager(workdir, async_save=False)
  ckpt.save(manager, 5, params, None, {"step": 5, "vocab_fingerprint": vocab.fingerprint})
  manager.wait_until_finished()
  manager.close()
  return workdir


def test_decode_command_writes_one_line_per_input_and_scores(run, corpus, tmp_path, capsys, model_and_params,
                                                              vocab):
  pairs = corpus["test"][:5]
  src, ref, out = tmp_path / "src.txt", tmp_path / "ref.txt", tmp_path / "out" / "hyp.txt"
  src.write_text("".join(s + "\n" for s, _ in pairs[:2]) + "\n" + "".join(s + "\n" for s, _ in pairs[2:]))
  ref.write_text("".join(t + "\n" for _, t in pairs[:2]) + "x\n" + "".join(t + "\n" for _, t in pairs[2:]))
  decode_main(["--workdir", str(run), "--input", str(src), "--output", str(out), "--reference", str(ref),
               "--beam_size", "2", "--max_extra_len", "5"])
  lines = out.read_text().split("\n")[:-1]
  assert len(lines) == 6 and lines[2] == ""
  model, params = model_and_params
  expected = translate_lib.translate(model, params, vocab, [s for s, _ in pairs], beam_size=2,
                                     max_extra_len=5)
  assert lines[:2] + lines[3:] == expected
  err = capsys.readouterr().err
  assert "sacreBLEU" in err and "nrefs:1|case:mixed" in err and "paper-style BLEU" in err
  assert "tok:moses-de+compound-split|sacremoses:" in err   # the paper-style score names its tokenizer

  decode_main(["--workdir", str(run), "--checkpoint", "5", "--input", str(src), "--output", str(out),
               "--beam_size", "3", "--nbest", "2", "--max_extra_len", "5"])
  rows = [line.split("\t") for line in out.read_text().splitlines()]
  assert len(rows) == 12 and [r[:2] for r in rows[:2]] == [["1", "1"], ["1", "2"]]
  assert float(rows[0][2]) >= float(rows[1][2])

  # Temperature 0 is greedy, which is beam 1.
  decode_main(["--workdir", str(run), "--input", str(src), "--output", str(out), "--temperature", "0",
               "--max_extra_len", "5", "--beam_size", "3"])
  greedy = out.read_text().split("\n")[:-1]
  assert greedy[:2] + greedy[3:] == translate_lib.translate(model, params, vocab, [s for s, _ in pairs],
                                                           beam_size=1, max_extra_len=5)


def test_decode_command_refuses_a_foreign_vocabulary_and_bad_input(run, tmp_path, corpus, capsys):
  src, out = tmp_path / "src.txt", tmp_path / "hyp.txt"
  src.write_text("a cat\n")
  foreign = tmp_path / "foreign"
  foreign.mkdir()
  for name in ("config.json", "checkpoints"):
    (foreign / name).symlink_to(run / name)
  texts = [s for pair in corpus["train"] for s in pair]
  # Same size, different pieces: only the fingerprint in the checkpoint's meta can tell.
  (foreign / "vocab.model").write_bytes(train_vocab(texts[::-1][:600], 400, seed=1, sample_sentences=600))
  with pytest.raises(SystemExit) as exit_info:   # one line `error: ...` naming both fingerprints, status 2
    decode_main(["--workdir", str(foreign), "--input", str(src), "--output", str(out)])
  assert exit_info.value.code == 2 and "fingerprint" in capsys.readouterr().err
  assert not out.exists()

  bad = tmp_path / "bad.txt"
  bad.write_bytes(b"fine\n\xff\xfe broken\n")
  with pytest.raises(SystemExit) as exit_info:   # one line `error: ...` naming the line, status 2
    decode_main(["--workdir", str(run), "--input", str(bad), "--output", str(out)])
  assert exit_info.value.code == 2 and "line 2" in capsys.readouterr().err
  ref = tmp_path / "ref.txt"
  ref.write_text("one\ntwo\n")
  with pytest.raises(SystemExit) as exit_info:
    decode_main(["--workdir", str(run), "--input", str(src), "--output", str(out), "--reference", str(ref)])
  assert exit_info.value.code == 2 and "line-aligned" in capsys.readouterr().err
  assert not out.exists()


def test_cpu_devices_takes_effect_although_the_command_has_imported_jax():
  """`python -m decode --cpu_devices K` gives decoding K host devices: the command's imports load JAX
  before the flag is read, so the count must reach JAX's config, not XLA_FLAGS."""
  import os
  import subprocess
  import sys
  code = ("import sys; from decode.__main__ import use_cpu_devices; assert 'jax' in sys.modules; "
          "use_cpu_devices(3); import jax; print(jax.local_device_count())")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(pathlib.Path(__file__).parents[1])
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  assert out.stdout.split()[-1] == "3"
