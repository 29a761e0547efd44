"""`python -m data.prepare NAME --data_dir DIR`: download and prepare a TFDS translation corpus for
training, without TensorFlow.

    python -m data.prepare wmt14_translate/de-en --data_dir /data/tensorflow_datasets
    python -m data.prepare wmt14_translate/fr-en --data_dir /data/tensorflow_datasets
    python -m data.prepare wmt14_translate/de-en --data_dir DIR --archives FOLDER   # archives already here

It imports the dataset's TFDS builder module (tensorflow_datasets/translate/wmt14.py for wmt14_translate:
`tfds.builder` does not find it otherwise), downloads the archives the builder lists into DIR/downloads
(checked against TFDS's registered checksums) and writes the train, validation and test splits as
array_record files into DIR/NAME/VERSION, which training reads with --config.data.tfds_data_dir=DIR.
Beside them, DIR/NAME/<test set>.<lang> hold the test split's two sides as line-aligned text (for
wmt14_translate: newstest2014.en and newstest2014.de, 3,003 lines), the files `python -m decode --input
... --reference ...` takes: the test set comes from the prepared split, with no second download.

TFDS's own extraction needs TensorFlow: the archives are extracted here (Python's tarfile, gzip, zipfile)
into DIR/downloads/extracted. DIR/downloads can be deleted once the dataset is prepared.

--archives FOLDER reads the archives from FOLDER instead of downloading them (no checksum check): each
file named as the last part of its URL (dev.tgz, training-parallel-europarl-v7.tgz, ...; the error for a
missing one names it and its URL). For a machine without internet, or the tests' small fake of WMT14.

Progress: TFDS's bars for the download, extraction and each split's examples, and a summary at the end.
A dataset already prepared in DIR is left as it is (delete DIR/NAME to prepare it again).
"""
from __future__ import annotations

import argparse
import gzip
import importlib
import logging
import os
import pathlib
import shutil
import sys
import tarfile
import warnings
import zipfile

log = logging.getLogger("data.prepare")   # not __name__: that is "__main__" under python -m data.prepare

# Datasets whose TFDS module lives elsewhere than tensorflow_datasets/translate/<name without _translate>.
_MODULES = {"wmt_t2t_translate": "tensorflow_datasets.translate.wmt_t2t"}


class PrepareError(ValueError):
  """A dataset name, folder or archive that cannot be prepared; the message says what to do."""


def builder_module(name: str) -> str:
  """'wmt14_translate/de-en' -> 'tensorflow_datasets.translate.wmt14', the module that defines it."""
  dataset = name.split("/")[0].split(":")[0]
  return _MODULES.get(dataset, f"tensorflow_datasets.translate.{dataset.removesuffix('_translate')}")


def make_builder(name: str, data_dir: str):
  """The TFDS builder of `name` ('wmt14_translate/de-en'), its module imported first, writing
  array_record files under data_dir."""
  import tensorflow_datasets as tfds
  module = builder_module(name)
  try:
    importlib.import_module(module)
  except ImportError:
    pass   # not a translate dataset: tfds.builder may still know it (it says so below if not)
  try:
    return tfds.builder(name, data_dir=data_dir, file_format="array_record")
  except Exception as error:  # noqa: BLE001 - DatasetNotFoundError, a config it lacks: tfds's own words
    first = " ".join(str(error).split())[:300]
    raise PrepareError(f"{name!r}: tensorflow-datasets cannot build it ({type(error).__name__}: {first}); "
                       f"give a TFDS translation dataset as NAME/CONFIG, e.g. wmt14_translate/de-en") from None


def _map(function, tree):
  """function applied to every string of a nested dict/list/tuple (a download manager's argument)."""
  if isinstance(tree, dict):
    return {key: _map(function, value) for key, value in tree.items()}
  if isinstance(tree, (list, tuple)):
    return type(tree)(_map(function, value) for value in tree)
  return function(tree)


class Downloads:
  """A TFDS download manager without TensorFlow: downloads are the real manager's (checksummed), or the
  files of a local folder named as their URLs end (--archives); extraction is done here with Python's
  tarfile, gzip and zipfile (TFDS's extractor needs TensorFlow), into DIR/downloads/extracted/<archive>,
  once. Everything else is the real manager's."""

  def __init__(self, manager, extract_dir: pathlib.Path, archives: pathlib.Path | None, progress: bool):
    self._manager, self._extract_dir, self._archives, self._progress = manager, extract_dir, archives, progress

  def __getattr__(self, name):
    return getattr(self._manager, name)

  def _local(self, url: str) -> str:
    path = self._archives / str(url).rstrip("/").rsplit("/", 1)[-1]
    if not path.is_file():
      raise PrepareError(f"--archives {self._archives}: {path.name} is missing; put the file downloaded from "
                         f"{url} there (or leave out --archives to download it)")
    return os.fspath(path)

  def download(self, urls):
    if self._archives is None:
      return _map(os.fspath, self._manager.download(urls))
    return _map(self._local, urls)

  def extract(self, paths):
    return _map(self._extract_one, paths)

  def download_and_extract(self, urls):
    return self.extract(self.download(urls))

  def _extract_one(self, path) -> str:
    import tqdm
    path = pathlib.Path(path)
    if tarfile.is_tarfile(path):
      kind = "tar"
    elif zipfile.is_zipfile(path):
      kind = "zip"
    elif path.open("rb").read(2) == b"\x1f\x8b":
      kind = "gzip"
    else:
      return os.fspath(path)   # not an archive: read as it is
    target = self._extract_dir / path.name
    if target.exists():
      log.info(f"[prepare] {path.name}: extracted before, in {target}")
      return os.fspath(target)
    log.info(f"[prepare] extracting {path} ({path.stat().st_size / 2**20:,.0f} MiB)")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.unlink(missing_ok=True)
    self._extract_dir.mkdir(parents=True, exist_ok=True)
    with path.open("rb") as raw, tqdm.tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                           desc=f"extract {path.name}", disable=not self._progress) as bar:
      stream = tqdm.utils.CallbackIOWrapper(bar.update, raw, "read")
      if kind == "tar":
        with tarfile.open(fileobj=stream, mode="r|*") as archive:
          if hasattr(tarfile, "data_filter"):
            archive.extractall(partial, filter="data")   # no paths outside the target, no devices
          else:
            archive.extractall(partial)
      elif kind == "zip":
        with zipfile.ZipFile(path) as archive:
          archive.extractall(partial)
      else:
        with gzip.open(stream) as unzipped, partial.open("wb") as out:
          shutil.copyfileobj(unzipped, out, 1 << 20)
    partial.rename(target)
    return os.fspath(target)


def _use_downloads(builder, data_dir: pathlib.Path, archives, progress: bool) -> None:
  """Points builder's download step at Downloads (its split generators receive it as their manager)."""
  if archives is not None and not pathlib.Path(archives).is_dir():
    raise PrepareError(f"--archives {archives} is not a directory")
  folder = pathlib.Path(archives).absolute() if archives is not None else None
  generate = builder._split_generators   # noqa: SLF001 - where TFDS hands a builder its download manager
  builder._split_generators = lambda dl_manager: generate(   # noqa: SLF001
      Downloads(dl_manager, data_dir / "downloads" / "extracted", folder, progress))


def test_set_files(builder, name: str, data_dir) -> dict:
  """{lang: path} of the text files holding the test split's two sides, named after the test set."""
  subsets = getattr(builder, "subsets", {}) or {}
  sets = [str(s) for split, names in subsets.items() if str(split) == "test" for s in names]
  stem = sets[0] if len(sets) == 1 else "test"
  languages = list(getattr(builder.info.features, "languages", None) or builder.info.features.keys())
  folder = pathlib.Path(data_dir) / name.split(":")[0]
  return {lang: folder / f"{stem}.{lang}" for lang in languages}


def write_test_set(builder, name: str, data_dir) -> dict:
  """Writes the prepared test split's sides as line-aligned text files (test_set_files); -> those paths."""
  files = test_set_files(builder, name, data_dir)
  source = builder.as_data_source("test")
  records = source.__getitems__(list(range(len(source))))
  text = lambda x: " ".join((x.decode("utf-8") if isinstance(x, bytes) else str(x)).split())
  for lang, path in files.items():
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(text(r[lang]) + "\n" for r in records), encoding="utf-8")
    temporary.replace(path)
  return files


def prepare(name: str, data_dir, archives=None, progress: bool = True):
  """Prepares `name` in data_dir (archives: a local folder of the archives instead of the download) and
  writes the test split's text files. -> (the builder, {lang: test file})."""
  import tensorflow_datasets as tfds
  data_dir = pathlib.Path(data_dir).absolute()
  builder = make_builder(name, os.fspath(data_dir))
  if builder.is_prepared():
    log.info(f"[prepare] {name} is already prepared in {builder.data_dir}")
  else:
    _use_downloads(builder, data_dir, archives, progress)
    if archives is not None:
      log.info(f"[prepare] {name}: reading the archives from {archives}, extracting them into "
               f"{data_dir / 'downloads' / 'extracted'}")
    else:
      log.info(f"[prepare] {name}: downloading its archives into {data_dir / 'downloads'} (WMT14 EN-DE "
               f"about 1.7 GB, EN-FR several times more; hours on a slow line)")
    (tfds.enable_progress_bar if progress else tfds.disable_progress_bar)()
    config = tfds.download.DownloadConfig(download_mode=tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")   # TFDS's notes on its own deprecated paths
      builder.download_and_prepare(download_dir=os.fspath(data_dir / "downloads"), download_config=config)
  files = write_test_set(builder, name, data_dir)
  return builder, files


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n")[0],
                                   epilog=__doc__.split("\n", 1)[1],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("name", help="the TFDS dataset and config, e.g. wmt14_translate/de-en")
  parser.add_argument("--data_dir", required=True,
                      help="the TFDS data directory to write (what --config.data.tfds_data_dir names)")
  parser.add_argument("--archives", default=None,
                      help="a folder holding the dataset's archives, named as their URLs end: read them "
                           "instead of downloading")
  parser.add_argument("--no_progress", action="store_true", help="no progress bars")
  args = parser.parse_args(argv)
  handler = logging.StreamHandler(sys.stdout)
  handler.setFormatter(logging.Formatter("%(message)s"))
  log.addHandler(handler)
  log.setLevel(logging.INFO)
  log.propagate = False   # TFDS configures the root logger: one line, not two
  try:
    builder, files = prepare(args.name, args.data_dir, args.archives, progress=not args.no_progress)
  except PrepareError as error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
  splits = ", ".join(f"{split} {info.num_examples:,}" for split, info in sorted(builder.info.splits.items()))
  log.info(f"[prepare] {args.name} in {builder.data_dir}: {splits} pairs")
  log.info(f"[prepare] test set as text: {', '.join(map(str, files.values()))}")
  log.info(f"[prepare] train with --config.data.tfds_data_dir={pathlib.Path(args.data_dir).absolute()}")


if __name__ == "__main__":
  main()
