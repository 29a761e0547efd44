"""Data: the embedded corpus, the TFDS and file sources, the vocabulary, and batches."""
import gzip
import warnings

import numpy as np
import pytest
import sacrebleu

from data import (BatchIterator, DataError, check_vocab, load_pairs, make_eval_batches,
                  make_train_iterator, synthetic, tokenize, tokenized)
from data.batching import ORDER
from data.vocab import BOS, EOS, Vocab, train_vocab
from run import get_vocab
from experiments.default import get_config

TRAIN_SIZE = 600


@pytest.fixture(scope="module")
def data_config(tmp_path_factory):
  config = get_config().data
  config.update(synthetic_train_size=TRAIN_SIZE, tfds_data_dir=str(tmp_path_factory.mktemp("tfds")),
                vocab_size=400, vocab_sample_sentences=1000, max_len=48, batch_tokens=512,
                cache_dir=str(tmp_path_factory.mktemp("cache")))
  return config


@pytest.fixture(scope="module")
def vocab(data_config, tmp_path_factory):
  return get_vocab(data_config, tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def ids(data_config, vocab):
  src, tgt, _ = tokenize(vocab, load_pairs(data_config, "train"), max_len=data_config.max_len)
  return src, tgt


# ---------------------------------------------------------------------------------------------------
# The embedded corpus.
# ---------------------------------------------------------------------------------------------------

def test_synthetic_corpus_is_deterministic_with_disjoint_splits():
  a = synthetic.generate(3, {"train": 2000})
  assert a == synthetic.generate(3, {"train": 2000})
  assert a["train"] != synthetic.generate(4, {"train": 2000})["train"]
  assert len(a["dev"]) >= 1000 and len(a["test"]) >= 1000
  train = {s for s, _ in a["train"]}
  dev, test = {s for s, _ in a["dev"]}, {s for s, _ in a["test"]}
  assert not train & dev and not train & test and not dev & test
  lengths = [len(s.split()) for s, _ in a["train"]]
  assert min(lengths) <= 4 and 25 <= max(lengths) <= synthetic.MAX_WORDS


def test_synthetic_lexicon_has_over_a_thousand_source_words():
  lex = synthetic.make_lexicon(0)
  lemmas = [n[0] for n in lex.nouns] + [a[0] for a in lex.adjectives] + [v[0] for v in lex.verbs]
  lemmas += [a[0] for a in lex.adverbs] + [p[0] for p in lex.prepositions]
  assert len(set(lemmas)) >= 1000


def test_word_by_word_dictionary_translation_scores_below_40_bleu():
  corpus = synthetic.generate(0, {"train": 10})
  lex = synthetic.make_lexicon(0)
  hyps = [synthetic.dictionary_translate(s, lex) for s, _ in corpus["test"]]
  bleu = sacrebleu.corpus_bleu(hyps, [[t for _, t in corpus["test"]]]).score
  print(f"monotone dictionary baseline: {bleu:.1f} BLEU")
  assert bleu < 40


# ---------------------------------------------------------------------------------------------------
# Sources.
# ---------------------------------------------------------------------------------------------------

def test_synthetic_source_reads_the_prepared_tfds_dataset(data_config):
  corpus = synthetic.generate(0, {"train": TRAIN_SIZE})
  for split in ("train", "dev", "test"):   # TFDS stores records in its own (deterministic) order
    assert sorted(load_pairs(data_config, split)) == sorted(corpus[split])


def test_tfds_source_reads_a_locally_prepared_dataset_in_either_direction(data_config):
  config = data_config.copy_and_resolve_references()
  config.update(source="tfds", tfds_name=f"aiayn_synthetic/seed0_train{TRAIN_SIZE}")
  en_de = load_pairs(config, "dev")
  assert sorted(en_de) == sorted(synthetic.generate(0, {"train": TRAIN_SIZE})["dev"])
  config.update(src_lang="de", tgt_lang="en")
  assert load_pairs(config, "dev") == [(t, s) for s, t in en_de]


def test_tfds_source_is_tokenized_once_into_the_cache_in_record_order(data_config, vocab, monkeypatch):
  """WMT's path: a TFDS split read in shards of records (data/shards.py, here 3, by two worker
  processes) into the on-disk cache, pair i being record i."""
  from data import shards
  monkeypatch.setattr(shards, "SHARD_RECORDS", 250)
  monkeypatch.setenv("AIAYN_TOKENIZE_WORKERS", "2")
  config = data_config.copy_and_resolve_references()
  config.update(source="tfds", tfds_name=f"aiayn_synthetic/seed0_train{TRAIN_SIZE}")
  pairs, texts = tokenized(config, vocab, "train"), load_pairs(config, "train")
  assert len(pairs) == len(texts) == TRAIN_SIZE
  for i in range(TRAIN_SIZE):
    np.testing.assert_array_equal(pairs.src[i], vocab.encode(texts[i][0]))
    np.testing.assert_array_equal(pairs.tgt[i], vocab.encode(texts[i][1]))
    assert pairs.origin(i) == f"{config.tfds_name}:train[{i}]"
  assert next(make_train_iterator(config, vocab, seed=0, row_multiple=8))["src"].shape[0] % 8 == 0


@pytest.mark.parametrize("changes, message", [
    (dict(tfds_name="no_such_dataset/xx"), "not prepared in .*DatasetNotFoundError.*run: python -m data.prepare "
                                           "no_such_dataset/xx --data_dir DIR"),
    (dict(tfds_name="aiayn_synthetic/seed0_train200000"), "not prepared.*python -m data.prepare"),
    (dict(src_lang="fr"), "src_lang='fr'"),
    (dict(source="web"), "config.data.source='web'"),
])
def test_tfds_errors_name_the_problem(data_config, changes, message):
  config = data_config.copy_and_resolve_references()
  config.update(source="tfds", tfds_name=f"aiayn_synthetic/seed0_train{TRAIN_SIZE}")
  config.update(**changes)
  with pytest.raises(DataError, match=message):
    load_pairs(config, "dev")


def _files_config(data_config, **paths):
  config = data_config.copy_and_resolve_references()
  config.update(source="files", **paths)
  return config


def test_tsv_with_bad_lines_skips_and_counts_them(data_config, tmp_path):
  tsv = tmp_path / "train.tsv"
  tsv.write_bytes(b"hello\thallo\n\nno tab here\na\tb\tc\n\xff\xfe\tbad\nworld\twelt\n")
  config = _files_config(data_config, train_path=str(tsv), dev_path=str(tsv), test_path=str(tsv))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pairs = load_pairs(config, "train")
  assert pairs == [("hello", "hallo"), ("world", "welt")]
  message = " ".join(str(w.message) for w in caught)
  assert "skipped 4 pairs" in message
  for reason, line in (("empty line", 2), ("no tab", 3), ("more than one tab", 4), ("undecodable", 5)):
    assert reason in message and f"train.tsv:{line}" in message


def test_aligned_gzipped_files(data_config, tmp_path):
  src, tgt = tmp_path / "train.en.gz", tmp_path / "train.de.gz"
  with gzip.open(src, "wt") as f:
    f.write("one\ntwo\n")
  with gzip.open(tgt, "wt") as f:
    f.write("eins\nzwei\n")
  spec = f"{src},{tgt}"
  config = _files_config(data_config, train_path=spec, dev_path=spec, test_path=spec)
  assert load_pairs(config, "test") == [("one", "eins"), ("two", "zwei")]


def test_file_errors_name_the_file_and_key(data_config, tmp_path):
  empty = tmp_path / "empty.tsv"
  empty.write_text("\n\nnotab\n")
  config = _files_config(data_config, train_path=str(empty), dev_path=str(tmp_path / "missing.tsv"),
                         test_path=str(empty))
  with pytest.raises(DataError, match=r"config.data.dev_path: file .*missing.tsv.* does not exist"):
    load_pairs(config, "train")   # checked before any work, whatever the split
  config.dev_path = str(empty)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with pytest.raises(DataError, match="no usable sentence pairs"):
      load_pairs(config, "train")
  a, b = tmp_path / "a.txt", tmp_path / "b.txt"
  a.write_text("x\ny\n")
  b.write_text("x\n")
  config.update(train_path=f"{a},{b}")
  with pytest.raises(DataError, match="line-aligned"):
    load_pairs(config, "train")


def test_pairs_longer_than_max_len_are_skipped_and_counted(vocab):
  pairs = [("short one", "kurz"), ("a " * 80, "lang"), ("ok", "gut")]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    src, tgt, kept = tokenize(vocab, pairs, ["f.tsv:1", "f.tsv:2", "f.tsv:3"], max_len=20)
  assert kept == [0, 2]
  assert "longer than max_len=20" in str(caught[0].message) and "f.tsv:2" in str(caught[0].message)


# ---------------------------------------------------------------------------------------------------
# Vocabulary.
# ---------------------------------------------------------------------------------------------------

def test_vocab_round_trips_text_and_has_distinct_special_ids(vocab, data_config):
  assert len({vocab.pad_id, vocab.unk_id, vocab.bos_id, vocab.eos_id}) == 4 and vocab.pad_id == 0
  for src, tgt in load_pairs(data_config, "test")[:50]:
    for text in (src, tgt):
      ids = vocab.encode(text)
      assert 0 not in ids and vocab.decode(ids) == text
      assert vocab.decode(ids + [EOS, 7, 8]) == text      # stops at eos
      assert vocab.decode([BOS] + ids + [0, 0]) == text   # drops bos and pad


def test_vocab_is_trained_once_per_run_and_checked(data_config, tmp_path):
  first = get_vocab(data_config, tmp_path)
  model = (tmp_path / "vocab.model").read_bytes()
  again = get_vocab(data_config, tmp_path)
  assert again.fingerprint == first.fingerprint and (tmp_path / "vocab.model").read_bytes() == model
  other = Vocab(train_vocab(["something else entirely"] * 50 + ["more words here"] * 50, 40, seed=0,
                            sample_sentences=100))
  check_vocab(first, first.fingerprint, "run X")
  with pytest.raises(ValueError, match="is not the vocabulary run X was trained with"):
    check_vocab(other, first.fingerprint, "run X")


def test_vocab_sample_is_seeded_not_the_first_lines():
  texts = [f"alpha{i}" for i in range(500)] + [f"omega{i}" for i in range(500)]
  a = train_vocab(texts, 60, seed=0, sample_sentences=100)
  assert a == train_vocab(texts, 60, seed=0, sample_sentences=100)
  vocab = Vocab(a)
  assert "omega" in "".join(vocab.decode([i]) for i in range(4, vocab.size))


# ---------------------------------------------------------------------------------------------------
# Batches.
# ---------------------------------------------------------------------------------------------------

def _iterator(ids, **kw):
  src, tgt = ids
  settings = dict(max_len=48, batch_tokens=512, row_multiple=4, seed=0)
  settings.update(kw)
  return BatchIterator(src, tgt, **settings)


def _pairs_of(batch):
  """The (src, tgt) token tuples a batch holds, one per segment."""
  out = []
  for row in range(batch["src"].shape[0]):
    for seg in range(1, int(batch["tgt_segments"][row].max(initial=0)) + 1):
      s = batch["src"][row][batch["src_segments"][row] == seg]
      t = batch["tgt_out"][row][batch["tgt_segments"][row] == seg]
      out.append((tuple(s), tuple(t[:-1])))
  return out


@pytest.mark.parametrize("pack", [False, True])
def test_every_example_exactly_once_per_epoch_within_the_token_budget(ids, pack):
  it = _iterator(ids, pack=pack)
  expected = sorted((tuple(s), tuple(t)) for s, t in zip(*ids))
  seen, shapes = [], set()
  for _ in range(it.epoch_batches()):
    batch = next(it)
    rows, length = batch["tgt_in"].shape
    shapes.add((rows, length))
    assert rows % 4 == 0
    if pack:
      assert (rows - 3) * length <= 512   # up to 3 empty rows pad to the row multiple
    assert int((batch["tgt_segments"] != 0).sum()) <= 512
    assert int((batch["src_segments"] != 0).sum()) <= 512
    seen += _pairs_of(batch)
  assert sorted(seen) == expected
  assert it.get_state() == {"epoch": 0, "index": it.epoch_batches(), "order": ORDER}
  assert len(shapes) <= (1 if pack else 9)


def test_bucketed_batches_count_real_source_and_target_tokens_not_padding(ids):
  """The paper's ~25k source + ~25k target tokens per batch, as fairseq's --max-tokens: a bucketed batch
  closes when the next pair would bring either side's real tokens over batch_tokens, so batches come
  close to the budget instead of counting padded slots (which left them 17-27% short)."""
  src, tgt = ids
  it = _iterator(ids, batch_tokens=1024)
  fullest, lengths = [], []
  for _ in range(it.epoch_batches()):
    batch = next(it)
    real_src = int((batch["src_segments"] != 0).sum())
    real_tgt = int((batch["tgt_segments"] != 0).sum())
    assert real_src <= 1024 and real_tgt <= 1024
    fullest.append(max(real_src, real_tgt))
    lengths.append(batch["src"].shape[1])
  # Every bucket with more than a batch of pairs fills all but its last batch to within one pair.
  by_length = {}
  for length, full in zip(lengths, fullest):
    by_length.setdefault(length, []).append(full)
  checked = 0
  for length, fulls in by_length.items():
    for full in sorted(fulls, reverse=True)[:-1]:
      assert full > 1024 - length, (length, fulls)
      checked += 1
  assert checked >= 3
  assert np.median(fullest) > 0.9 * 1024


def test_source_eos_ends_every_source_with_eos(data_config, vocab):
  pairs = load_pairs(data_config, "dev")[:20]
  plain, _, _ = tokenize(vocab, pairs)
  with_eos, tgt, _ = tokenize(vocab, pairs, source_eos=True)
  for a, b in zip(plain, with_eos):
    assert list(b) == list(a) + [EOS]
  config = get_config().data
  config.update(data_config.to_dict())
  config.source_eos = True
  batch = next(make_train_iterator(config, vocab, seed=0, row_multiple=1))
  for row in range(batch["src"].shape[0]):
    for seg in range(1, int(batch["src_segments"][row].max(initial=0)) + 1):
      assert batch["src"][row][batch["src_segments"][row] == seg][-1] == EOS
  dev = make_eval_batches(config, vocab, pairs, row_multiple=1)
  assert all(b["src"][r][b["src_segments"][r] == 1][-1] == EOS
             for b in dev for r in range(b["src"].shape[0]) if b["src_segments"][r].any())


def test_same_seed_same_batches_and_epochs_reshuffle(ids):
  a, b, c = _iterator(ids), _iterator(ids), _iterator(ids, seed=1)
  first = [next(a) for _ in range(5)]
  for batch in first:
    np.testing.assert_array_equal(batch["src"], next(b)["src"])
  assert any(not np.array_equal(x["src"], next(c)["src"]) for x in first)
  n = a.epoch_batches()
  epoch0 = [_pairs_of(x) for x in first] + [_pairs_of(next(a)) for _ in range(n - 5)]
  epoch1 = [_pairs_of(next(a)) for _ in range(n)]
  assert epoch0 != epoch1 and sorted(sum(epoch0, [])) == sorted(sum(epoch1, []))


@pytest.mark.parametrize("pack", [False, True])
def test_restored_iterator_continues_exactly(ids, pack):
  reference = _iterator(ids, pack=pack)
  stream = [next(reference) for _ in range(reference.epoch_batches() + 4)]   # crosses an epoch
  for cut in (3, reference.epoch_batches() - 1, reference.epoch_batches() + 1):
    it = _iterator(ids, pack=pack)
    for _ in range(cut):
      next(it)
    state = it.get_state()
    resumed = _iterator(ids, pack=pack)
    resumed.set_state(dict(state))
    for expected in stream[cut:cut + 3]:
      got = next(resumed)
      for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])


def test_packing_starts_every_segment_with_bos_and_never_leaks(ids):
  it = _iterator(ids, pack=True)
  packed_rows = 0
  for _ in range(it.epoch_batches()):
    batch = next(it)
    for row in range(batch["src"].shape[0]):
      segs = batch["tgt_segments"][row]
      packed_rows += segs.max(initial=0) > 1
      for seg in range(1, segs.max(initial=0) + 1):
        where = np.flatnonzero(segs == seg)
        assert (np.diff(where) == 1).all()                          # contiguous
        assert batch["tgt_in"][row, where[0]] == BOS                 # never the previous EOS
        assert batch["tgt_out"][row, where[-1]] == EOS
        np.testing.assert_array_equal(batch["tgt_positions"][row, where], np.arange(len(where)))
        np.testing.assert_array_equal(batch["tgt_in"][row, where[1:]], batch["tgt_out"][row, where[:-1]])
        src_where = np.flatnonzero(batch["src_segments"][row] == seg)
        np.testing.assert_array_equal(batch["src_positions"][row, src_where], np.arange(len(src_where)))
      pad = segs == 0
      assert (batch["tgt_in"][row, pad] == 0).all() and (batch["tgt_positions"][row, pad] == 0).all()
  assert packed_rows > 0


def test_processes_read_disjoint_shards_of_each_global_batch(ids):
  whole = _iterator(ids, row_multiple=4)
  parts = [_iterator(ids, row_multiple=4, process_index=p, process_count=2) for p in range(2)]
  for _ in range(5):
    batch = next(whole)
    halves = [next(p) for p in parts]
    for key in batch:
      np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), batch[key])


def test_train_iterator_and_eval_batches_from_config(data_config, vocab):
  it = make_train_iterator(data_config, vocab, seed=0, row_multiple=8)
  assert next(it)["src"].shape[0] % 8 == 0
  dev = load_pairs(data_config, "dev")
  batches = make_eval_batches(data_config, vocab, dev, row_multiple=8)
  seen = sorted(sum((_pairs_of(b) for b in batches), []))
  expected = sorted((tuple(vocab.encode(s)), tuple(vocab.encode(t))) for s, t in dev)
  assert seen == expected
  assert len({b["src"].shape for b in batches}) <= 9
