"""Where parallel text comes from: the embedded corpus, a named TFDS corpus, or your own files.

    pairs = load_pairs(config.data, "train")     # [(source_text, target_text)]

config.data.source selects: "synthetic" (generated, prepared once as a TFDS dataset), "tfds" (e.g.
"wmt14_translate/de-en", prepared beforehand with tensorflow-datasets) or "files" (TSV, or two line-aligned
files joined by a comma, optionally gzipped). src_lang/tgt_lang pick the direction for both TFDS sources.
"""
from __future__ import annotations

import gzip
import os
import pathlib
import warnings

import tqdm

SOURCES = ("synthetic", "tfds", "files")
SPLITS = ("train", "dev", "test")
TFDS_SPLITS = {"train": "train", "dev": "validation", "test": "test"}  # wmt14: newstest2013 / 2014
_SHOW_BAD = 5   # how many bad lines a warning names


class DataError(ValueError):
  """Bad data or data settings; the message names the file, line or key and what to do."""


def check_config(data_config) -> None:
  """Fails fast, before any work, on an unknown source or split files that are missing."""
  source = data_config.source
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
  if source == "tfds":
    _tfds_builder(data_config)


def load_pairs(data_config, split: str) -> list[tuple[str, str]]:
  """All (source, target) pairs of a split ('train', 'dev' or 'test') as strings."""
  return load_pairs_with_origins(data_config, split)[0]


def load_pairs_with_origins(data_config, split: str):
  """(pairs, origins): origins[i] names where pair i came from (e.g. 'train.tsv:17') for messages."""
  if split not in SPLITS:
    raise DataError(f"unknown split {split!r}; use one of {SPLITS}")
  check_config(data_config)
  if data_config.source == "files":
    return read_files(data_config.get(f"{split}_path"), f"config.data.{split}_path")
  if data_config.source == "synthetic":
    from data import synthetic_tfds
    builder = synthetic_tfds.builder(data_config.get("synthetic_seed", 0),
                                     data_config.get("synthetic_train_size", 200_000),
                                     data_config.get("tfds_data_dir", "") or None)
    if not builder.is_prepared():
      print(f"[data] generating the embedded corpus into {builder.data_dir} (once)")
      import tensorflow_datasets as tfds
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tfds.disable_progress_bar()
        builder.download_and_prepare()
    name = synthetic_tfds.NAME
  else:
    builder = _tfds_builder(data_config)
    name = data_config.tfds_name
  key = (str(builder.data_path), split, data_config.src_lang, data_config.tgt_lang)
  if key not in _READ_CACHE:   # the vocabulary and the train iterator read the same split
    _READ_CACHE.clear()
    _READ_CACHE[key] = _read_tfds(builder, name, TFDS_SPLITS[split], data_config.src_lang,
                                  data_config.tgt_lang)
  pairs, origins = _READ_CACHE[key]
  return list(pairs), list(origins)


_READ_CACHE: dict = {}   # the last TFDS split read (prepared TFDS datasets do not change)


def _tfds_builder(data_config):
  import tensorflow_datasets as tfds
  name, data_dir = data_config.tfds_name, data_config.get("tfds_data_dir", "") or None
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # DatasetNotFoundError and friends, with tfds's own explanation
    raise DataError(f"config.data.tfds_name={name!r}: tensorflow-datasets cannot find it ({e})") from e
  if not builder.is_prepared():
    raise DataError(
        f"config.data.tfds_name={name!r} is not prepared in {builder.data_dir}. On a machine with "
        f"internet run: tfds build {name.split('/')[0]} --config {name.split('/')[-1]} "
        f"--file_format array_record --data_dir DIR, then set config.data.tfds_data_dir=DIR "
        f"(see REPRODUCING.md)")
  return builder


def _read_tfds(builder, name, split, src_lang, tgt_lang):
  languages = set(getattr(builder.info.features, "languages", None) or builder.info.features.keys())
  for key, lang in (("src_lang", src_lang), ("tgt_lang", tgt_lang)):
    if lang not in languages:
      raise DataError(f"config.data.{key}={lang!r}: dataset {name!r} has languages {sorted(languages)}")
  if split not in builder.info.splits:
    raise DataError(f"dataset {name!r} has no split {split!r} (it has {sorted(builder.info.splits)})")
  try:
    source = builder.as_data_source(split)
  except Exception as e:
    raise DataError(f"dataset {name!r} split {split!r} cannot be read with tfds.data_source ({e}); "
                    f"prepare it with --file_format array_record") from e
  pairs, origins = [], []
  decode = lambda x: x.decode("utf-8") if isinstance(x, bytes) else str(x)
  chunk = 10_000    # batched reads: ~15x faster than one record at a time
  with tqdm.tqdm(total=len(source), desc=f"read {name}:{split}", disable=len(source) < 100_000,
                 leave=False) as bar:
    for start in range(0, len(source), chunk):
      indices = list(range(start, min(start + chunk, len(source))))
      for i, record in zip(indices, source.__getitems__(indices)):
        pairs.append((decode(record[src_lang]).strip(), decode(record[tgt_lang]).strip()))
        origins.append(f"{name}:{split}[{i}]")
      bar.update(len(indices))
  return pairs, origins


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
  paths = spec.split(",")
  if len(paths) > 2:
    raise DataError(f"{key}={spec!r}: give one TSV path or two paths joined by a comma")
  for path in paths:
    if not pathlib.Path(path).exists():
      raise DataError(f"{key}: file {path!r} does not exist")
  pairs, origins, bad = [], [], {}

  def reject(reason, where):
    bad.setdefault(reason, []).append(where)

  if len(paths) == 1:
    for number, raw in enumerate(_open_lines(paths[0]), 1):
      where = f"{paths[0]}:{number}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError:
        reject("undecodable UTF-8", where)
        continue
      if not line.strip():
        reject("empty line", where)
        continue
      fields = line.split("\t")
      if len(fields) != 2:
        reject("no tab" if len(fields) == 1 else "more than one tab", where)
        continue
      src, tgt = fields[0].strip(), fields[1].strip()
      if not src or not tgt:
        reject("empty side", where)
        continue
      pairs.append((src, tgt))
      origins.append(where)
  else:
    src_lines, tgt_lines = list(_open_lines(paths[0])), list(_open_lines(paths[1]))
    if len(src_lines) != len(tgt_lines):
      raise DataError(f"{key}: {paths[0]} has {len(src_lines)} lines but {paths[1]} has "
                      f"{len(tgt_lines)}; the two files must be line-aligned")
    for number, (s_raw, t_raw) in enumerate(zip(src_lines, tgt_lines), 1):
      where = f"{paths[0]}:{number}"
      try:
        src, tgt = s_raw.decode("utf-8").strip(), t_raw.decode("utf-8").strip()
      except UnicodeDecodeError:
        reject("undecodable UTF-8", where)
        continue
      if not src or not tgt:
        reject("empty line", where)
        continue
      pairs.append((src, tgt))
      origins.append(where)
  report_skipped(bad, key)
  if not pairs:
    raise DataError(f"{key}={spec!r}: no usable sentence pairs (skipped: "
                    f"{', '.join(f'{len(v)} {k}' for k, v in bad.items()) or 'none'}); expected "
                    f"'source<TAB>target' lines or two line-aligned files")
  return pairs, origins


def report_skipped(bad: dict, what: str) -> None:
  """Warns once with the count per reason and the first few places of each."""
  if not bad:
    return
  parts = [f"{len(places)} {reason} (first: {', '.join(places[:_SHOW_BAD])})"
           for reason, places in bad.items()]
  warnings.warn(f"{what}: skipped {sum(len(v) for v in bad.values())} pairs: {'; '.join(parts)}",
                stacklevel=3)
