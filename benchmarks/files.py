"""The files every system of a benchmark run reads: one set of weights and inputs, written once.

Standard library and numpy only, so that every worker can import it without importing another system.
benchmarks/prepare.py writes them into one directory:

    params.msgpack     our parameters (flax.serialization), from our random init
    marian/            the same weights as a transformers MarianMTModel (export/), if installed
    ct2/               the same weights as a CTranslate2 float32 model (export/), if installed
    train_batch.npz    one training batch in the data/ batch contract (int32 [rows, len] arrays)
    decode_src.npy     int32 [decode_batch, src_len] source ids, no padding
    prepared.json      which of the exports were written, and why not
"""
from __future__ import annotations

import pathlib

import numpy as np

PAD, UNK, BOS, EOS = 0, 1, 2, 3       # data/vocab.py's special ids

PARAMS = "params.msgpack"
MARIAN = "marian"
CT2 = "ct2"
TRAIN_BATCH = "train_batch.npz"
DECODE_SRC = "decode_src.npy"
PREPARED = "prepared.json"


def pieces(vocab_size: int) -> list[str]:
  """The token string of every id (CTranslate2 takes tokens as strings)."""
  return ["<pad>", "<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(4, vocab_size)]


def train_batch(directory) -> dict:
  with np.load(pathlib.Path(directory) / TRAIN_BATCH) as batch:
    return {key: batch[key] for key in batch.files}


def decode_src(directory) -> np.ndarray:
  return np.load(pathlib.Path(directory) / DECODE_SRC)
