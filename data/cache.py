"""The tokenized corpus on disk, made once: flat token arrays and offsets that every run memory-maps.

    pairs = tokenized(config.data, vocab, "train")   # data.tokens.TokenPairs over the cache (made if absent)
    model, info = train_vocab_cached(config.data)    # the vocabulary, on a bounded sample (run.get_vocab)

A split's cache is a directory `<cache root>/<split>-<key>/`, the key naming the corpus's fingerprint
(its files' paths, sizes, times and ends, or the TFDS split's files) and the vocabulary's, so a changed
file or vocabulary is never read stale:
    meta.json                 pairs, token counts, dtype, where pairs came from
    src.ids   tgt.ids         every pair's ids end to end (uint16 where the vocabulary fits, else int32)
    src.lengths tgt.lengths   ids per pair (uint16, or int32 for a sentence of 65,528 ids or more)
    src.offsets tgt.offsets   int64 [pairs + 1]: where each pair starts in .ids
    numbers                   int64 [pairs]: the line (files) or record (TFDS) each pair came from
Every process that needs the cache makes its share of it: the split is cut into shards, which every
process tokenizes with a worker per CPU into `<name>.parts-<plan>/` (data/shards.py: a shard is claimed
with fcntl.flock and written whole or not at all, so a killed process's shard is taken over). Then one
process, holding `<name>.lock` (fcntl.flock, on the shared filesystem), assembles the shards, first to
last, into `<name>.tmp-<host>-<pid>/` and renames it when whole: the same bytes whatever the number of
processes that made the shards. A killed assembly leaves a .tmp directory that the next one removes,
never a directory a run would read. The others wait on the lock (saying, every minute, who holds it)
and then read what it made. The root is $AIAYN_DATA_CACHE, else ~/.cache/aiayn/tokens (a config that
declares data.cache_dir, as some tests' do, puts it there; no shipped experiment declares it). The
vocabulary is trained once, by the first process to take its lock, on a bounded sample (`train_vocab_cached`); the others wait on that lock the same way.

Every read checks the entry against what meta.json recorded when it was made (each file's size, and its
crc32 where the file is under CHECKSUM_MAX_BYTES; vocab-<key>.json records the vocabulary's size and
sha256). A damaged entry (truncated, half-written, an unreadable meta.json) is moved aside and made again
with a one-line notice; one that cannot be moved aside, or a root that cannot be written, ends in a
one-line DataError that says what to delete or set. A run never reads tokens that fail the check.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import random
import shutil
import time
import zlib

import numpy as np

from data import shards as shards_lib
from data import vocab as vocab_lib
from data.sources import DataError, open_split, synthetic_tag
from data.tokens import Side, TokenPairs

log = logging.getLogger(__name__)

FORMAT = 2            # bumped when the layout changes: an older cache is then made again (2: checks)
_SIDES = ("src", "tgt")
_FILES = ("src.ids", "tgt.ids", "src.lengths", "tgt.lengths", "src.offsets", "tgt.offsets", "numbers")
CHECKSUM_MAX_BYTES = 64 << 20   # a file up to this size is checksummed at every read; a larger one by size


def cache_root(data_config) -> pathlib.Path:
  root = (data_config.get("cache_dir", "") or os.environ.get("AIAYN_DATA_CACHE")
          or pathlib.Path.home() / ".cache" / "aiayn" / "tokens")
  return pathlib.Path(root)


def _key(*parts) -> str:
  return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: pathlib.Path, what: str):
  """Holds an exclusive flock on `path`, waiting while another process holds it and saying who, every
  shards_lib.WAIT_REPORT_S. Raises DataError when the cache root cannot be written."""
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")
  except OSError as error:
    raise DataError(f"the data cache {path.parent} cannot be written ({error.strerror or error}): set "
                    f"AIAYN_DATA_CACHE to a folder you can write (e.g. AIAYN_DATA_CACHE=$HOME/aiayn_tokens "
                    f"python -m train ...)") from None
  with handle:
    start, reported = time.monotonic(), None
    while True:
      try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
      except BlockingIOError:
        now = time.monotonic()
        if reported is None or now - reported >= shards_lib.WAIT_REPORT_S:
          try:
            who, since = path.read_text().split()
            held = f"{who} has been making it for {time.time() - float(since):.0f} s"
          except (OSError, ValueError):
            held = "another process is making it"
          log.info(f"[data] waiting for {what}: {held} (waited {now - start:.0f} s; {path})")
          reported = now
        time.sleep(shards_lib.POLL_S)
    try:
      handle.seek(0)
      handle.truncate()
      handle.write(f"{shards_lib.me()} {time.time():.0f}\n")   # for the messages of those who wait
      handle.flush()
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)


def split_dir(data_config, vocab, split: str, reader=None) -> pathlib.Path:
  """Where the cache of `split` tokenized with `vocab` lives (whether or not it has been made)."""
  reader = reader or open_split(data_config, split)
  key = _key(FORMAT, reader.fingerprint(), vocab.fingerprint, data_config.src_lang, data_config.tgt_lang)
  return cache_root(data_config) / f"{split}-{key}"


def tokenized(data_config, vocab, split: str = "train", progress: bool = True) -> TokenPairs:
  """The split tokenized with vocab, memory-mapped from its cache; made first if absent or damaged (see
  the module docstring), this process tokenizing its share, reporting bad lines by file:line and, if
  progress, showing the shards as they are made."""
  reader = open_split(data_config, split)
  path = split_dir(data_config, vocab, split, reader)
  meta, problem = checked(path)
  if problem:
    build(data_config, reader, vocab, path, split, progress)
    meta, problem = checked(path)
  if problem:   # just made, and already failing its check: the disk is at fault, not the cache
    raise DataError(f"the token cache {path} fails its check right after it was made ({problem}): "
                    f"delete it and check the disk under {path.parent}")
  return _open(path, meta)


def build(data_config, reader, vocab, path: pathlib.Path, split: str, progress: bool = True) -> dict:
  """Makes the cache at `path` with the other processes that call it (module docstring): a damaged one
  set aside, this process's share of the shards tokenized, then the shards assembled by whichever process
  takes the lock first. -> {"built": the shards this process tokenized, "shards", "assembled": whether
  this process assembled them, "parts_s", "assembly_s"}."""
  lock = path.with_name(path.name + ".lock")
  with _locked(lock, f"the token cache of {split}"):
    problem = _set_aside_if_damaged(path)
  if not problem:
    return {"built": [], "shards": 0, "assembled": False, "parts_s": 0.0, "assembly_s": 0.0}
  made = shards_lib.make_parts(data_config, reader, vocab, path, split, progress)
  start, assembled = time.perf_counter(), False
  with _locked(lock, f"the token cache of {split}"):
    if _set_aside_if_damaged(path):   # another process may have assembled it while we waited
      assemble(reader, vocab, path, split, made["folder"], made["parts"])
      assembled = True
  shutil.rmtree(made["folder"], ignore_errors=True)   # whole: the shards are no longer needed
  return {"built": made["built"], "shards": made["shards"], "assembled": assembled,
          "parts_s": made["seconds"], "assembly_s": time.perf_counter() - start}


def _set_aside_if_damaged(path: pathlib.Path) -> str | None:
  """checked(path)'s problem, None if the cache is whole; a damaged cache is moved aside first."""
  _, problem = checked(path)
  if problem and path.exists():
    log.info(f"[data] the token cache {path} is damaged ({problem}); making it again")
    _set_aside(path, problem)
  return problem


def _crc32(path: pathlib.Path) -> int:
  crc = 0
  with open(path, "rb") as f:
    while block := f.read(1 << 20):
      crc = zlib.crc32(block, crc)
  return crc


def _sizes(meta: dict) -> dict:
  """{file: the bytes it must have} by meta.json's counts and dtypes."""
  n = int(meta["pairs"])
  sizes = {"numbers": 8 * n}
  for side in _SIDES:
    sizes[f"{side}.ids"] = np.dtype(meta["dtype"]).itemsize * int(meta["tokens"][side])
    sizes[f"{side}.offsets"] = 8 * (n + 1)
    sizes[f"{side}.lengths"] = np.dtype(meta["length_dtype"][side]).itemsize * n
  return sizes


def checked(path) -> tuple[dict | None, str | None]:
  """(meta, None) for a whole cache directory; (None, what is wrong) for one that is absent or fails the
  check against its meta.json: each file's size as recorded and as the counts imply, and its crc32 where
  the file is at most CHECKSUM_MAX_BYTES."""
  path = pathlib.Path(path)
  if not path.exists():
    return None, "absent"
  try:
    meta = json.loads((path / "meta.json").read_text())
    if meta["format"] != FORMAT:
      return None, f"meta.json says format {meta['format']}, not {FORMAT}"
    sizes = _sizes(meta)
    records = {name: (int(meta["files"][name]["bytes"]), int(meta["files"][name]["crc32"])) for name in _FILES}
  except FileNotFoundError:
    return None, "meta.json is missing"
  except (OSError, ValueError, KeyError, TypeError) as error:
    return None, f"meta.json is unreadable: {type(error).__name__}"
  for name in _FILES:
    (recorded, crc), file = records[name], path / name
    try:
      size = file.stat().st_size
      if size != recorded or size != sizes[name]:
        return None, f"{name} has {size} bytes, {recorded} recorded, {sizes[name]} by the counts"
      if size <= CHECKSUM_MAX_BYTES and _crc32(file) != crc:
        return None, f"{name} does not match its recorded crc32"
    except OSError as error:
      return None, f"{name} is unreadable: {error.strerror or type(error).__name__}"
  return meta, None


def _set_aside(path: pathlib.Path, problem: str) -> None:
  """Moves a damaged cache directory out of the way (then deletes it); refuses in one line if it cannot."""
  aside = path.with_name(f"{path.name}.damaged-{os.getpid()}")
  try:
    os.replace(path, aside)
  except OSError as error:
    raise DataError(f"the token cache {path} is damaged ({problem}) and cannot be moved aside "
                    f"({error.strerror or error}): delete it and run again") from None
  shutil.rmtree(aside, ignore_errors=True)


def _open(path: pathlib.Path, meta: dict) -> TokenPairs:
  n = int(meta["pairs"])
  # Plain ndarray views of the maps: np.memmap's own indexing costs more than a batch's gathers.
  mapped = lambda name, dtype, count: (np.asarray(np.memmap(path / name, dtype, "r", shape=(count,)))
                                       if count else np.zeros(0, dtype))
  sides = [Side(mapped(f"{side}.ids", meta["dtype"], meta["tokens"][side]),
                mapped(f"{side}.offsets", np.int64, n + 1),
                mapped(f"{side}.lengths", meta["length_dtype"][side], n)) for side in _SIDES]
  numbers = mapped("numbers", np.int64, n)
  return TokenPairs(*sides, origin=lambda i: meta["origin"].format(int(numbers[i])))


class _Writer:
  """A file written once, end to end, with its size and crc32 counted as it goes."""

  def __init__(self, path: pathlib.Path):
    self.file, self.bytes, self.crc32 = open(path, "wb"), 0, 0

  def write(self, array: np.ndarray) -> None:
    data = np.ascontiguousarray(array).tobytes()
    self.file.write(data)
    self.bytes += len(data)
    self.crc32 = zlib.crc32(data, self.crc32)

  def close(self) -> None:
    self.file.flush()
    os.fsync(self.file.fileno())
    self.file.close()


def assemble(reader, vocab, path: pathlib.Path, split: str, folder: pathlib.Path, parts) -> None:
  """The cache at `path` from the whole shards in `folder`, first to last (the caller holds the lock):
  ids end to end, offsets and line numbers shifted by the shards before, lengths uint16 where every one
  of the split fits. Reports the split's bad lines once, as a one-process read would."""
  metas = shards_lib.assemble_order(folder, parts)
  pairs = sum(m["pairs"] for m in metas)
  bad, base = {}, 0   # bad: reason -> [count, the first few line numbers of the split]
  for meta in metas:
    for reason, (count, numbers) in meta["bad"].items():
      count_numbers = bad.setdefault(reason, [0, []])
      count_numbers[0] += count
      count_numbers[1] += [base + n for n in numbers][:max(0, 5 - len(count_numbers[1]))]
    base += meta["lines"]
  if bad and hasattr(reader, "report"):
    reader.report(bad)
  if not pairs and hasattr(reader, "no_pairs"):
    raise reader.no_pairs(bad)
  for stale in path.parent.glob(f"{path.name}.tmp*"):   # a killed assembly's; we hold the lock
    shutil.rmtree(stale, ignore_errors=True)
  tmp = path.with_name(f"{path.name}.tmp-{shards_lib.me().replace(':', '-')}")
  tmp.mkdir(parents=True)
  dtype = np.uint16 if vocab.size <= 2 ** 16 else np.int32
  longest = {side: max((m["longest"][side] for m in metas), default=0) for side in _SIDES}
  # uint16 lengths where every one fits, with room for the few ids a task adds (data.tasks.lengths)
  length_dtypes = {side: "uint16" if longest[side] < 2 ** 16 - 8 else "int32" for side in _SIDES}
  out = {name: _Writer(tmp / name) for name in _FILES}
  totals, base = {"src": 0, "tgt": 0}, 0
  for side in _SIDES:
    out[f"{side}.offsets"].write(np.zeros(1, np.int64))
  for meta in metas:
    shard = folder / f"{meta['shard']:05d}"
    for side in _SIDES:
      out[f"{side}.ids"].write(np.fromfile(shard / f"{side}.ids", dtype))                  # [shard tokens]
      lengths = np.fromfile(shard / f"{side}.lengths", np.int32)                           # [shard pairs]
      out[f"{side}.offsets"].write(totals[side] + np.cumsum(lengths, dtype=np.int64))
      out[f"{side}.lengths"].write(lengths.astype(length_dtypes[side]))
      totals[side] += int(meta["tokens"][side])
    out["numbers"].write(base + np.fromfile(shard / "numbers", np.int64))
    base += meta["lines"]
  for writer in out.values():
    writer.close()
  meta = {"format": FORMAT, "split": split, "pairs": pairs, "tokens": totals, "dtype": np.dtype(dtype).name,
          "length_dtype": length_dtypes, "origin": reader.origin, "vocab": vocab.fingerprint,
          "corpus": reader.fingerprint(),
          "files": {name: {"bytes": out[name].bytes, "crc32": out[name].crc32} for name in _FILES}}
  with open(tmp / "meta.json", "w") as f:
    f.write(json.dumps(meta, indent=1) + "\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  log.info(f"[data] assembled {len(metas)} shards: {pairs:,} {split} pairs ({totals['src']:,} + "
           f"{totals['tgt']:,} tokens) into {path}")


def vocab_sample(data_config, sample_sentences: int, seed: int):
  """(texts, corpus pairs): the training sentences a vocabulary is trained on, source and target of
  every pair counted as two sentences, `sample_sentences` of them drawn as random.Random(seed).sample
  draws from the whole list (all of them, in order, if there are fewer), without holding the corpus:
  one pass counts the pairs (files; TFDS splits know their size), one collects the drawn sentences."""
  reader = open_split(data_config, "train")
  pairs = reader.size
  if pairs is None:
    pairs = sum(len(chunk) for chunk, _ in reader.chunks(report=False))
  texts = 2 * pairs
  drawn = (list(range(texts)) if texts <= sample_sentences
           else random.Random(seed).sample(range(texts), sample_sentences))   # [text index], in draw order
  if hasattr(reader, "take"):
    wanted = sorted({i // 2 for i in drawn})
    found = dict(zip(wanted, reader.take(wanted)))
  else:
    wanted, found, seen = {i // 2 for i in drawn}, {}, 0
    for chunk, _ in reader.chunks(report=False):
      found.update((seen + j, pair) for j, pair in enumerate(chunk) if seen + j in wanted)
      seen += len(chunk)
  return [found[i // 2][i % 2] for i in drawn], pairs


def _cached_vocab(path: pathlib.Path) -> tuple[bytes | None, dict | None, str | None]:
  """(model bytes, info, None) for a whole cached vocabulary; (None, None, what is wrong) for one that is
  absent or does not match the size and sha256 its .json recorded."""
  record_path = path.with_suffix(".json")
  if not path.exists() and not record_path.exists():
    return None, None, "absent"
  try:
    record, model = json.loads(record_path.read_text()), path.read_bytes()
    info, size, digest = record["info"], record["bytes"], record["sha256"]
  except (OSError, ValueError, KeyError, TypeError) as error:
    return None, None, f"{type(error).__name__} reading it or its .json"
  if len(model) != size or hashlib.sha256(model).hexdigest() != digest or not isinstance(info, dict):
    return None, None, f"{len(model)} bytes that do not match its record ({size} bytes, a sha256, the info)"
  return model, info, None


def train_vocab_cached(data_config):
  """(model bytes, info): the vocabulary config.data describes, trained on `vocab_sample` of the
  training split; taken from the cache root where a run with the same corpus and settings made it
  (sweep trials, a new run directory) and it matches its record, else trained and kept there (a damaged
  one again, with a one-line notice). info records the sample."""
  settings = {key: data_config.get(key, default) for key, default in (
      ("vocab_size", 0), ("vocab_seed", 0), ("vocab_sample_sentences", 0), ("vocab_model_type", "bpe"))}
  reader = open_split(data_config, "train")
  # The synthetic pairs' tag is a piece of its own (data/mixing.py); without one the key is as it was.
  reserved = (synthetic_tag(data_config),) if synthetic_tag(data_config) else ()
  key = _key(FORMAT, reader.fingerprint(), data_config.src_lang, data_config.tgt_lang, *settings.values(),
             *reserved)
  path = cache_root(data_config) / f"vocab-{key}.model"
  model, info, problem = _cached_vocab(path)
  if not problem:
    return model, info
  with _locked(path.with_suffix(".lock"), "the vocabulary"):
    model, info, problem = _cached_vocab(path)   # another process may have made it while we waited
    if not problem:
      return model, info
    if problem != "absent":
      log.info(f"[data] the cached vocabulary {path} is damaged ({problem}); training it again")
    texts, pairs = vocab_sample(data_config, int(settings["vocab_sample_sentences"]),
                                int(settings["vocab_seed"]))
    size = int(settings["vocab_size"]) or vocab_lib.auto_vocab_size(pairs)   # 0: by corpus size
    model = vocab_lib.train_vocab(texts, size, seed=int(settings["vocab_seed"]),
                                  sample_sentences=len(texts), model_type=settings["vocab_model_type"],
                                  reserved=reserved)
    info = {**settings, "pieces": size, "corpus_pairs": pairs, "corpus_sentences": 2 * pairs,
            "sample_sentences": len(texts), **({"reserved": list(reserved)} if reserved else {})}
    # The record first, then the model: a crash between them leaves a pair that fails the check.
    record = {"info": info, "bytes": len(model), "sha256": hashlib.sha256(model).hexdigest()}
    path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(model)
    os.replace(tmp, path)
    return model, info
