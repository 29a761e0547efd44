"""Token batches: length buckets under a token budget, or packed rows; deterministic and resumable.

A batch is a dict of int32 numpy arrays [rows, length]:
    src, src_segments, src_positions, tgt_in, tgt_out, tgt_segments, tgt_positions
and, for the tasks that score only some target positions (data/tasks.py), the optional
    tgt_weights    1 where the loss scores tgt_out, 0 elsewhere (absent: every real target token)
tgt_in is BOS + target and tgt_out is target + EOS, per pair (so in a packed row every segment starts with
BOS, never with the previous segment's EOS). Segments number the pairs of a row from 1; 0 is padding.
Padding rows (to keep shapes fixed) have all-zero segments and so carry no loss weight.

Shapes come from a small fixed set (bucket lengths x rows per bucket, or one packed shape), so the jitted
step compiles a bounded number of times.
"""
from __future__ import annotations

import numpy as np
import tqdm

from data.sources import report_skipped
from data.vocab import BOS, EOS

# Names how BatchIterator forms batches (saved with its position; see BatchIterator.set_state).
ORDER = "pairs-by-batch_tokens"

BATCH_KEYS = ("src", "src_segments", "src_positions", "tgt_in", "tgt_out", "tgt_segments", "tgt_positions")
OPTIONAL_BATCH_KEYS = ("tgt_weights",)


def bucket_lengths(max_len: int) -> list[int]:
  """8, 12, 16, 24, 32, 48, 64, ... up to max_len (always included)."""
  out, length = [], 8
  while length < max_len:
    out += [n for n in (length, length * 3 // 2) if n < max_len]
    length *= 2
  return out + [max_len]


def tokenize(vocab, pairs, origins=None, max_len: int | None = None, what: str = "data",
             source_eos: bool = False):
  """Pairs of text -> (src_ids, tgt_ids, kept_indices); with max_len, longer pairs are skipped and counted.

  src is the plain encoding, followed by EOS if source_eos (config.data.source_eos; decoding appends it
  the same way); tgt gets room for BOS/EOS (its encoded length + 1 must fit max_len).
  """
  chunk = 20_000
  src_ids, tgt_ids = [], []
  for start in tqdm.trange(0, len(pairs), chunk, desc=f"tokenize {what}", disable=len(pairs) < 100_000,
                           leave=False):
    part = pairs[start:start + chunk]
    src_ids += [s + [EOS] if source_eos else s for s in vocab.encode_batch([s for s, _ in part])]
    tgt_ids += vocab.encode_batch([t for _, t in part])
  keep = keep_fitting(src_ids, tgt_ids, max_len, origins, what)
  return [np.asarray(src_ids[i], np.int32) for i in keep], [np.asarray(tgt_ids[i], np.int32) for i in keep], keep


def keep_fitting(src_ids, tgt_ids, max_len: int | None, origins=None, what: str = "data") -> list[int]:
  """Indices of the pairs whose source fits max_len and target max_len - 1 (room for BOS/EOS); the others
  are counted and reported. No max_len: all of them."""
  keep, too_long = [], []
  for i, (s, t) in enumerate(zip(src_ids, tgt_ids)):
    if max_len and (len(s) > max_len or len(t) + 1 > max_len):
      too_long.append(origins[i] if origins else f"pair {i}")
    else:
      keep.append(i)
  report_skipped({f"longer than max_len={max_len} tokens": too_long} if too_long else {}, what)
  if not keep:
    raise ValueError(f"{what}: every pair is longer than config.data.max_len={max_len} tokens; "
                     f"raise max_len")
  return keep


def _empty(rows: int, src_len: int, tgt_len: int) -> dict:
  return {k: np.zeros((rows, src_len if k.startswith("src") else tgt_len), np.int32) for k in BATCH_KEYS}


def _put(batch, row, offset_src, offset_tgt, segment, src, tgt, weights=None):
  """Writes one pair into a row at the given offsets (and its loss weights, if the batch has them)."""
  s, t = len(src), len(tgt) + 1
  batch["src"][row, offset_src:offset_src + s] = src
  batch["src_segments"][row, offset_src:offset_src + s] = segment
  batch["src_positions"][row, offset_src:offset_src + s] = np.arange(s)
  batch["tgt_in"][row, offset_tgt] = BOS
  batch["tgt_in"][row, offset_tgt + 1:offset_tgt + t] = tgt
  batch["tgt_out"][row, offset_tgt:offset_tgt + t - 1] = tgt
  batch["tgt_out"][row, offset_tgt + t - 1] = EOS
  batch["tgt_segments"][row, offset_tgt:offset_tgt + t] = segment
  batch["tgt_positions"][row, offset_tgt:offset_tgt + t] = np.arange(t)
  if weights is not None:
    batch["tgt_weights"][row, offset_tgt:offset_tgt + t] = weights


def rows_for(length: int, batch_tokens: int, row_multiple: int) -> int:
  """Rows of a packed batch (rows of `length` slots, nearly full) under the budget, a multiple of
  row_multiple."""
  return max(row_multiple, (batch_tokens // length) // row_multiple * row_multiple)


def _shortest_in_bucket(length: int, max_len: int) -> int:
  """The fewest tokens (the longer side of a pair) that a pair of the bucket `length` can need."""
  lengths = bucket_lengths(max_len)
  b = lengths.index(length)
  return lengths[b - 1] + 1 if b else max(1, length // 2)


def bucket_rows(length: int, max_len: int, batch_tokens: int, row_multiple: int = 1) -> int:
  """Rows of a bucketed batch of padded length `length`, a multiple of row_multiple.

  A bucket's batch holds up to batch_tokens real source and batch_tokens real target tokens (see
  plan_buckets), so its fixed shape has room for that many of the bucket's shortest pairs; the rows its
  pairs do not fill are padding (no loss weight). Pairs of the first bucket shorter than half its length
  stop at this row cap before they reach the budget.
  """
  pairs = max(1, batch_tokens // _shortest_in_bucket(length, max_len))
  return -(-pairs // row_multiple) * row_multiple


def plan_buckets(src_ids, tgt_ids, max_len: int, batch_tokens: int, row_multiple: int, rng):
  """One epoch of bucketed batches: a list of (length, [pair indices]).

  Each batch takes pairs of one length bucket until the next pair would bring its real source tokens or
  its real target tokens (target + EOS) over batch_tokens, as the paper's "approximately 25000 source
  tokens and 25000 target tokens" and fairseq's --max-tokens count them, or until the bucket's row cap
  (bucket_rows). Padding is not counted. Which pairs form a batch does not depend on row_multiple.
  """
  del row_multiple   # the shape rounds its rows up (bucket_rows); the batches themselves do not change
  lengths = bucket_lengths(max_len)
  src_len = np.array([len(s) for s in src_ids], np.int64)
  tgt_len = np.array([len(t) + 1 for t in tgt_ids], np.int64)
  which = np.searchsorted(lengths, np.maximum(src_len, tgt_len))      # smallest bucket that fits
  plan = []
  for b, length in enumerate(lengths):
    members = np.flatnonzero(which == b)
    if rng is not None:
      members = rng.permutation(members)
    cap = bucket_rows(length, max_len, batch_tokens)
    batch, used_src, used_tgt = [], 0, 0
    for i in members.tolist():
      if batch and (len(batch) == cap or used_src + src_len[i] > batch_tokens
                    or used_tgt + tgt_len[i] > batch_tokens):
        plan.append((length, batch))
        batch, used_src, used_tgt = [], 0, 0
      batch.append(i)
      used_src, used_tgt = used_src + src_len[i], used_tgt + tgt_len[i]
    if batch:
      plan.append((length, batch))
  if rng is not None:
    plan = [plan[i] for i in rng.permutation(len(plan))]
  return plan


def plan_packed(src_ids, tgt_ids, max_len: int, batch_tokens: int, row_multiple: int, rng):
  """One epoch of packed batches: a list of (max_len, [[pair indices of a row], ...])."""
  order = rng.permutation(len(src_ids)) if rng is not None else np.arange(len(src_ids))
  rows, current, used_src, used_tgt = [], [], 0, 0
  for i in order.tolist():
    s, t = len(src_ids[i]), len(tgt_ids[i]) + 1
    if current and (used_src + s > max_len or used_tgt + t > max_len):
      rows.append(current)
      current, used_src, used_tgt = [], 0, 0
    current.append(i)
    used_src, used_tgt = used_src + s, used_tgt + t
  if current:
    rows.append(current)
  per_batch = rows_for(max_len, batch_tokens, row_multiple)
  return [(max_len, rows[i:i + per_batch]) for i in range(0, len(rows), per_batch)]


def assemble(src_ids, tgt_ids, length: int, members, rows: int, packed: bool, tgt_weights=None) -> dict:
  """Builds one batch of `rows` rows of `length` tokens from a plan entry. tgt_weights: None, or per
  pair the loss weights of its len(tgt) + 1 output positions (the batch then has 'tgt_weights')."""
  batch = _empty(rows, length, length)
  if tgt_weights is not None:
    batch["tgt_weights"] = np.zeros((rows, length), np.int32)
  for row, member in enumerate(members):
    if packed:
      offset_src = offset_tgt = 0
      for segment, i in enumerate(member, 1):
        weights = None if tgt_weights is None else tgt_weights[i]
        _put(batch, row, offset_src, offset_tgt, segment, src_ids[i], tgt_ids[i], weights)
        offset_src, offset_tgt = offset_src + len(src_ids[i]), offset_tgt + len(tgt_ids[i]) + 1
    else:
      weights = None if tgt_weights is None else tgt_weights[member]
      _put(batch, row, 0, 0, 1, src_ids[member], tgt_ids[member], weights)
  return batch


class BatchIterator:
  """Infinite iterator over training batches, reshuffled every epoch from (seed, epoch).

  Which pairs form each batch depends only on the data, seed, batch_tokens, max_len and pack: never on
  the hardware. row_multiple (devices x grad_accum_steps) only pads each batch with empty rows (no loss
  weight) to a multiple the mesh can split, so a run resumes on 1, 2 or 8 devices, or 1 or 2 processes,
  with the same batches. Its whole position is (epoch, index of the next batch in that epoch's plan),
  which get_state/set_state save and restore. Each process keeps its own block of every global batch's
  rows (process_index of process_count; row_multiple must be a multiple of process_count).

  tgt_weights: None, or per pair the loss weights of its target (see `assemble`). finish: None, or
  finish(global batch, (seed, epoch, index)) -> batch, a task's last touch on every batch (the masked LM
  masks there), seeded by the batch's position so that a resumed run sees the same batches.
  """

  def __init__(self, src_ids, tgt_ids, *, max_len, batch_tokens, row_multiple, seed, pack=False,
               process_index=0, process_count=1, tgt_weights=None, finish=None):
    if row_multiple % process_count:
      raise ValueError(f"row_multiple={row_multiple} must be a multiple of process_count={process_count}")
    self.src_ids, self.tgt_ids, self.tgt_weights, self.finish = src_ids, tgt_ids, tgt_weights, finish
    self.max_len, self.batch_tokens, self.seed, self.pack = max_len, batch_tokens, seed, pack
    self.row_multiple = row_multiple
    self.process_index, self.process_count = process_index, process_count
    self.epoch, self.index = 0, 0
    self._plan_epoch, self._plan = None, None

  def _epoch_plan(self):
    if self._plan_epoch != self.epoch:
      rng = np.random.default_rng([self.seed, self.epoch])
      plan_fn = plan_packed if self.pack else plan_buckets
      self._plan = plan_fn(self.src_ids, self.tgt_ids, self.max_len, self.batch_tokens, 1, rng)
      self._plan_epoch = self.epoch
    return self._plan

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    plan = self._epoch_plan()
    if self.index >= len(plan):
      self.epoch, self.index = self.epoch + 1, 0
      plan = self._epoch_plan()
    length, members = plan[self.index]
    rows = self.rows(length)
    batch = assemble(self.src_ids, self.tgt_ids, length, members, rows, self.pack, self.tgt_weights)
    if self.finish is not None:
      batch = self.finish(batch, (self.seed, self.epoch, self.index))
    self.index += 1
    local = rows // self.process_count
    start = self.process_index * local
    return {k: v[start:start + local] for k, v in batch.items()}

  def rows(self, length: int) -> int:
    """Global rows of a batch of padded length `length` (fixed per length: bounded compiles): the rows
    the plan allows, rounded up to row_multiple with empty rows (the batch's pairs never depend on it)."""
    if self.pack:
      rows = rows_for(length, self.batch_tokens, 1)
    else:
      rows = bucket_rows(length, self.max_len, self.batch_tokens)
    return -(-rows // self.row_multiple) * self.row_multiple

  def get_state(self) -> dict:
    # "order": how batches are formed; a checkpoint without it comes from code whose batches depended on
    # devices x grad_accum_steps.
    return {"epoch": self.epoch, "index": self.index, "order": ORDER}

  def set_state(self, state: dict) -> None:
    """Continues where `state` (from get_state) left off. Raises ValueError if its batches were formed
    differently (a checkpoint of older code, trained with more than one device or accumulation step)."""
    if state.get("order") != ORDER and self.row_multiple != 1:
      raise ValueError(
          f"the checkpoint's data position comes from code that formed batches per devices x "
          f"grad_accum_steps (now {self.row_multiple}); resuming here would change which batches come "
          f"next. Resume with that code, or with 1 device and config.train.grad_accum_steps=1, or start "
          f"a new --workdir")
    self.epoch, self.index = int(state["epoch"]), int(state["index"])

  def epoch_batches(self) -> int:
    return len(self._epoch_plan())
