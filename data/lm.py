"""Token sequences for the decoder-only and encoder-only members of the family (docs/family.md).

The vocabulary has no [SEP] or [MASK] piece (adding one would change the default experiment's
vocabulary), so the decoder-only translation separator is BOS ("a target starts here") and the
masked-LM mask is UNK, which the synthetic corpus never produces.

  decoder-only translation   in:  BOS s1 .. sm BOS t1 .. tn        loss on t1 .. tn EOS only
                             out: s1 .. sm BOS t1 .. tn EOS
  language model             in:  BOS x1 .. xn;  out: x1 .. xn EOS (loss on every token)
  masked LM                  BERT's 80/10/10 corruption of 15% of the real tokens; loss on those only
"""
from __future__ import annotations

import numpy as np

from data.vocab import BOS, EOS, PAD, UNK

SEP = BOS            # decoder-only translation: what separates source from target
MASK = UNK           # masked LM: what replaces 80% of the chosen tokens
FIRST_PIECE = 4      # ids below are special (PAD, UNK, BOS, EOS)


def decoder_only_pair(src, tgt):
  """One translation pair (int sequences without specials) -> (tgt_in, tgt_out, weights), int32 /
  float32 [m + n + 2]: the model reads source and target as one sequence, scored on the target only."""
  src, tgt = list(src), list(tgt)
  tokens_in = [BOS] + src + [SEP] + tgt
  tokens_out = src + [SEP] + tgt + [EOS]
  weights = [0.0] * (len(src) + 1) + [1.0] * (len(tgt) + 1)
  return (np.asarray(tokens_in, np.int32), np.asarray(tokens_out, np.int32),
          np.asarray(weights, np.float32))


def lm_text(ids):
  """Plain text ids -> (tgt_in, tgt_out, weights): BOS + text, text + EOS, every token scored."""
  ids = list(ids)
  return (np.asarray([BOS] + ids, np.int32), np.asarray(ids + [EOS], np.int32),
          np.ones(len(ids) + 1, np.float32))


def pad_rows(examples, length: int) -> dict:
  """(tgt_in, tgt_out, weights) triples -> a batch of int32 [rows, length] with 'tgt_in', 'tgt_out',
  'tgt_segments' (1 on tokens, 0 on padding), 'tgt_positions' and 'tgt_weights' (0/1, as the train
  loop's optional batch key)."""
  rows = len(examples)
  batch = {k: np.zeros((rows, length), np.int32) for k in ("tgt_in", "tgt_out", "tgt_segments",
                                                           "tgt_positions", "tgt_weights")}
  for row, (tokens_in, tokens_out, weights) in enumerate(examples):
    n = len(tokens_in)
    if n > length:
      raise ValueError(f"example {row} has {n} tokens, more than the row length {length}")
    batch["tgt_in"][row, :n] = tokens_in
    batch["tgt_out"][row, :n] = tokens_out
    batch["tgt_segments"][row, :n] = 1
    batch["tgt_positions"][row, :n] = np.arange(n)
    batch["tgt_weights"][row, :n] = weights
  return batch


def mlm_mask(ids, rng: np.random.Generator, vocab_size: int, rate: float = 0.15, rows=None):
  """BERT's masking (Devlin et al. 2019) of ids int [b, len] (0 = padding).

  Each real, non-special token is chosen with probability `rate`; a chosen token becomes MASK with
  probability 0.8, a random piece with 0.1, and stays itself with 0.1. Padding and specials are never
  chosen. Returns (inputs int32 [b, len], targets int32 [b, len] (the original ids), weights float32
  [b, len]: 1 on the chosen tokens, which alone are scored). rows = (first, total): ids are rows
  first..first+b of a batch of `total` rows, masked as that whole batch would be.
  """
  ids = np.asarray(ids, np.int32)
  first, total = rows or (0, ids.shape[0])
  shape = (total, ids.shape[1])
  take = lambda x: x[first:first + ids.shape[0]]                   # [b, len] of the global batch's draws
  chosen = (ids >= FIRST_PIECE) & (take(rng.random(shape)) < rate)
  action = take(rng.random(shape))
  random_ids = take(rng.integers(FIRST_PIECE, vocab_size, shape, dtype=np.int32))
  inputs = np.where(chosen & (action < 0.8), MASK, ids)
  inputs = np.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, inputs)
  return inputs.astype(np.int32), ids, chosen.astype(np.float32)
