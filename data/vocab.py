"""One SentencePiece vocabulary shared by source and target (the paper shares one vocabulary), or two
SentencePiece models over one id table (a pretrained Marian model's: export/load_hf.py).

Ids: pad 0, unk 1, bos 2, eos 3. Trained once per run directory (workdir/vocab.model) on a seeded random
sample of the training text (drawn without reading the corpus into memory: data.cache.vocab_sample),
then reused on resume and by decoding.

An imported Marian model cuts sources with source.spm and targets with target.spm, and names its ids in
vocab.json (piece -> id). `PairVocab` holds the three in one vocab.model file, a zip of source.spm,
target.spm and pieces.json (the piece of every id, in our order), so that the run directory, its
fingerprint and everything that opens it stay as they are; `open_vocab` reads either kind.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pathlib
import random
import zipfile

import sentencepiece as spm

log = logging.getLogger(__name__)

VOCAB_FILE = "vocab.model"
VOCAB_INFO = "vocab.json"    # what it was trained on (data.cache.train_vocab_cached)
PAD, UNK, BOS, EOS = 0, 1, 2, 3
SIDES = ("source", "target")


# SentencePiece's trainer writes its thread count into the model, and a unigram model's pieces depend on
# it: training on a fixed count (SentencePiece's own default) gives the same vocabulary, byte for byte,
# on every machine and for every CPU allowance. Encoding gives the same ids on any number of threads.
TRAIN_THREADS = 16


def threads() -> int:
  """The CPUs this process may use (its affinity mask: what SLURM's --cpus-per-task, taskset or a
  tokenizing worker's pinning gave it), not the machine's count: SentencePiece's encoding threads, and
  run/devices.usable_cpus for everything else that sizes itself to the process."""
  try:
    return len(os.sched_getaffinity(0)) or 1
  except AttributeError:   # not Linux
    return os.cpu_count() or 1


class Vocab:
  """A SentencePiece model with the ids this codebase relies on."""

  def __init__(self, model_bytes: bytes, path: str = "<memory>"):
    self.path = str(path)
    self._sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    self.model_bytes = model_bytes   # the serialized SentencePiece model (what vocab.model holds)
    self.fingerprint = hashlib.sha256(model_bytes).hexdigest()[:16]
    ids = (self._sp.pad_id(), self._sp.unk_id(), self._sp.bos_id(), self._sp.eos_id())
    if ids != (PAD, UNK, BOS, EOS):
      raise ValueError(f"{path}: SentencePiece ids (pad, unk, bos, eos) are {ids}, expected "
                       f"{(PAD, UNK, BOS, EOS)}; train the vocabulary with data.vocab.train_vocab")

  pad_id, unk_id, bos_id, eos_id = PAD, UNK, BOS, EOS

  def id_to_piece(self, token_id: int) -> str:
    """The SentencePiece piece (token string) of one id, e.g. '▁house'."""
    return self._sp.id_to_piece(int(token_id))

  def piece_to_id(self, piece: str) -> int | None:
    """The id of one piece (e.g. a reserved tag, '<BT>'), None if the vocabulary has no such piece."""
    token_id = self._sp.piece_to_id(piece)
    return None if token_id == UNK and piece != self._sp.id_to_piece(UNK) else int(token_id)

  @classmethod
  def load(cls, path) -> "Vocab":
    path = pathlib.Path(path)
    if not path.exists():
      raise FileNotFoundError(f"vocabulary {path} does not exist")
    return cls(path.read_bytes(), path)

  @property
  def size(self) -> int:
    return self._sp.get_piece_size()

  def encode(self, text: str, side: str = "source") -> list[int]:
    """Text -> ids, without bos or eos. `side` ("source" or "target") matters to PairVocab only."""
    return self._sp.encode(text)

  def encode_batch(self, texts: list[str], side: str = "source") -> list[list[int]]:
    return self._sp.encode(texts, num_threads=threads())

  def decode(self, ids) -> str:
    """Ids -> text; stops at the first eos and drops pad and bos."""
    out = []
    for i in ids:
      i = int(i)
      if i == EOS:
        break
      if i not in (PAD, BOS):
        out.append(i)
    return self._sp.decode(out)


class PairVocab:
  """Two SentencePiece models over one id table: sources are cut with `source`, targets with `target`,
  and each piece's id is its position in `pieces` (ids pad 0, unk 1, bos 2, eos 3, as Vocab's). A piece
  that is not in the table is unk, as MarianTokenizer does it."""

  pad_id, unk_id, bos_id, eos_id = PAD, UNK, BOS, EOS

  def __init__(self, model_bytes: bytes, path: str = "<memory>"):
    self.path = str(path)
    self.model_bytes = model_bytes
    self.fingerprint = hashlib.sha256(model_bytes).hexdigest()[:16]
    with zipfile.ZipFile(io.BytesIO(model_bytes)) as bundle:
      self.spm_bytes = {side: bundle.read(f"{side}.spm") for side in SIDES}
      self.pieces = json.loads(bundle.read("pieces.json"))
    self._sp = {side: spm.SentencePieceProcessor(model_proto=self.spm_bytes[side]) for side in SIDES}
    self._ids = {piece: i for i, piece in enumerate(self.pieces)}
    if len(self._ids) != len(self.pieces):
      raise ValueError(f"{path}: pieces.json names a piece twice")

  @staticmethod
  def bundle(source_spm: bytes, target_spm: bytes, pieces: list[str]) -> bytes:
    """The vocab.model bytes of a PairVocab (a zip with fixed timestamps: the same inputs, the same
    bytes, the same fingerprint)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bundle:
      for name, data in (("source.spm", source_spm), ("target.spm", target_spm),
                         ("pieces.json", json.dumps(pieces, ensure_ascii=False).encode())):
        bundle.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return out.getvalue()

  @property
  def size(self) -> int:
    return len(self.pieces)

  def id_to_piece(self, token_id: int) -> str:
    return self.pieces[int(token_id)]

  def piece_to_id(self, piece: str) -> int | None:
    return self._ids.get(piece)

  def encode(self, text: str, side: str = "source") -> list[int]:
    """Text -> ids (no bos or eos): cut by `side`'s SentencePiece model, each piece looked up."""
    return self.encode_batch([text], side)[0]

  def encode_batch(self, texts: list[str], side: str = "source") -> list[list[int]]:
    if side not in SIDES:
      raise ValueError(f"side={side!r}: use one of {SIDES}")
    cut = self._sp[side].encode(list(texts), out_type=str, num_threads=threads())
    return [[self._ids.get(piece, UNK) for piece in pieces] for pieces in cut]

  def decode(self, ids) -> str:
    """Target ids -> text with target.spm; stops at the first eos and drops pad, bos and unk, as
    MarianTokenizer's batch_decode(skip_special_tokens=True) does; a piece target.spm does not know
    (the table is joint) keeps its text, its word boundary marks turned into spaces."""
    out = []
    for i in ids:
      i = int(i)
      if i == EOS:
        break
      if i not in (PAD, BOS, UNK):
        out.append(self.pieces[i])
    return self._sp["target"].decode_pieces(out).replace("\u2581", " ").strip()


def open_vocab(model_bytes: bytes, path: str = "<memory>") -> Vocab | PairVocab:
  """A run's vocab.model bytes -> Vocab (one SentencePiece model) or PairVocab (a zip bundle)."""
  if model_bytes[:4] == b"PK\x03\x04":
    return PairVocab(model_bytes, path)
  return Vocab(model_bytes, path)


def check_vocab(vocab: Vocab, expected_fingerprint: str | None, where: str) -> None:
  """Refuses a vocabulary that is not the one a checkpoint was trained with."""
  if expected_fingerprint and vocab.fingerprint != expected_fingerprint:
    raise ValueError(f"{vocab.path} (fingerprint {vocab.fingerprint}) is not the vocabulary {where} was "
                     f"trained with (fingerprint {expected_fingerprint}); use that run's vocab.model")


MODEL_TYPES = ("bpe", "unigram")


def train_vocab(texts: list[str], vocab_size: int, *, seed: int, sample_sentences: int,
                model_type: str = "bpe", reserved: tuple[str, ...] = ()) -> bytes:
  """Trains a SentencePiece model (byte-pair encoding, as the paper, or unigram) on a seeded random
  sample of `texts`; returns its bytes. reserved: pieces that are always one piece of their own (e.g.
  the back-translation tag, data/mixing.py), ids right after eos's, within vocab_size."""
  if model_type not in MODEL_TYPES:
    raise ValueError(f"config.data.vocab_model_type={model_type!r}: use one of {MODEL_TYPES}")
  rng = random.Random(seed)
  sample = texts if len(texts) <= sample_sentences else rng.sample(texts, sample_sentences)
  log.info(f"[data] training a {vocab_size}-piece SentencePiece vocabulary on {len(sample)} sentences")
  writer = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sample), model_writer=writer, vocab_size=vocab_size, model_type=model_type,
      character_coverage=1.0, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS, hard_vocab_limit=False,
      input_sentence_size=0, shuffle_input_sentence=False, num_threads=TRAIN_THREADS,
      minloglevel=2, **({"user_defined_symbols": list(reserved)} if reserved else {}))
  return writer.getvalue()


def auto_vocab_size(num_pairs: int) -> int:
  """config.data.vocab_size=0: pieces by corpus size, 44 * sqrt(pairs) rounded to 500, in [1000, 32000]
  (20k pairs: 6,000; 28k: 7,500; 75k: 12,000; 500k: 31,000). Tuned on one 75k-pair corpus at a 10-minute
  CPU budget (experiments/small_corpus.py: 2,000-16,000 pieces tried, 12,000 best): a small corpus sees
  each piece of a large vocabulary too rarely to learn it, and the output layer's cost grows with it."""
  return int(min(32_000, max(1_000, round(44 * num_pairs ** 0.5 / 500) * 500)))
