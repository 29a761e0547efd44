"""Synthetic (back-translated) pairs mixed into training (data/mixing.py): the share of the stream, the
same slots for the same seed, the tag as one piece on synthetic sources only, exact resume, old
vocabularies unchanged, and one-line errors that name the key and the file."""
import warnings

import numpy as np
import pytest

from data import DataError, make_train_iterator, mixing, synthetic
from data.vocab import BOS
from files_config import files_data_config
from run import get_vocab

TAG = "<BT>"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A parallel TSV of 300 pairs and a synthetic one of 200 (its sources marked 'zz' so that a test can
  tell them apart), from the embedded corpus's generator."""
  root = tmp_path_factory.mktemp("bt")
  pairs = synthetic.generate(seed=3, sizes={"train": 500, "dev": 20, "test": 20})
  write = lambda path, rows: path.write_text("".join(f"{s}\t{t}\n" for s, t in rows))
  write(root / "train.tsv", pairs["train"][:300])
  write(root / "synth.tsv", [(f"zz {s}", t) for s, t in pairs["train"][300:]])
  write(root / "dev.tsv", pairs["dev"])
  return root


def _config(corpus, tmp_path, **data):
  return files_data_config(corpus, vocab_size=300, vocab_sample_sentences=2000, max_len=128, batch_tokens=512,
                           cache_dir=str(corpus / "cache"), **data)


def _epoch(it):
  return [next(it) for _ in range(it.epoch_batches())]


def _sources(batches, vocab):
  """Every source of every batch, as piece lists (packed rows cut at their segments)."""
  out = []
  for batch in batches:
    for row, seg in zip(batch["src"], batch["src_segments"]):
      for s in range(1, int(seg.max(initial=0)) + 1):
        out.append([vocab.id_to_piece(i) for i in row[seg == s]])
  return out


def test_the_tag_is_one_piece_on_synthetic_sources_only(corpus, tmp_path):
  config = _config(corpus, tmp_path, synthetic_path=str(corpus / "synth.tsv"))
  assert mixing.synthetic_tag(config) == TAG                   # on by default with synthetic pairs
  vocab = get_vocab(config, tmp_path / "run")
  tag = vocab.piece_to_id(TAG)
  assert tag is not None and vocab.id_to_piece(tag) == TAG
  sources = _sources(_epoch(make_train_iterator(config, vocab, seed=0, row_multiple=1)), vocab)
  assert len(sources) == 500                                   # ratio 0: every pair once a pass
  tagged = [s for s in sources if s[0] == TAG]
  assert len(tagged) == 200
  assert all("".join(s[1:]).startswith("▁zz") for s in tagged)   # the tag, then the synthetic source
  assert all(TAG not in s and not "".join(s).startswith("▁zz") for s in sources if s[0] != TAG)


def test_tagging_can_be_turned_off(corpus, tmp_path):
  config = _config(corpus, tmp_path, synthetic_path=str(corpus / "synth.tsv"), synthetic_tag="")
  vocab = get_vocab(config, tmp_path / "run")
  assert vocab.piece_to_id(TAG) is None
  sources = _sources(_epoch(make_train_iterator(config, vocab, seed=0, row_multiple=1)), vocab)
  assert sum("".join(s).startswith("▁zz") for s in sources) == 200


def test_a_run_without_synthetic_pairs_keeps_its_vocabulary(corpus, tmp_path):
  """No synthetic key: the same vocabulary (bytes) as before the feature; a declared tag reserves one
  piece (a baseline that should share the back-translated run's vocabulary)."""
  plain = get_vocab(_config(corpus, tmp_path), tmp_path / "plain")
  assert plain.piece_to_id(TAG) is None and mixing.synthetic_tag(_config(corpus, tmp_path)) == ""
  baseline = get_vocab(_config(corpus, tmp_path, synthetic_path="", synthetic_tag=TAG), tmp_path / "base")
  bt = get_vocab(_config(corpus, tmp_path, synthetic_path=str(corpus / "synth.tsv")), tmp_path / "bt")
  assert baseline.fingerprint == bt.fingerprint != plain.fingerprint


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.8])
def test_the_ratio_is_the_synthetic_share_of_each_pass(corpus, tmp_path, ratio):
  config = _config(corpus, tmp_path, synthetic_path=str(corpus / "synth.tsv"), synthetic_ratio=ratio)
  vocab = get_vocab(config, tmp_path / "run")
  sources = _sources(_epoch(make_train_iterator(config, vocab, seed=0, row_multiple=1)), vocab)
  assert len(sources) == 500                                   # a pass keeps its natural size
  assert sum(s[0] == TAG for s in sources) == round(ratio * 500)


def test_slots_upsample_the_smaller_side_and_are_seeded():
  par, syn = mixing.slots(100, 30, 0.5, seed=0)
  assert len(par) == len(syn) == 65
  assert np.bincount(syn, minlength=30).min() >= 2             # 30 pairs fill 65 slots: each twice or more
  assert len(set(par.tolist())) == 65                          # 100 pairs in 65 slots: no repeats
  again = mixing.slots(100, 30, 0.5, seed=0)
  other = mixing.slots(100, 30, 0.5, seed=1)
  assert all(np.array_equal(a, b) for a, b in zip((par, syn), again))
  assert not np.array_equal(par, other[0])
  with pytest.raises(DataError, match="synthetic_ratio"):
    mixing.slots(100, 30, 1.0, seed=0)


def test_same_seed_same_batches_and_resume_continues_exactly(corpus, tmp_path):
  config = _config(corpus, tmp_path, synthetic_path=str(corpus / "synth.tsv"), synthetic_ratio=0.4)
  vocab = get_vocab(config, tmp_path / "run")
  make = lambda seed=0: make_train_iterator(config, vocab, seed=seed, row_multiple=1)
  reference = make()
  stream = [next(reference) for _ in range(reference.epoch_batches() + 3)]   # crosses a pass
  assert any(not np.array_equal(a["src"], b["src"]) for a, b in zip(stream, _epoch(make(seed=1))))
  for cut in (2, reference.epoch_batches() + 1):
    it = make()
    for _ in range(cut):
      next(it)
    resumed = make()
    resumed.set_state(dict(it.get_state()))
    for expected in stream[cut:cut + 2]:
      got = next(resumed)
      assert set(got) == set(expected)
      for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])
  assert all((b["tgt_in"][b["tgt_segments"] > 0][:1] == BOS).all() for b in stream)


def test_a_missing_or_unreadable_file_is_one_line_naming_key_and_file(corpus, tmp_path):
  config = _config(corpus, tmp_path, synthetic_path=str(tmp_path / "nope.tsv"))
  with pytest.raises(DataError, match=r"^config.data.synthetic_path: file .*nope.tsv' does not exist$"):
    get_vocab(config, tmp_path / "run")
  folder = tmp_path / "synth"                 # a path that exists but cannot be read as pairs
  folder.mkdir()
  config = _config(corpus, tmp_path, synthetic_path=str(folder))
  with pytest.raises(DataError, match=r"^config.data.synthetic_path: .*synth' is not a file; give a TSV"):
    get_vocab(config, tmp_path / "run")


def test_an_old_vocabulary_without_the_tag_is_refused_in_one_line(corpus, tmp_path):
  plain = _config(corpus, tmp_path)
  vocab = get_vocab(plain, tmp_path / "run")                   # the run's vocabulary, made before the tag
  config = _config(corpus, tmp_path, synthetic_path=str(corpus / "synth.tsv"))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with pytest.raises(DataError, match="synthetic_tag='<BT>' is not a piece of the vocabulary"):
      make_train_iterator(config, vocab, seed=0, row_multiple=1)


@pytest.mark.slow   # compiles a train and an eval step: over 20 s with a cold compilation cache
def test_the_experiment_trains_on_synthetic_pairs(corpus, tmp_path, monkeypatch):
  """experiments/back_translation.py's forward model, shrunk (its smoke settings), two steps on the
  tiny corpus with the synthetic file: the run's vocabulary reserves the tag and the loss is finite."""
  import experiments
  from run import metrics as metrics_io
  from train.train import train_and_evaluate
  monkeypatch.setenv("AIAYN_DATA_CACHE", str(corpus / "cache"))
  config = experiments.load_experiment("experiments/back_translation.py:smoke")
  config.data.update(source="files", train_path=str(corpus / "train.tsv"), dev_path=str(corpus / "dev.tsv"),
                     test_path=str(corpus / "dev.tsv"), vocab_size=300, vocab_sample_sentences=2000,
                     synthetic_path=str(corpus / "synth.tsv"), synthetic_ratio=0.5)
  config.train.update(num_steps=2, test_bleu=False, bleu_every=0, progress=False, tensorboard=False,
                      eval_every=0, dev_sentences=8)
  outcome = train_and_evaluate(config, tmp_path)
  assert outcome.step == 2 and outcome.interrupted is None
  assert (tmp_path / "vocab.json").read_text().count(TAG) == 1
  losses = [line["train/loss"] for line in metrics_io.read_metrics(tmp_path) if "train/loss" in line]
  assert losses and all(np.isfinite(losses))
