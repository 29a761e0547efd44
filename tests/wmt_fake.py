"""A small fake of the WMT14 EN-DE download, in the layout tensorflow_datasets/translate/wmt.py expects
(not a test module): the four archives `wmt14_translate/de-en` downloads, named as their URLs end, each
holding the files the builder reads, with pairs of the embedded corpus (data/synthetic.py) in place of
Europarl, CommonCrawl, News Commentary and the newstest sets.
"""
import io
import pathlib
import tarfile

from data import synthetic

# Archive -> {member path: side}, as wmt.py's SubDatasets for source language "de" name them.
TRAIN = {
    "training-parallel-europarl-v7.tgz": ("training/europarl-v7.de-en.de", "training/europarl-v7.de-en.en"),
    "training-parallel-commoncrawl.tgz": ("commoncrawl.de-en.de", "commoncrawl.de-en.en"),
    "training-parallel-nc-v9.tgz": ("training/news-commentary-v9.de-en.de",
                                    "training/news-commentary-v9.de-en.en"),
}
DEV_SIZE, TEST_SIZE = 40, 48


def _add(archive: tarfile.TarFile, name: str, text: str) -> None:
  data = text.encode("utf-8")
  info = tarfile.TarInfo(name)
  info.size = len(data)
  archive.addfile(info, io.BytesIO(data))


def _sgm(lines, lang: str, kind: str) -> str:
  """newstest2014's SGML: one <seg id="N">sentence</seg> a line inside a <doc>."""
  segs = "".join(f'<seg id="{i}">{line}</seg>\n' for i, line in enumerate(lines, 1))
  return (f'<{kind}set setid="newstest2014" srclang="any" trglang="{lang}">\n'
          f'<doc sysid="ref" docid="fake" origlang="en">\n{segs}</doc>\n</{kind}set>\n')


def write_archives(folder, train_size: int = 300) -> dict:
  """Writes the fake archives into folder; -> {'train': [(en, de)], 'dev': [...], 'test': [...]}."""
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  corpus = synthetic.generate(7, {"train": train_size, "dev": DEV_SIZE, "test": TEST_SIZE})
  # A hyphen, quotes and a number in the test set: what the paper-style BLEU tokenizes.
  corpus["test"][0] = ('the "Rhein-Main" house costs 1,000 euros .', 'das "Rhein-Main" Haus kostet 1.000 Euro .')
  third = len(corpus["train"]) // 3
  for i, (archive_name, (de_path, en_path)) in enumerate(TRAIN.items()):
    part = corpus["train"][i * third:(i + 1) * third if i < 2 else None]
    with tarfile.open(folder / archive_name, "w:gz") as archive:
      _add(archive, de_path, "\n".join(de for _, de in part))
      _add(archive, en_path, "\n".join(en for en, _ in part))
  with tarfile.open(folder / "dev.tgz", "w:gz") as archive:
    _add(archive, "dev/newstest2013.de", "\n".join(de for _, de in corpus["dev"]))
    _add(archive, "dev/newstest2013.en", "\n".join(en for en, _ in corpus["dev"]))
    _add(archive, "dev/newstest2014-deen-src.de.sgm", _sgm([de for _, de in corpus["test"]], "de", "src"))
    _add(archive, "dev/newstest2014-deen-ref.en.sgm", _sgm([en for en, _ in corpus["test"]], "en", "ref"))
  return corpus
