"""Where parallel text comes from: the embedded corpus, a named TFDS corpus, or your own files.

    pairs = load_pairs(config.data, "dev")       # [(source_text, target_text)]
    for pairs, numbers in open_split(config.data, "train").chunks(): ...   # a chunk at a time

config.data.source selects: "synthetic" (generated, prepared once as a TFDS dataset), "tfds" (e.g.
"wmt14_translate/de-en", prepared beforehand by `python -m data.prepare NAME --data_dir DIR`), "files" (TSV,
or two line-aligned files joined by a comma, optionally gzipped) or "tfds_or_synthetic" ("tfds" where
config.data.tfds_data_dir is set, "synthetic" otherwise: the WMT experiments' smoke variants, offline by
default, a check of prepared WMT data with tfds_data_dir). src_lang/tgt_lang pick the direction for both
TFDS sources.
"""
from __future__ import annotations

import gzip
import hashlib
import itertools
import logging
import os
import pathlib
import warnings

import tqdm

log = logging.getLogger(__name__)

SOURCES = ("synthetic", "tfds", "files", "tfds_or_synthetic")
SPLITS = ("train", "dev", "test")
SYNTHETIC = "synthetic"   # the split name of config.data.synthetic_path's pairs (data/mixing.py)
DEFAULT_TAG = "<BT>"      # the synthetic sources' tag where config.data.synthetic_tag is not set
TFDS_SPLITS = {"train": "train", "dev": "validation", "test": "test"}  # wmt14: newstest2013 / 2014
_SHOW_BAD = 5   # how many bad lines a warning names


class DataError(ValueError):
  """Bad data or data settings; the message names the file, line or key and what to do."""


def resolved_source(data_config) -> str:
  """config.data.source, with "tfds_or_synthetic" resolved: "tfds" where config.data.tfds_data_dir is set,
  "synthetic" otherwise."""
  source = data_config.source
  if source == "tfds_or_synthetic":
    return "tfds" if data_config.get("tfds_data_dir", "") else "synthetic"
  return source


def check_config(data_config) -> None:
  """Fails fast, before any work, on an unknown source, split files that are missing or a bad max_len."""
  source = data_config.source
  max_len = data_config.get("max_len", 0)
  if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0:
    raise DataError(f"config.data.max_len={max_len!r}: use a positive number of tokens per side, or 0 to "
                    f"derive it from the training corpus (data/max_len.py)")
  if source not in SOURCES:
    raise DataError(f"config.data.source={source!r} is not one of {SOURCES}")
  if source == "files":
    for split in SPLITS:
      key = f"{split}_path"
      value = data_config.get(key, "")
      if not value:
        raise DataError(f"config.data.source='files' needs config.data.{key} (a TSV path, or two "
                        f"line-aligned paths joined by a comma)")
      for path in value.split(","):
        if not os.path.exists(path):
          raise DataError(f"config.data.{key}: file {path!r} does not exist")
  if resolved_source(data_config) == "tfds":
    _tfds_builder(data_config)
  _check_synthetic(data_config)


def synthetic_path(data_config) -> str:
  """config.data.synthetic_path (data/mixing.py), "" where the config has no such key."""
  return data_config.get("synthetic_path", "") or ""


def synthetic_tag(data_config) -> str:
  """config.data.synthetic_tag: the piece prepended to synthetic sources and reserved in the vocabulary;
  "<BT>" where synthetic_path is set and the key is not, "" (no tag, no reserved piece) otherwise."""
  return data_config.get("synthetic_tag", DEFAULT_TAG if synthetic_path(data_config) else "") or ""


def _check_synthetic(data_config) -> None:
  """The synthetic pairs' files exist and can be read; the tag is one word. One-line DataErrors."""
  tag = synthetic_tag(data_config)
  if tag and (tag.split() != [tag] or tag in ("<pad>", "<unk>", "<s>", "</s>")):
    raise DataError(f"config.data.synthetic_tag={tag!r}: use one word without spaces that no sentence "
                    f"holds, e.g. {DEFAULT_TAG!r}, or '' to turn tagging off")
  spec = synthetic_path(data_config)
  if not spec:
    return
  for path in spec.split(","):
    if not os.path.exists(path):
      raise DataError(f"config.data.synthetic_path: file {path!r} does not exist")
    if not os.path.isfile(path):
      raise DataError(f"config.data.synthetic_path: {path!r} is not a file; give a TSV of pairs, or the "
                      f"source and target files joined by a comma")
    try:
      with open(path, "rb") as file:
        file.read(1)
    except OSError as error:
      raise DataError(f"config.data.synthetic_path: file {path!r} cannot be read ({error.strerror})") from None


def load_pairs(data_config, split: str) -> list[tuple[str, str]]:
  """All (source, target) pairs of a split ('train', 'dev' or 'test') as strings. For the small splits
  (dev, test): the training split is read in chunks (`open_split`) and tokenized once (data/cache.py)."""
  return load_pairs_with_origins(data_config, split)[0]


def load_pairs_with_origins(data_config, split: str):
  """(pairs, origins): origins[i] names where pair i came from (e.g. 'train.tsv:17') for messages."""
  reader = open_split(data_config, split)
  pairs, origins = [], []
  for part, numbers in reader.chunks():
    pairs += part
    origins += [reader.origin.format(n) for n in numbers]
  return pairs, origins


def open_split(data_config, split: str):
  """A reader of one split: .chunks(report=True) yields (pairs, numbers) a chunk at a time (numbers:
  the line of a file, the record of a TFDS split, which .origin formats), .fingerprint() names its
  content for caches, .size is its number of pairs where known without reading it (TFDS), else None."""
  if split not in SPLITS + (SYNTHETIC,):
    raise DataError(f"unknown split {split!r}; use one of {SPLITS + (SYNTHETIC,)}")
  check_config(data_config)
  if split == SYNTHETIC:
    if not synthetic_path(data_config):
      raise DataError("config.data.synthetic_path is not set: there is no synthetic split to read")
    return FileReader(synthetic_path(data_config), "config.data.synthetic_path")
  if data_config.source == "files":
    return FileReader(data_config.get(f"{split}_path"), f"config.data.{split}_path")
  if resolved_source(data_config) == "synthetic":
    from data import synthetic_tfds
    builder = synthetic_tfds.builder(data_config.get("synthetic_seed", 0),
                                     data_config.get("synthetic_train_size", 200_000),
                                     data_config.get("tfds_data_dir", "") or None)
    if not builder.is_prepared():
      log.info(f"[data] generating the embedded corpus into {builder.data_dir} (once)")
      import tensorflow_datasets as tfds
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tfds.disable_progress_bar()
        builder.download_and_prepare()
    name = synthetic_tfds.NAME
  else:
    builder = _tfds_builder(data_config)
    name = data_config.tfds_name
  return TfdsReader(builder, name, TFDS_SPLITS[split], data_config.src_lang, data_config.tgt_lang)


def _tfds_builder(data_config):
  import tensorflow_datasets as tfds
  name, data_dir = data_config.tfds_name, data_config.get("tfds_data_dir", "") or None
  prepare = (f"On a machine with internet run: python -m data.prepare {name} --data_dir DIR, then set "
             f"config.data.tfds_data_dir=DIR (REPRODUCING.md)")
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # noqa: BLE001 - DatasetNotFoundError (its module is not imported) and friends
    first = " ".join(str(e).split())[:160]
    where = data_dir or "~/tensorflow_datasets"
    raise DataError(f"config.data.tfds_name={name!r} is not prepared in {where} (tensorflow-datasets: "
                    f"{type(e).__name__}: {first}). {prepare}") from None
  if not builder.is_prepared():
    raise DataError(f"config.data.tfds_name={name!r} is not prepared in {builder.data_dir}. {prepare}")
  return builder


class TfdsReader:
  """One split of a prepared TFDS translation dataset (array_record), read with tfds.data_source."""

  def __init__(self, builder, name, split, src_lang, tgt_lang):
    languages = set(getattr(builder.info.features, "languages", None) or builder.info.features.keys())
    for key, lang in (("src_lang", src_lang), ("tgt_lang", tgt_lang)):
      if lang not in languages:
        raise DataError(f"config.data.{key}={lang!r}: dataset {name!r} has languages {sorted(languages)}")
    if split not in builder.info.splits:
      raise DataError(f"dataset {name!r} has no split {split!r} (it has {sorted(builder.info.splits)})")
    try:
      self._source = builder.as_data_source(split)
    except Exception as e:
      raise DataError(f"dataset {name!r} split {split!r} cannot be read with tfds.data_source ({e}); "
                      f"prepare it with --file_format array_record") from e
    self.builder, self.split, self.langs = builder, split, (src_lang, tgt_lang)
    self.origin, self.size = f"{name}:{split}[{{}}]", len(self._source)

  def fingerprint(self) -> str:
    """The dataset's directory, version and the names, sizes and times of the split's files."""
    path = pathlib.Path(self.builder.data_path)
    files = sorted(path.glob(f"*-{self.split}.*"))
    return _digest([str(path.absolute()), str(self.builder.version), self.split, *self.langs,
                    *(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)])

  def chunks(self, report: bool = True, size: int = 10_000):
    del report   # a prepared TFDS split has no bad records to report
    decode = lambda x: x.decode("utf-8") if isinstance(x, bytes) else str(x)
    src_lang, tgt_lang = self.langs
    for start in range(0, self.size, size):   # batched reads: ~15x faster than one record at a time
      indices = list(range(start, min(start + size, self.size)))
      records = self._source.__getitems__(indices)
      yield [(decode(r[src_lang]).strip(), decode(r[tgt_lang]).strip()) for r in records], indices

  def parts(self, unit: int) -> "Parts":
    """The plan of shards: every `unit` records (the last one shorter)."""
    return Parts(self, "records", unit, max(1, -(-self.size // unit)))

  def read_part(self, parts: "Parts", k: int, size: int = 10_000):
    """Yields (pairs, numbers within shard k) a chunk at a time; returns (records, {} bad, ends here)."""
    start, stop = k * parts.unit, min((k + 1) * parts.unit, self.size)
    for pairs, indices in self._chunks_at(list(range(start, stop)), size):
      yield pairs, [i - start for i in indices]
    return max(0, stop - start), {}, k == parts.count - 1

  def take(self, indices) -> list[tuple[str, str]]:
    """The pairs at `indices` (any order), read directly."""
    out = {}
    for pairs, numbers in self._chunks_at(sorted(set(indices))):
      out.update(zip(numbers, pairs))
    return [out[i] for i in indices]

  def _chunks_at(self, indices, size=10_000):
    decode = lambda x: x.decode("utf-8") if isinstance(x, bytes) else str(x)
    src_lang, tgt_lang = self.langs
    for start in range(0, len(indices), size):
      part = indices[start:start + size]
      records = self._source.__getitems__(part)
      yield [(decode(r[src_lang]).strip(), decode(r[tgt_lang]).strip()) for r in records], part


def _digest(parts) -> str:
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------
# Files.
# ---------------------------------------------------------------------------------------------------

def _open_lines(path):
  opener = gzip.open if str(path).endswith(".gz") else open
  with opener(path, "rb") as f:
    for raw in f:
      yield raw.rstrip(b"\r\n")


def read_files(spec: str, key: str):
  """spec: 'pairs.tsv[.gz]' or 'src.txt[.gz],tgt.txt[.gz]'. Returns (pairs, origins).

  Empty lines, lines without exactly one tab, undecodable UTF-8: skipped, counted, the first few named.
  """
  reader, pairs, origins = FileReader(spec, key), [], []
  for part, numbers in reader.chunks():
    pairs += part
    origins += [reader.origin.format(n) for n in numbers]
  return pairs, origins


class FileReader:
  """Your own parallel text: one TSV, or two line-aligned files (see read_files)."""

  _PROBE = 1 << 16   # bytes hashed at each end of a file for its fingerprint

  def __init__(self, spec: str, key: str):
    self.paths, self.key, self.spec, self.size = spec.split(","), key, spec, None
    if len(self.paths) > 2:
      raise DataError(f"{key}={spec!r}: give one TSV path or two paths joined by a comma")
    for path in self.paths:
      if not pathlib.Path(path).exists():
        raise DataError(f"{key}: file {path!r} does not exist")
    self.origin = f"{self.paths[0]}:{{}}"

  def fingerprint(self) -> str:
    """Each file's absolute path, size, modification time and first and last 64 KiB: a file that is
    edited, replaced or appended to gets a new fingerprint without being read whole."""
    parts = []
    for path in self.paths:
      path = pathlib.Path(path).absolute()
      stat = path.stat()
      with open(path, "rb") as f:
        head = f.read(self._PROBE)
        f.seek(max(0, stat.st_size - self._PROBE))
        tail = f.read(self._PROBE)
      parts += [str(path), str(stat.st_size), str(stat.st_mtime_ns), hashlib.sha256(head + tail).hexdigest()]
    return _digest(parts)

  def chunks(self, report: bool = True, size: int = 20_000):
    """Yields (pairs, line numbers) `size` pairs at a time; bad lines are skipped and, if report,
    counted and named once at the end. A file without a usable pair raises DataError."""
    bad, part, numbers, kept = {}, [], [], 0   # bad: reason -> [count, the first few line numbers]
    lines = self._aligned() if len(self.paths) == 2 else self._numbered(_open_lines(self.paths[0]))
    for number, src, tgt in self._usable(lines, bad):
      part.append((src, tgt))
      numbers.append(number)
      if len(part) == size:
        kept += len(part)
        yield part, numbers
        part, numbers = [], []
    kept += len(part)
    if part:
      yield part, numbers
    if report:
      self.report(bad)
    if not kept:
      raise self.no_pairs(bad)

  def report(self, bad: dict, base: int = 0) -> None:
    """Warns once about the bad lines `bad` counts (reason -> [count, first few line numbers - base])."""
    report_skipped({reason: (count, [self.origin.format(base + n) for n in numbers])
                    for reason, (count, numbers) in bad.items()}, self.key)

  def no_pairs(self, bad: dict) -> DataError:
    return DataError(f"{self.key}={self.spec!r}: no usable sentence pairs (skipped: "
                     f"{', '.join(f'{v[0]} {k}' for k, v in bad.items()) or 'none'}); expected "
                     f"'source<TAB>target' lines or two line-aligned files")

  @staticmethod
  def _numbered(lines, first: int = 1):
    return ((number, raw, None) for number, raw in enumerate(lines, first))

  @staticmethod
  def _usable(lines, bad: dict):
    """(number, source, target) of the usable lines of (number, raw line, raw target line or None);
    the others are counted in bad (reason -> [count, the first few numbers])."""
    def reject(reason, number):
      count_numbers = bad.setdefault(reason, [0, []])
      count_numbers[0] += 1
      if len(count_numbers[1]) < _SHOW_BAD:
        count_numbers[1].append(number)

    for number, raw, raw_tgt in lines:
      try:
        line = raw.decode("utf-8")
        other = None if raw_tgt is None else raw_tgt.decode("utf-8")
      except UnicodeDecodeError:
        reject("undecodable UTF-8", number)
        continue
      if other is None:
        if not line.strip():
          reject("empty line", number)
          continue
        fields = line.split("\t")
        if len(fields) != 2:
          reject("no tab" if len(fields) == 1 else "more than one tab", number)
          continue
        src, tgt = fields[0].strip(), fields[1].strip()
        if not src or not tgt:
          reject("empty side", number)
          continue
      else:
        src, tgt = line.strip(), other.strip()
        if not src or not tgt:
          reject("empty line", number)
          continue
      yield number, src, tgt

  def _aligned(self, skip: int = 0, files=None):
    """(number, source line, target line) of two line-aligned files, read side by side from line
    skip + 1 (of `files`, two iterators of raw lines, where given)."""
    src_path, tgt_path = self.paths
    src_lines, tgt_lines = files or (_open_lines(src_path), _open_lines(tgt_path))
    number = skip
    for number, (s, t) in enumerate(itertools.zip_longest(src_lines, tgt_lines), skip + 1):
      if s is None or t is None:
        raise self._misaligned(number - 1 + (s is not None) + sum(1 for _ in src_lines),
                               number - 1 + (t is not None) + sum(1 for _ in tgt_lines))
      yield number, s, t

  def _misaligned(self, src_count: int, tgt_count: int) -> DataError:
    src_path, tgt_path = self.paths
    return DataError(f"{self.key}: {src_path} has {src_count} lines but {tgt_path} has {tgt_count}; "
                     f"the two files must be line-aligned")

  # Shards (data/shards.py): one uncompressed file is cut by bytes, so that a shard is read from a seek;
  # gzipped or two line-aligned files by lines, read forward (a cursor skips to a later shard).
  def parts(self, unit_bytes: int, unit_lines: int) -> "Parts":
    """The plan of shards: the lines that start in each `unit_bytes` of one uncompressed file, else
    every `unit_lines` lines (how many, only reading to the end tells)."""
    if len(self.paths) == 1 and not str(self.paths[0]).endswith(".gz"):
      return Parts(self, "bytes", unit_bytes, max(1, -(-os.path.getsize(self.paths[0]) // unit_bytes)))
    return Parts(self, "lines", unit_lines, None)

  def read_part(self, parts: "Parts", k: int, size: int = 20_000):
    """Yields (pairs, line numbers within shard k, from 1) `size` pairs at a time; returns (the lines
    the shard spans, bad: reason -> [count, the first few numbers within the shard], the file ends in
    it). A two-file split that is not line-aligned raises DataError."""
    if parts.kind == "bytes":
      lines = self._numbered(_lines_between(self.paths[0], k * parts.unit, (k + 1) * parts.unit))
    else:
      lines = parts.cursor().lines(k * parts.unit, parts.unit)
    bad, part, numbers, last = {}, [], [], 0

    def spanned(lines):   # every line read, usable or not, counted as it goes by
      nonlocal last
      for number, raw, raw_tgt in lines:
        last = number - k * parts.unit if parts.kind == "lines" else number
        yield last, raw, raw_tgt
    for number, src, tgt in self._usable(spanned(lines), bad):
      part.append((src, tgt))
      numbers.append(number)
      if len(part) == size:
        yield part, numbers
        part, numbers = [], []
    if part:
      yield part, numbers
    ends = k == parts.count - 1 if parts.kind == "bytes" else last < parts.unit
    return last, bad, ends


class Parts:
  """How a split is cut into shards: kind ("bytes", "lines" or "records"), unit (per shard) and count
  (None where only reading to the end tells). The same for every process: it depends on the corpus and
  the unit, never on how many processes read it."""

  def __init__(self, reader, kind: str, unit: int, count: int | None):
    self.reader, self.kind, self.unit, self.count, self._cursor = reader, kind, unit, count, None

  @property
  def name(self) -> str:
    return f"{self.kind}{self.unit}"

  def cursor(self) -> "_LineCursor":
    if self._cursor is None:
      self._cursor = _LineCursor(self.reader)
    return self._cursor

  def close(self) -> None:
    if self._cursor is not None:
      self._cursor.close()
      self._cursor = None


class _LineCursor:
  """The raw lines of a FileReader's file(s), read forward: a later shard skips the lines between (a
  gzipped file must be read from its start either way); an earlier one opens the files again."""

  def __init__(self, reader):
    self.reader, self.files, self.at = reader, [], 0   # at: lines consumed (the same in both files)

  def _open(self) -> None:
    self.close()
    self.files = [(gzip.open if str(p).endswith(".gz") else open)(p, "rb") for p in self.reader.paths]
    self.at = 0

  def close(self) -> None:
    for file in self.files:
      file.close()
    self.files = []

  def lines(self, first: int, count: int):
    """(number, raw line, raw target line or None) of lines first + 1 .. first + count (fewer at the end)."""
    if not self.files or first < self.at:
      self._open()
    skipped = [sum(1 for _ in itertools.islice(f, first - self.at)) for f in self.files]
    if len(set(skipped)) > 1:   # one file ended before the other
      raise self.reader._misaligned(*(self.at + n + sum(1 for _ in f) for n, f in zip(skipped, self.files)))
    self.at += skipped[0]
    if self.at < first:
      return
    raw = [(line.rstrip(b"\r\n") for line in f) for f in self.files]
    if len(raw) == 2:
      numbered = self.reader._aligned(first, raw)
    else:
      numbered = self.reader._numbered(raw[0], first + 1)
    for item in itertools.islice(numbered, count):
      self.at += 1
      yield item


def _lines_between(path, start: int, stop: int):
  """The raw lines of an uncompressed file that start at a byte in [start, stop) (without line ends)."""
  with open(path, "rb") as f:
    position = 0
    if start:
      f.seek(start - 1)
      position = start - 1 + len(f.readline())   # the rest of the line that starts before `start`
    while position < stop:
      raw = f.readline()
      if not raw:
        return
      position += len(raw)
      yield raw.rstrip(b"\r\n")


def report_skipped(bad: dict, what: str) -> None:
  """Warns once with the count per reason and the first few places of each. bad: reason -> the places
  (a list), or -> (count, the first few places)."""
  if not bad:
    return
  counted = {k: v if isinstance(v, tuple) else (len(v), v) for k, v in bad.items()}
  parts = [f"{count} {reason} (first: {', '.join(places[:_SHOW_BAD])})"
           for reason, (count, places) in counted.items()]
  warnings.warn(f"{what}: skipped {sum(c for c, _ in counted.values())} pairs: {'; '.join(parts)}",
                stacklevel=3)
