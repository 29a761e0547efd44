"""One SentencePiece vocabulary shared by source and target (the paper shares one vocabulary).

Ids: pad 0, unk 1, bos 2, eos 3. Trained once per run directory (workdir/vocab.model) on a seeded random
sample of the training text (drawn without reading the corpus into memory: data.cache.vocab_sample),
then reused on resume and by decoding.
"""
from __future__ import annotations

import hashlib
import io
import os
import pathlib
import random

import sentencepiece as spm

VOCAB_FILE = "vocab.model"
VOCAB_INFO = "vocab.json"    # what it was trained on (data.cache.train_vocab_cached)
PAD, UNK, BOS, EOS = 0, 1, 2, 3


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

  @classmethod
  def load(cls, path) -> "Vocab":
    path = pathlib.Path(path)
    if not path.exists():
      raise FileNotFoundError(f"vocabulary {path} does not exist")
    return cls(path.read_bytes(), path)

  @property
  def size(self) -> int:
    return self._sp.get_piece_size()

  def encode(self, text: str) -> list[int]:
    """Text -> ids, without bos or eos."""
    return self._sp.encode(text)

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return self._sp.encode(texts, num_threads=os.cpu_count() or 1)

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


def check_vocab(vocab: Vocab, expected_fingerprint: str | None, where: str) -> None:
  """Refuses a vocabulary that is not the one a checkpoint was trained with."""
  if expected_fingerprint and vocab.fingerprint != expected_fingerprint:
    raise ValueError(f"{vocab.path} (fingerprint {vocab.fingerprint}) is not the vocabulary {where} was "
                     f"trained with (fingerprint {expected_fingerprint}); use that run's vocab.model")


MODEL_TYPES = ("bpe", "unigram")


def train_vocab(texts: list[str], vocab_size: int, *, seed: int, sample_sentences: int,
                model_type: str = "bpe") -> bytes:
  """Trains a SentencePiece model (byte-pair encoding, as the paper, or unigram) on a seeded random
  sample of `texts`; returns its bytes."""
  if model_type not in MODEL_TYPES:
    raise ValueError(f"config.data.vocab_model_type={model_type!r}: use one of {MODEL_TYPES}")
  rng = random.Random(seed)
  sample = texts if len(texts) <= sample_sentences else rng.sample(texts, sample_sentences)
  print(f"[data] training a {vocab_size}-piece SentencePiece vocabulary on {len(sample)} sentences")
  writer = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sample), model_writer=writer, vocab_size=vocab_size, model_type=model_type,
      character_coverage=1.0, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS, hard_vocab_limit=False,
      input_sentence_size=0, shuffle_input_sentence=False, num_threads=os.cpu_count() or 1,
      minloglevel=2)
  return writer.getvalue()


def auto_vocab_size(num_pairs: int) -> int:
  """config.data.vocab_size=0: pieces by corpus size, 44 * sqrt(pairs) rounded to 500, in [1000, 32000]
  (20k pairs: 6,000; 28k: 7,500; 75k: 12,000; 500k: 31,000). Tuned on one 75k-pair corpus at a 10-minute
  CPU budget (experiments/small_corpus.py: 2,000-16,000 pieces tried, 12,000 best): a small corpus sees
  each piece of a large vocabulary too rarely to learn it, and the output layer's cost grows with it."""
  return int(min(32_000, max(1_000, round(44 * num_pairs ** 0.5 / 500) * 500)))
