"""The tokenized corpus on disk (data/cache.py): made once, never stale, never half; per-process rows."""
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

from data import cache, load_pairs, load_pairs_with_origins, make_train_iterator, shards, synthetic, tokenized
from data import vocab as vocab_lib
from data.batching import packing_cuts
from data.sources import DataError
from files_config import files_data_config
from run import get_vocab

PAIRS = 1500
BAD_LINES = (7, 400)   # 1-based line numbers of train.tsv that are malformed


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A TSV corpus of PAIRS synthetic pairs, two of its lines malformed."""
  folder = tmp_path_factory.mktemp("corpus")
  pairs = synthetic.generate(0, {"train": PAIRS})
  lines = [f"{s}\t{t}" for s, t in pairs["train"]]
  for number in BAD_LINES:
    lines.insert(number - 1, "a line without a tab")
  (folder / "train.tsv").write_text("\n".join(lines) + "\n")
  (folder / "dev.tsv").write_text("\n".join(f"{s}\t{t}" for s, t in pairs["dev"][:50]) + "\n")
  return folder


def _config(corpus, tmp_path, **changes):
  defaults = dict(vocab_size=200, vocab_sample_sentences=1000, max_len=48, batch_tokens=256,
                  cache_dir=str(tmp_path / "cache"))
  return files_data_config(corpus, **{**defaults, **changes})


def _same(a, b):
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_a_second_run_and_a_resume_read_the_cache_without_tokenizing(corpus, tmp_path, monkeypatch):
  config = _config(corpus, tmp_path)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    vocab = get_vocab(config, tmp_path / "run1")
    first = make_train_iterator(config, vocab, seed=0, row_multiple=4)
    batches = [next(first) for _ in range(6)]
  bad = [str(w.message) for w in caught if "a line without" in str(w.message) or "no tab" in str(w.message)]
  assert len(bad) == 1 and all(f"train.tsv:{n}" in bad[0] for n in BAD_LINES)   # named once, when made
  info = json.loads((tmp_path / "run1" / vocab_lib.VOCAB_INFO).read_text())
  assert info["sample_sentences"] == 1000 and info["corpus_pairs"] == PAIRS   # a bounded sample, recorded

  def never(*args, **kwargs):
    raise AssertionError("tokenized or trained again")
  monkeypatch.setattr(vocab_lib.Vocab, "encode_batch", never)
  monkeypatch.setattr(vocab_lib, "train_vocab", never)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    again = get_vocab(config, tmp_path / "run2")   # a new run directory: the cached vocabulary
    second = make_train_iterator(config, again, seed=0, row_multiple=4)
    for expected in batches:
      _same(next(second), expected)
    resumed = make_train_iterator(config, again, seed=0, row_multiple=4)
    resumed.set_state({**first.get_state(), "index": 3})
    for expected in batches[3:]:
      _same(next(resumed), expected)
  assert again.fingerprint == vocab.fingerprint
  assert not [w for w in caught if "no tab" in str(w.message)]


def test_the_vocabulary_sample_is_the_one_drawn_from_the_whole_corpus(corpus, tmp_path):
  config = _config(corpus, tmp_path, vocab_sample_sentences=700, vocab_seed=3)
  texts = [side for pair in load_pairs(config, "train") for side in pair]
  model, info = cache.train_vocab_cached(config)
  assert model == vocab_lib.train_vocab(texts, 200, seed=3, sample_sentences=700)
  assert info["sample_sentences"] == 700


def test_a_changed_corpus_file_or_vocabulary_makes_a_new_cache(corpus, tmp_path):
  folder = tmp_path / "own"
  folder.mkdir()
  (folder / "train.tsv").write_text((corpus / "train.tsv").read_text())
  config = _config(corpus, tmp_path, train_path=str(folder / "train.tsv"))
  vocab = get_vocab(config, tmp_path / "run")
  before = tokenized(config, vocab)
  with open(folder / "train.tsv", "a") as f:
    f.write("one more sentence\tein weiterer satz\n")
  after = tokenized(config, vocab)
  assert len(after) == len(before) + 1 == PAIRS + 1
  np.testing.assert_array_equal(after.tgt[PAIRS], vocab.encode("ein weiterer satz"))
  other = get_vocab(_config(corpus, tmp_path, train_path=str(folder / "train.tsv"), vocab_size=150),
                    tmp_path / "other")
  assert other.fingerprint != vocab.fingerprint
  rebuilt = tokenized(config, other)
  np.testing.assert_array_equal(rebuilt.src[5], other.encode(load_pairs(config, "train")[5][0]))
  assert len({cache.split_dir(config, v, "train") for v in (vocab, other)}) == 2


_DIE_WHILE_TOKENIZING = """
import json, os, sys
import ml_collections
from data import cache, shards, vocab as vocab_lib
config = ml_collections.ConfigDict(json.loads(sys.argv[1]))
vocab = vocab_lib.Vocab.load(sys.argv[2])
encode, calls = vocab_lib.Vocab.encode_batch, []
def dying(self, texts, side="source"):
  calls.append(1)
  if len(calls) == 3:          # the first chunk is written; the process dies in the second
    os._exit(9)
  return encode(self, texts, side)
vocab_lib.Vocab.encode_batch = dying
shards.CHUNK = 100
cache.tokenized(config, vocab)
"""


def test_a_killed_cache_build_is_detected_and_made_again(corpus, tmp_path):
  config = _config(corpus, tmp_path)
  vocab = get_vocab(config, tmp_path / "run")
  done = subprocess.run([sys.executable, "-c", _DIE_WHILE_TOKENIZING, json.dumps(config.to_dict()),
                         str(tmp_path / "run" / "vocab.model")], capture_output=True, text=True,
                        cwd=os.path.dirname(os.path.dirname(__file__)),
                        env={**os.environ, "AIAYN_TOKENIZE_WORKERS": "1"})
  assert done.returncode == 9, done.stderr
  path = cache.split_dir(config, vocab, "train")
  partial = list(path.parent.glob(path.name + ".parts-*/00000.tmp-*"))   # the one shard, half-written
  assert not path.exists() and len(partial) == 1 and (partial[0] / "src.ids").stat().st_size > 0
  pairs = tokenized(config, vocab)
  assert path.exists() and not partial[0].exists() and len(pairs) == PAIRS
  assert not list(path.parent.glob(path.name + ".parts-*")) and not list(path.parent.glob(path.name + ".tmp*"))
  texts = load_pairs(config, "train")
  for i in (0, 150, PAIRS - 1):   # past the killed build's first chunk too
    np.testing.assert_array_equal(pairs.src[i], vocab.encode(texts[i][0]))
    np.testing.assert_array_equal(pairs.tgt[i], vocab.encode(texts[i][1]))


def test_processes_waiting_on_the_lock_read_the_cache_one_of_them_made(corpus, tmp_path, monkeypatch):
  config = _config(corpus, tmp_path)
  vocab = get_vocab(config, tmp_path / "run")
  assemble, assemblies = cache.assemble, []

  def slow_assemble(*args):
    assemblies.append(1)
    time.sleep(0.5)   # the other waits on the lock meanwhile
    assemble(*args)
  monkeypatch.setattr(cache, "assemble", slow_assemble)
  out = [None, None]
  read = lambda i: out.__setitem__(i, tokenized(config, vocab))
  threads = [threading.Thread(target=read, args=(i,)) for i in (0, 1)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert len(assemblies) == 1
  np.testing.assert_array_equal(out[0].tgt.ids, out[1].tgt.ids)


@pytest.mark.parametrize("pack", [False, True])
def test_two_processes_read_only_their_rows_and_make_the_one_process_batches(corpus, tmp_path, pack):
  config = _config(corpus, tmp_path, pack=pack)
  vocab = get_vocab(config, tmp_path / "run")
  whole = make_train_iterator(config, vocab, seed=1, row_multiple=4)
  parts = [make_train_iterator(config, vocab, seed=1, row_multiple=4, process_index=p, process_count=2)
           for p in (0, 1)]
  read = {}
  for name, it in [("whole", whole), (0, parts[0]), (1, parts[1])]:
    get = it.sequences

    def recording(indices, get=get, name=name):
      read.setdefault(name, []).append(np.asarray(indices).copy())
      return get(indices)
    it.sequences = recording
  for _ in range(6):
    batch = next(whole)
    halves = [next(p) for p in parts]
    for key in batch:
      np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), batch[key])
    mine = [set(read[p][-1].tolist()) for p in (0, 1)]
    assert not mine[0] & mine[1] and mine[0] | mine[1] == set(read["whole"][-1].tolist())
    assert mine[0] and mine[1]


def test_a_resume_on_another_device_count_gets_the_same_batches(corpus, tmp_path):
  config = _config(corpus, tmp_path)
  vocab = get_vocab(config, tmp_path / "run")
  eight = make_train_iterator(config, vocab, seed=2, row_multiple=8)
  stream = [next(eight) for _ in range(5)]
  state = dict(eight.get_state(), index=2)
  two = make_train_iterator(config, vocab, seed=2, row_multiple=2)
  two.set_state(state)
  for expected in stream[2:]:
    got = next(two)
    rows = min(len(got["src"]), len(expected["src"]))
    for key in expected:   # the same pairs in the same rows; only empty padding rows differ
      np.testing.assert_array_equal(got[key][:rows], expected[key][:rows])
      assert not got[key][rows:].any() and not expected[key][rows:].any()


@pytest.mark.parametrize("cap", [None, 7])
def test_cuts_are_the_groups_of_adding_one_pair_at_a_time(cap):
  rng = np.random.default_rng(0)
  src = rng.integers(0, 20, 150_000).astype(np.uint16)   # longer than packing_cuts' window
  tgt = rng.integers(0, 20, 150_000).astype(np.uint16)
  expected, used_src, used_tgt, size = [0], 0, 0, 0
  for i, (s, t) in enumerate(zip(src.tolist(), tgt.tolist())):
    if size and (size == cap or used_src + s > 40 or used_tgt + t + 1 > 40):   # target + EOS
      expected.append(i)
      used_src, used_tgt, size = 0, 0, 0
    used_src, used_tgt, size = used_src + s, used_tgt + t + 1, size + 1
  expected.append(len(src))
  np.testing.assert_array_equal(packing_cuts(src, tgt, 40, cap), expected)
  order = rng.permutation(len(src))[:100_000]
  np.testing.assert_array_equal(packing_cuts(src, tgt, 40, cap, order=order), packing_cuts(src[order], tgt[order], 40, cap))


# ------------------------------------------------------------------------------------------------------
# A damaged cache: each case ends rebuilt with a one-line notice, or in one line naming what to delete.
# ------------------------------------------------------------------------------------------------------
def _truncate(file):
  file.write_bytes(file.read_bytes()[:-3])


def _edit_meta(file, **changes):
  file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def _flip_a_byte(file):
  data = bytearray(file.read_bytes())
  data[len(data) // 2] ^= 0xFF
  file.write_bytes(bytes(data))


@pytest.mark.parametrize("name, damage", [
    ("src.ids", _truncate),                                        # a truncated array
    ("tgt.lengths", _flip_a_byte),                                 # same size, other bytes: the crc32
    ("numbers", lambda file: file.unlink()),                       # a file gone
    ("meta.json", lambda file: file.write_text('{"format": 2, "pai')),   # half-written
    ("meta.json", lambda file: _edit_meta(file, pairs=PAIRS - 1)),     # parses, but counts one pair less
    ("meta.json", lambda file: _edit_meta(file, files=[])),            # parses, but records no file
])
def test_a_damaged_token_cache_is_made_again_with_a_one_line_notice(corpus, tmp_path, capsys, name, damage):
  config = _config(corpus, tmp_path)
  vocab = get_vocab(config, tmp_path / "run")
  path = cache.split_dir(config, vocab, "train")
  whole = tokenized(config, vocab)
  expected = {side: getattr(whole, side).ids.copy() for side in ("src", "tgt")}
  capsys.readouterr()
  damage(path / name)
  assert cache.checked(path)[1] not in (None, "absent")
  again = tokenized(config, vocab)
  notice = [line for line in capsys.readouterr().out.splitlines() if " is damaged " in line]
  assert len(notice) == 1 and str(path) in notice[0] and "making it again" in notice[0]
  assert cache.checked(path)[1] is None and len(again) == len(whole)
  for side in ("src", "tgt"):
    np.testing.assert_array_equal(getattr(again, side).ids, expected[side])
  assert not list(path.parent.glob("*.damaged-*"))


def test_a_damaged_cache_that_cannot_be_moved_aside_is_refused_in_one_line(corpus, tmp_path, monkeypatch):
  config = _config(corpus, tmp_path)
  vocab = get_vocab(config, tmp_path / "run")
  path = cache.split_dir(config, vocab, "train")
  tokenized(config, vocab)
  _truncate(path / "tgt.ids")

  def refused(src, dst):
    raise PermissionError(13, "Permission denied")
  monkeypatch.setattr(cache.os, "replace", refused)
  with pytest.raises(DataError) as error:
    tokenized(config, vocab)
  message = str(error.value)
  assert "\n" not in message and str(path) in message and "tgt.ids" in message and "delete it" in message


@pytest.mark.parametrize("damage", [_truncate, _flip_a_byte, lambda file: file.with_suffix(".json").write_text("{")])
def test_a_damaged_cached_vocabulary_is_trained_again_with_a_one_line_notice(corpus, tmp_path, capsys, damage):
  config = _config(corpus, tmp_path)
  model, info = cache.train_vocab_cached(config)
  (path,) = (tmp_path / "cache").glob("vocab-*.model")
  damage(path)
  capsys.readouterr()
  again, again_info = cache.train_vocab_cached(config)
  notice = [line for line in capsys.readouterr().out.splitlines() if " is damaged " in line]
  assert len(notice) == 1 and str(path) in notice[0] and "training it again" in notice[0]
  assert (again, again_info) == (model, info) and path.read_bytes() == model
  assert vocab_lib.Vocab(again).size == vocab_lib.Vocab(model).size


def test_a_cache_root_that_cannot_be_written_is_refused_in_one_line(corpus, tmp_path):
  (tmp_path / "a_file").write_text("not a folder")
  config = _config(corpus, tmp_path, cache_dir=str(tmp_path / "a_file" / "cache"))   # even root cannot
  for make in (cache.train_vocab_cached, lambda c: tokenized(c, vocab_lib.Vocab(_model(corpus, tmp_path)))):
    with pytest.raises(DataError) as error:
      make(config)
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / "a_file" / "cache") in message
    assert "set AIAYN_DATA_CACHE to a folder you can write" in message and "cannot be written" in message
    assert "config.data.cache_dir" not in message   # no shipped experiment has that key


def _model(corpus, tmp_path):
  return cache.train_vocab_cached(_config(corpus, tmp_path))[0]


# ------------------------------------------------------------------------------------------------------
# Several processes make the cache together (data/shards.py): each tokenizes shards, one assembles them.
# ------------------------------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process of a job: waits for the test's go (so that both start together), then makes or reads the
# cache, tokenizing on its own (no worker processes) so that `settings` can slow it down or SIGKILL it.
_ONE_OF_SEVERAL = """
import json, os, pathlib, signal, sys, time
import logging
import ml_collections
from data import cache, shards, vocab as vocab_lib
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
config, settings = ml_collections.ConfigDict(json.loads(sys.argv[1])), json.loads(sys.argv[3])
vocab = vocab_lib.Vocab.load(sys.argv[2])
shards.SHARD_BYTES, shards.CHUNK = settings["shard_bytes"], settings["chunk"]
shards.POLL_S = 0.05
encode, calls = vocab_lib.Vocab.encode_batch, []
def paced(self, texts, side="source"):
  calls.append(1)
  if len(calls) > settings.get("die_after", 1e9):   # mid-shard: the chunks before it are written
    os.kill(os.getpid(), signal.SIGKILL)
  time.sleep(settings["pause"])
  return encode(self, texts, side)
vocab_lib.Vocab.encode_batch = paced
pathlib.Path(sys.argv[4] + ".ready").touch()
while not os.path.exists(sys.argv[4]):
  time.sleep(0.01)
print(json.dumps({"pairs": len(cache.tokenized(config, vocab))}), flush=True)
"""
SHARDING = {"shard_bytes": 16384, "chunk": 50, "pause": 0.02}   # ~15 shards of ~110 pairs


def _several(config, vocab_path, go, settings):
  """Starts one process per entry of `settings` and lets them go at once. -> [(returncode, output)]."""
  env = {**os.environ, "PYTHONPATH": ROOT, "AIAYN_TOKENIZE_WORKERS": "1"}
  procs = [subprocess.Popen([sys.executable, "-c", _ONE_OF_SEVERAL, json.dumps(config.to_dict()), str(vocab_path),
                             json.dumps({**SHARDING, **s}), str(go) + f".{i}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i, s in enumerate(settings)]
  deadline = time.monotonic() + 120
  while not all(os.path.exists(f"{go}.{i}.ready") for i in range(len(procs))) and time.monotonic() < deadline:
    time.sleep(0.02)
  for i in range(len(procs)):
    pathlib.Path(f"{go}.{i}").touch()
  return [(p.wait(timeout=300), p.stdout.read()) for p in procs]


def _reported(output):
  """The shards a process reported it tokenized ('[data] host:pid tokenized shards 0-2, 5 of 14 of train')."""
  (line,) = [line for line in output.splitlines() if " tokenized shards " in line]
  spans = line.split(" tokenized shards ")[1].split(" of ")[0]
  shards = set()
  for span in ([] if spans == "none" else spans.split(", ")):
    first, _, last = span.partition("-")
    shards |= set(range(int(first), int(last or first) + 1))
  return shards, int(line.split(" of ")[1])


def _files(path):
  return {file.name: file.read_bytes() for file in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def one_process_cache(corpus, tmp_path_factory):
  """The corpus's cache made by one process, with two worker processes, in shards as SHARDING cuts them."""
  tmp_path = tmp_path_factory.mktemp("one")
  config = _config(corpus, tmp_path)
  vocab = get_vocab(config, tmp_path / "run")
  patch = pytest.MonkeyPatch()
  with patch.context() as m:
    m.setenv("AIAYN_TOKENIZE_WORKERS", "2")
    m.setattr(shards, "SHARD_BYTES", SHARDING["shard_bytes"])
    report = cache.build(config, cache.open_split(config, "train"), vocab, cache.split_dir(config, vocab, "train"),
                         "train")
  assert report["assembled"] and report["shards"] >= 10 and report["built"] == list(range(report["shards"]))
  return tmp_path / "run" / "vocab.model", _files(cache.split_dir(config, vocab, "train")), report["shards"]


def _parts(config, vocab):
  path = cache.split_dir(config, vocab, "train")
  return path, list(path.parent.glob(path.name + ".parts-*"))


def test_two_processes_each_tokenize_shards_into_the_one_process_cache(corpus, tmp_path, one_process_cache):
  vocab_path, expected, count = one_process_cache
  config = _config(corpus, tmp_path)
  outcomes = _several(config, vocab_path, tmp_path / "go", [{}, {}])
  assert [code for code, _ in outcomes] == [0, 0], outcomes
  (a, total), (b, _) = [_reported(output) for _, output in outcomes]
  assert a and b and not a & b and a | b == set(range(count)) and total == count   # both, disjoint, all
  assert sum(" assembled " in output for _, output in outcomes) == 1
  path, parts = _parts(config, vocab_lib.Vocab.load(vocab_path))
  assert _files(path) == expected and not parts   # byte for byte; the shards removed


@pytest.mark.parametrize("victim", [0, 1])
def test_a_process_sigkilled_while_tokenizing_leaves_its_shard_to_the_other(corpus, tmp_path, one_process_cache,
                                                                            victim):
  vocab_path, expected, count = one_process_cache
  config = _config(corpus, tmp_path)
  settings = [{}, {}]
  settings[victim] = {"die_after": 7}   # in its second shard (a shard: ~3 chunks, 2 encodes each)
  outcomes = _several(config, vocab_path, tmp_path / "go", settings)
  assert outcomes[victim][0] == -9 and outcomes[1 - victim][0] == 0, outcomes
  taken, _ = _reported(outcomes[1 - victim][1])
  assert 0 < len(taken) < count   # the survivor did the rest, the shard the victim held among it
  path, parts = _parts(config, vocab_lib.Vocab.load(vocab_path))
  assert _files(path) == expected and not parts and not list(path.parent.glob(path.name + ".tmp*"))


def test_a_build_whose_processes_were_all_sigkilled_is_completed_by_the_rerun(corpus, tmp_path, one_process_cache):
  vocab_path, expected, count = one_process_cache
  config = _config(corpus, tmp_path)
  outcomes = _several(config, vocab_path, tmp_path / "go", [{"die_after": 6}, {"die_after": 9}])
  assert [code for code, _ in outcomes] == [-9, -9], outcomes
  path, parts = _parts(config, vocab_lib.Vocab.load(vocab_path))
  whole = {k for k in range(count) if shards.whole(parts[0], k)}
  assert not path.exists() and whole and len(whole) < count and list(parts[0].glob("*.tmp-*"))
  outcomes = _several(config, vocab_path, tmp_path / "again", [{}, {}])
  assert [code for code, _ in outcomes] == [0, 0], outcomes
  (a, _), (b, _) = [_reported(output) for _, output in outcomes]
  assert a | b == set(range(count)) - whole and not a & b   # the whole shards were not made again
  path, parts = _parts(config, vocab_lib.Vocab.load(vocab_path))
  assert _files(path) == expected and not parts


_BUILD_ONE_MILLION = """
import json, logging, sys
import ml_collections
from data import cache, vocab as vocab_lib
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
config = ml_collections.ConfigDict(json.loads(sys.argv[1]))
print(json.dumps({"pairs": len(cache.tokenized(config, vocab_lib.Vocab.load(sys.argv[2])))}), flush=True)
"""


def _parent(pid):
  try:
    return int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
  except (OSError, ValueError, IndexError):
    return None


@pytest.mark.slow
def test_a_million_pairs_by_two_processes_one_sigkilled_equal_one_process(corpus, tmp_path):
  """Two real processes, each with a worker per CPU, make a 1,000,000-pair cache; process 1 is SIGKILLed
  once one of its workers finished a shard and another holds one. Its workers die with it, process 0
  takes its shard over, and the cache equals one process's byte for byte."""
  folder = tmp_path / "million"
  folder.mkdir()
  lines = [line for line in (corpus / "train.tsv").read_text().splitlines() if "\t" in line]
  with open(folder / "train.tsv", "w") as f:
    for start in range(0, 1_000_000, len(lines)):
      f.write("\n".join(lines[:1_000_000 - start]) + "\n")
  (folder / "dev.tsv").write_text((corpus / "dev.tsv").read_text())
  config = _config(folder, tmp_path, cache_dir=str(tmp_path / "two"))
  vocab = get_vocab(config, tmp_path / "run")
  path, _ = _parts(config, vocab)
  env = {k: v for k, v in os.environ.items() if k != "AIAYN_TOKENIZE_WORKERS"} | {"PYTHONPATH": ROOT}
  procs = [subprocess.Popen([sys.executable, "-c", _BUILD_ONE_MILLION, json.dumps(config.to_dict()),
                             str(tmp_path / "run" / "vocab.model")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for _ in range(2)]
  victim, victims_whole, victims_workers, deadline = procs[1], set(), set(), time.monotonic() + 600
  holder = lambda lock: int(lock.read_text().split()[0].rsplit(":", 1)[1]) if lock.read_text() else None
  while time.monotonic() < deadline and victim.poll() is None:
    for parts in path.parent.glob(path.name + ".parts-*"):
      for lock in parts.glob("*.lock"):   # "host:pid since": a worker's, whose parent is the victim?
        if holder(lock) and _parent(holder(lock)) == victim.pid:
          victims_workers.add(holder(lock))
      for meta in parts.glob("*/meta.json"):
        if not meta.parent.name.isdigit():   # a shard still being written, in its temporary folder
          continue
        if int(json.loads(meta.read_text())["by"].rsplit(":", 1)[1]) in victims_workers:
          victims_whole.add(int(meta.parent.name))
      holding = [lock for lock in parts.glob("*.lock")
                 if not shards.whole(parts, int(lock.stem)) and holder(lock) in victims_workers]
      if victims_whole and holding:
        victim.kill()
        break
    time.sleep(0.1)
  assert victim.wait(timeout=60) == -9, victim.stdout.read()
  left = lambda: [pid for pid in victims_workers if _parent(pid) is not None]   # an orphan: a new parent
  deadline = time.monotonic() + 30   # a guard against a hang: they die within moments, however loaded
  while left() and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not left()   # its workers died with it
  survivor = procs[0]
  assert survivor.wait(timeout=900) == 0
  output = survivor.stdout.read()
  taken, count = _reported(output)
  assert taken and not taken & victims_whole and taken | victims_whole == set(range(count)) and count >= 6
  assert json.loads(output.splitlines()[-1])["pairs"] == 1_000_000

  one = _config(folder, tmp_path, cache_dir=str(tmp_path / "one"))
  report = cache.build(one, cache.open_split(one, "train"), vocab, cache.split_dir(one, vocab, "train"), "train")
  assert report["built"] == list(range(count))
  assert _files(path) == _files(cache.split_dir(one, vocab, "train"))


@pytest.mark.parametrize("layout", ["tsv", "tsv.gz", "aligned.gz"])
def test_shards_of_every_file_layout_hold_the_pairs_and_lines_of_one_pass(corpus, tmp_path, monkeypatch, layout):
  """Cut by bytes (one TSV) or by lines (gzipped, two files; read by two worker processes): the pairs,
  their line numbers and the bad lines are the one-pass reader's (FileReader.chunks)."""
  import gzip
  lines = (corpus / "train.tsv").read_text().splitlines()
  lines[20] = "\t"   # an empty side, besides the lines without a tab
  folder = tmp_path / "layout"
  folder.mkdir()
  if layout == "aligned.gz":
    for name, side in (("train.en.gz", 0), ("train.de.gz", 1)):
      with gzip.open(folder / name, "wt") as f:   # the tab-less lines: a source and an empty target
        f.write("".join((line.split("\t") + [""])[side] + "\n" for line in lines))
    spec = f"{folder / 'train.en.gz'},{folder / 'train.de.gz'}"
  else:
    spec = str(folder / f"train.{layout}")
    with (gzip.open if layout.endswith(".gz") else open)(spec, "wt") as f:
      f.write("\n".join(lines) + "\n")
  config = _config(corpus, tmp_path, train_path=spec)
  vocab = get_vocab(_config(corpus, tmp_path), tmp_path / "run")
  monkeypatch.setattr(shards, "SHARD_BYTES", 20_000)
  monkeypatch.setattr(shards, "SHARD_LINES", 130)
  monkeypatch.setenv("AIAYN_TOKENIZE_WORKERS", "2" if layout == "aligned.gz" else "1")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pairs = tokenized(config, vocab)
    texts, origins = load_pairs_with_origins(config, "train")
  told = [str(w.message) for w in caught if "skipped" in str(w.message)]
  assert len(told) == 2 and told[0] == told[1]   # the cache's report is the one pass's
  assert len(pairs) == len(texts) == PAIRS - 1
  assert [pairs.origin(i) for i in range(len(pairs))] == origins
  for i in (0, 19, 20, 500, len(texts) - 1):
    np.testing.assert_array_equal(pairs.src[i], vocab.encode(texts[i][0]))
    np.testing.assert_array_equal(pairs.tgt[i], vocab.encode(texts[i][1]))


def test_two_files_that_are_not_line_aligned_are_refused_by_the_shard_that_finds_it(corpus, tmp_path, monkeypatch):
  a, b = tmp_path / "a.txt", tmp_path / "b.txt"
  a.write_text("x\n" * 1000)
  b.write_text("y\n" * 1003)
  config = _config(corpus, tmp_path, train_path=f"{a},{b}")
  vocab = get_vocab(_config(corpus, tmp_path), tmp_path / "run")
  monkeypatch.setattr(shards, "SHARD_LINES", 100)
  monkeypatch.setenv("AIAYN_TOKENIZE_WORKERS", "2")
  with pytest.raises(DataError) as error:
    tokenized(config, vocab)
  assert str(error.value) == (f"config.data.train_path: {a} has 1000 lines but {b} has 1003; the two files must "
                              f"be line-aligned")


def test_a_wait_for_a_shard_another_process_holds_says_which_and_who(corpus, tmp_path, monkeypatch, capsys):
  config = _config(corpus, tmp_path)
  vocab = get_vocab(config, tmp_path / "run")
  for name, value in (("SHARD_BYTES", 16384), ("WAIT_REPORT_S", 0.2), ("POLL_S", 0.05)):
    monkeypatch.setattr(shards, name, value)
  monkeypatch.setenv("AIAYN_TOKENIZE_WORKERS", "1")
  path = cache.split_dir(config, vocab, "train")
  folder = shards.parts_dir(path, shards.plan(cache.open_split(config, "train")))
  folder.mkdir(parents=True)
  claim = shards._Claim(folder, 3)   # shard 3, claimed as another process would claim it
  assert claim.held
  out, said = [], ""
  thread = threading.Thread(target=lambda: out.append(tokenized(config, vocab)))
  thread.start()
  deadline = time.monotonic() + 120
  while " waiting " not in said and time.monotonic() < deadline:
    time.sleep(0.1)
    said += capsys.readouterr().out
  claim.release()   # as if its holder died: the waiting process takes it over
  thread.join()
  said += capsys.readouterr().out
  (waiting, *_) = [line for line in said.splitlines() if " waiting " in line]
  assert "1 shard(s) of train" in waiting and f"shard 3: {shards.me()} for " in waiting
  built, count = _reported(said)
  assert built == set(range(count)) and len(out[0]) == PAIRS


_TRAIN_ON_CPUS = """
import hashlib, os, sys
os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(",")])
from data import synthetic, vocab as vocab_lib
texts = [side for pair in synthetic.generate(1, {"train": 1500})["train"] for side in pair]
model = vocab_lib.train_vocab(texts, 300, seed=0, sample_sentences=3000, model_type="unigram")
print(hashlib.sha256(model).hexdigest())
"""


def test_the_vocabulary_is_the_same_whatever_cpus_the_process_may_use():
  """SentencePiece records its thread count in the model, and a unigram model's pieces depend on it:
  trained on every CPU of this machine and on one, the same bytes."""
  cpus = sorted(os.sched_getaffinity(0))
  digests = {subprocess.run([sys.executable, "-c", _TRAIN_ON_CPUS, ",".join(map(str, allowed))], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                            check=True).stdout for allowed in (cpus, cpus[:1])}
  assert len(digests) == 1
