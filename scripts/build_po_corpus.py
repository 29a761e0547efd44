"""Builds a real English->X parallel corpus from the translated message catalogs Debian packages ship.

    python scripts/build_po_corpus.py --lang de --out corpus/po_ende      # ~2 min, ~190 MB of .debs

Writes OUT/{train,dev,test}.tsv ("english<TAB>translation", one pair a line) and OUT/manifest.json (the
package versions, counts per package and per split). Train on it with experiments/small_corpus.py:

    python -m train --config experiments/small_corpus.py \\
        --config.data.train_path=OUT/train.tsv --config.data.dev_path=OUT/dev.tsv \\
        --config.data.test_path=OUT/test.tsv --config.data.src_lang=en --config.data.tgt_lang=de

Steps: `apt-get download` the packages (kept in OUT/debs, reused on a rerun) -> the binary gettext
catalogs (.mo) of the language inside them -> (English msgid, translated msgstr) pairs -> cleaned (GUI
accelerators, printf/brace placeholders, markup and line breaks removed) -> one pair per English message
(the most common translation across packages) -> split by a hash of the normalised English text, so a
message and its case/punctuation variants never sit in two splits. The corpus is user-interface text:
many short labels and longer help sentences from 14 applications (GIMP, Inkscape, LibreOffice, GnuCash,
Gramps, Freeciv, calibre, VLC, ...). Needs Debian's apt (no other network access).
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import pathlib
import re
import struct
import subprocess
import sys
import tarfile
import io

# Debian 12 packages with large gettext catalogs (calibre, AbiWord and Scribus keep theirs in other
# formats; GIMP's are in gimp-data).
PACKAGES = (
    "digikam-data", "evolution-common", "freeciv-data", "gcc-12-locales", "gimp-data",
    "gnome-control-center-data", "gnucash-common", "gnumeric-common", "gramps", "inkscape", "kdenlive-data",
    "libreoffice-l10n-{lang}", "nautilus-data", "vlc-l10n",
)
DEV_PER_MILLE, TEST_PER_MILLE = 30, 50     # of the distinct English messages, by hash
MIN_CHARS, MAX_CHARS = 2, 300


# ---------------------------------------------------------------------------------------------------
# Packages and catalogs.
# ---------------------------------------------------------------------------------------------------

def download(packages, debs: pathlib.Path) -> list[pathlib.Path]:
  """apt-get download of each package not yet in debs; returns the .deb files (one per package)."""
  debs.mkdir(parents=True, exist_ok=True)
  missing = [p for p in packages if not list(debs.glob(f"{p}_*.deb"))]
  if missing:
    print(f"[corpus] apt-get download {' '.join(missing)}")
    result = subprocess.run(["apt-get", "download", *missing], cwd=debs, capture_output=True, text=True)
    if result.returncode != 0:
      sys.exit(f"error: apt-get download failed (run `apt-get update` first?):\n{result.stderr.strip()}")
  return [sorted(debs.glob(f"{p}_*.deb"))[-1] for p in packages]


def catalogs(deb: pathlib.Path, lang: str):
  """Yields (path inside the package, bytes) of every .mo catalog of `lang` in a .deb."""
  data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
  with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    for member in tar:
      parts = member.name.split("/")
      if member.isfile() and member.name.endswith(".mo") and lang in parts:
        yield member.name, tar.extractfile(member).read()


def parse_mo(blob: bytes):
  """A GNU .mo file -> [(msgid, msgstr)]: singular forms only, contexts dropped, the header skipped."""
  for order in ("<", ">"):
    magic, _, count, ids_at, strs_at = struct.unpack(order + "5I", blob[:20])
    if magic == 0x950412DE:
      break
  else:
    raise ValueError("not a GNU .mo file")

  def string(table, i):
    length, offset = struct.unpack(order + "2I", blob[table + 8 * i: table + 8 * i + 8])
    return blob[offset:offset + length].decode("utf-8", errors="replace")

  out = []
  for i in range(count):
    msgid, msgstr = string(ids_at, i), string(strs_at, i)
    msgid = msgid.split("\x04")[-1].split("\x00")[0]    # drop "context\x04", keep the singular
    msgstr = msgstr.split("\x00")[0]
    if msgid and msgstr:
      out.append((msgid, msgstr))
  return out


# ---------------------------------------------------------------------------------------------------
# Cleaning.
# ---------------------------------------------------------------------------------------------------

# printf (also GCC's %qD, %<...%>, positional %1$s), Python %(name)s, {0}/{name}, ${var}, %VAR%, Qt's %1.
# No space flag: "% nicht" is a lone percent sign followed by a word, not a conversion.
_PLACEHOLDER = re.compile(r"%%|%(\(\w+\))?[-+#0q]*(\d+\$)?(\d+|\*)?(\.\d+|\.\*)?(hh|h|ll|l|L|z|j|t|w|I64)?"
                          r"[A-Za-z]|%\d+|\{[\w.:!]*\}|\$\{?\w+\}?|%[A-Z_]+%")
_MARKUP = re.compile(r"<[^<>]{1,80}>")
_ACCEL = re.compile(r"(?<![\w&])[_&~](?=\w)")      # _File, &File, ~File (GTK, Qt, LibreOffice)
_SPACE = re.compile(r"\s+")
_LETTER = re.compile(r"[^\W\d_]", re.UNICODE)


def clean(text: str) -> str:
  """A catalog string as plain text: no accelerators, placeholders, markup or line breaks."""
  text = text.replace("%<", "").replace("%>", "")    # GCC's quote markers, before markup
  text = text.replace("\\n", " ").replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
  text = _MARKUP.sub(" ", text)
  text = _PLACEHOLDER.sub(" ", text)
  text = _ACCEL.sub("", text)
  text = re.sub(r"\s+([.,:;!?)])", r"\1", text)
  return _SPACE.sub(" ", text).strip(" -:")


def key(english: str) -> str:
  """What makes two English messages the same message: lowercase letters and digits only."""
  return "".join(ch for ch in english.lower() if ch.isalnum())


def usable(src: str, tgt: str) -> bool:
  return (MIN_CHARS <= len(src) <= MAX_CHARS and MIN_CHARS <= len(tgt) <= MAX_CHARS
          and _LETTER.search(src) is not None and src != tgt and "\t" not in src + tgt
          and len(tgt) < 4 * len(src) + 10 and len(src) < 4 * len(tgt) + 10)


def split_of(message_key: str) -> str:
  bucket = int(hashlib.sha1(message_key.encode()).hexdigest(), 16) % 1000
  return "dev" if bucket < DEV_PER_MILLE else "test" if bucket < DEV_PER_MILLE + TEST_PER_MILLE else "train"


# ---------------------------------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------------------------------

def build(lang: str, out: pathlib.Path, packages=PACKAGES) -> dict:
  packages = [p.format(lang=lang) for p in packages]
  debs = download(packages, out / "debs")
  # For each message key: its English spelling (first seen) and the count of each cleaned translation.
  english, translations, per_package = {}, collections.defaultdict(collections.Counter), {}
  for deb in debs:
    found = 0
    for _, blob in catalogs(deb, lang):
      for msgid, msgstr in parse_mo(blob):
        src, tgt = clean(msgid), clean(msgstr)
        if usable(src, tgt):
          k = key(src)
          if k:
            english.setdefault(k, src)
            translations[k][tgt] += 1
            found += 1
    per_package[deb.name] = found
    print(f"[corpus] {deb.name}: {found} usable messages")
  splits = {"train": [], "dev": [], "test": []}
  for k in sorted(english):
    # The most common translation; ties go to the alphabetically first (deterministic).
    tgt = min(translations[k].items(), key=lambda item: (-item[1], item[0]))[0]
    splits[split_of(k)].append((english[k], tgt))
  for name, pairs in splits.items():
    order = sorted(pairs, key=lambda p: hashlib.sha1((p[0] + "\t" + p[1]).encode()).hexdigest())
    (out / f"{name}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in order), encoding="utf-8")
  manifest = {"lang": f"en-{lang}", "packages": per_package,
              "pairs": {name: len(pairs) for name, pairs in splits.items()},
              "dev_per_mille": DEV_PER_MILLE, "test_per_mille": TEST_PER_MILLE}
  (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
  return manifest


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lang", default="de", help="target language code of the catalogs (default de)")
  parser.add_argument("--out", default="corpus/po_ende", help="output directory")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  manifest = build(args.lang, out)
  print(f"[corpus] {manifest['pairs']} pairs in {out}/{{train,dev,test}}.tsv")


if __name__ == "__main__":
  main()
