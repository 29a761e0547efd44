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

An epoch is planned from the pairs' length arrays alone (a Plan: a few integer arrays, whatever the
corpus's size), and each process assembles only its own rows of a batch, reading the ids of only the
pairs in them (data.tokens: flat arrays, memory-mapped from data/cache.py's on-disk corpus).
"""
from __future__ import annotations

import numpy as np

from data.sources import report_skipped
from data.tokens import TokenPairs, ranges
from data.vocab import BOS, EOS

# Names how BatchIterator forms batches (saved with its position; see BatchIterator.set_state).
ORDER = "pairs-by-batch_tokens"

BATCH_KEYS = ("src", "src_segments", "src_positions", "tgt_in", "tgt_out", "tgt_segments", "tgt_positions")
OPTIONAL_BATCH_KEYS = ("tgt_weights",)


_SHOW = 5   # how many too-long pairs a warning names


def bucket_lengths(max_len: int, fine: bool = False) -> list[int]:
  """8, 12, 16, 24, 32, 48, 64, ... up to max_len (always included); fine (config.data.fine_buckets):
  every multiple of 8 up to 128, of 16 above (less padding, about twice as many batch shapes)."""
  if fine:
    return [n for n in (*range(8, 129, 8), *range(144, max_len, 16)) if n < max_len] + [max_len]
  out, length = [], 8
  while length < max_len:
    out += [n for n in (length, length * 3 // 2) if n < max_len]
    length *= 2
  return out + [max_len]


def tokenize(vocab, pairs, origins=None, max_len: int | None = None, what: str = "data",
             source_eos: bool = False):
  """Pairs of text -> (src_ids, tgt_ids, kept_indices); with max_len, longer pairs are skipped and counted.
  For small sets (dev, test, tests); the training split is tokenized once into data/cache.py's arrays.

  src is the plain encoding, followed by EOS if source_eos (config.data.source_eos; decoding appends it
  the same way); tgt gets room for BOS/EOS (its encoded length + 1 must fit max_len).
  """
  src_ids = [s + [EOS] if source_eos else s for s in vocab.encode_batch([s for s, _ in pairs])]
  tgt_ids = vocab.encode_batch([t for _, t in pairs], "target")
  lengths = lambda seqs: np.fromiter(map(len, seqs), np.int64, len(seqs))
  origin = (lambda i: origins[i]) if origins else (lambda i: f"pair {i}")
  keep = fitting(lengths(src_ids), lengths(tgt_ids), max_len, origin, what).tolist()
  return [np.asarray(src_ids[i], np.int32) for i in keep], [np.asarray(tgt_ids[i], np.int32) for i in keep], keep


def fitting(src_len, tgt_len, max_len: int | None, origin=None, what: str = "data") -> np.ndarray:
  """Indices [kept] of the pairs whose source fits max_len and target max_len - 1 (room for BOS/EOS);
  the others are counted and reported, the first few named by origin(i). No max_len: all of them."""
  if not max_len:
    return np.arange(len(src_len))
  kept, first, count, chunk = [np.zeros(0, _index_dtype(len(src_len)))], [], 0, 1 << 20
  for start in range(0, len(src_len), chunk):   # a chunk at a time: no [pairs] temporaries
    too_long = (src_len[start:start + chunk] > max_len) | (tgt_len[start:start + chunk] >= max_len)
    count += int(too_long.sum())
    first += (np.flatnonzero(too_long)[:_SHOW - len(first)] + start).tolist()
    kept.append(np.flatnonzero(~too_long).astype(kept[0].dtype) + start)
  if count:
    origin = origin or (lambda i: f"pair {i}")
    report_skipped({f"longer than max_len={max_len} tokens": (count, [origin(i) for i in first])}, what)
  if count == len(src_len):
    raise ValueError(f"{what}: every pair is longer than config.data.max_len={max_len} tokens; "
                     f"raise max_len")
  return np.concatenate(kept)


class Kept:
  """lengths[keep] without copying it: what the planners read of the pairs that fit max_len."""

  def __init__(self, lengths, keep):
    self.lengths, self.keep = lengths, keep

  def __len__(self) -> int:
    return len(self.keep)

  def __getitem__(self, index):
    return self.lengths[self.keep[index]]


def _empty(rows: int, src_len: int, tgt_len: int) -> dict:
  return {k: np.zeros((rows, src_len if k.startswith("src") else tgt_len), np.int32) for k in BATCH_KEYS}


def _index_dtype(n: int):
  return np.int32 if n < 2 ** 31 else np.int64


def rows_for(length: int, batch_tokens: int, row_multiple: int) -> int:
  """Rows of a packed batch (rows of `length` slots, nearly full) under the budget, a multiple of
  row_multiple."""
  return max(row_multiple, (batch_tokens // length) // row_multiple * row_multiple)


def _shortest_in_bucket(length: int, max_len: int, fine: bool = False) -> int:
  """The fewest tokens (the longer side of a pair) that a pair of the bucket `length` can need."""
  lengths = bucket_lengths(max_len, fine)
  b = lengths.index(length)
  return lengths[b - 1] + 1 if b else max(1, length // 2)


def bucket_rows(length: int, max_len: int, batch_tokens: int, row_multiple: int = 1, fine: bool = False) -> int:
  """Rows of a bucketed batch of padded length `length`, a multiple of row_multiple.

  A bucket's batch holds up to batch_tokens real source and batch_tokens real target tokens (see
  plan_buckets), so its fixed shape has room for that many of the bucket's shortest pairs; the rows its
  pairs do not fill are padding (no loss weight). Pairs of the first bucket shorter than half its length
  stop at this row cap before they reach the budget.
  """
  pairs = max(1, batch_tokens // _shortest_in_bucket(length, max_len, fine))
  return -(-pairs // row_multiple) * row_multiple


def packing_cuts(src_len, tgt_len, budget: int, cap: int | None = None, order=None) -> np.ndarray:
  """Greedy cut points [0, e1, e2, ..., n] of the pairs `order` (default: all, in turn): each group takes
  pairs until the next would bring its source tokens or its target tokens (target + EOS: tgt_len + 1)
  over budget, or until it has cap pairs (never empty).

  The same groups as adding one pair at a time, found by searching cumulative sums a window at a time:
  one Python step per group, not per pair, and memory bounded by the window.
  """
  n = len(src_len) if order is None else len(order)
  dtype = _index_dtype(n + 1)
  cuts, pos = [np.zeros(1, dtype)], 0
  window = max(1 << 16, 4 * (cap or budget))   # longer than any group (a target costs >= 1 token)
  while pos < n:
    end = min(n, pos + window)
    pick = slice(pos, end) if order is None else order[pos:end]
    sums = []
    for lengths, extra in ((src_len, 0), (tgt_len, 1)):
      c = np.zeros(end - pos + 1, np.int64)                        # [window + 1] tokens before each pair
      np.cumsum(lengths[pick], out=c[1:])
      c[1:] += extra * np.arange(1, end - pos + 1)
      sums.append(np.searchsorted(c, c[:-1] + budget, "right") - 1)   # [window] where a group from i ends
    here = np.arange(end - pos)
    ends = np.minimum(*sums) if cap is None else np.minimum(np.minimum(*sums), here + cap)
    ends = np.maximum(ends, here + 1).tolist()
    i, size, found = 0, end - pos, []
    while i < size:
      j = ends[i]
      if j >= size and end < n:   # this group may go on past the window: start the next window at it
        break
      found.append(j)
      i = j
    cuts.append(np.asarray(found, dtype) + pos)
    pos += i
  return np.concatenate(cuts)


def _nonzero(mask) -> np.ndarray:
  """np.flatnonzero(mask) as int32 where that fits, a chunk at a time (never an int64 [pairs] array)."""
  dtype, chunk = _index_dtype(len(mask)), 1 << 20
  return np.concatenate([np.zeros(0, dtype)] + [np.flatnonzero(mask[i:i + chunk]).astype(dtype) + i
                                                for i in range(0, len(mask), chunk)])


class Plan:
  """One epoch's batches as arrays: batch b holds pairs members[first[b]:last[b]], in rows of
  row_bounds (packed; several pairs a row) or one pair a row (bucketed), padded to lengths[b]."""

  def __init__(self, members, first, last, lengths, row_bounds=None):
    self.members, self.first, self.last = members, first, last
    self.lengths, self.row_bounds = lengths, row_bounds

  def __len__(self) -> int:
    return len(self.first)

  def batch(self, b: int):
    """(padded length, pair indices [k], row bounds [rows + 1] into them) of batch b."""
    if self.row_bounds is None:
      first, last = int(self.first[b]), int(self.last[b])
      return int(self.lengths[b]), self.members[first:last], np.arange(last - first + 1)
    rows = self.row_bounds[int(self.first[b]):int(self.last[b]) + 1]
    return int(self.lengths[b]), self.members[int(rows[0]):int(rows[-1])], rows - rows[0]


def plan_buckets(src_len, tgt_len, max_len: int, batch_tokens: int, rng, fine: bool = False) -> Plan:
  """One epoch of bucketed batches from the pairs' lengths (tgt without EOS; every pair fits max_len).

  Each batch takes pairs of one length bucket until the next pair would bring its real source tokens or
  its real target tokens (target + EOS) over batch_tokens, as the paper's "approximately 25000 source
  tokens and 25000 target tokens" and fairseq's --max-tokens count them, or until the bucket's row cap
  (bucket_rows). Padding is not counted. Which pairs form a batch does not depend on row_multiple.
  """
  lengths = bucket_lengths(max_len, fine)
  table = np.searchsorted(lengths, np.arange(max_len + 1)).astype(np.uint8)   # longer side -> its bucket
  which = np.empty(len(src_len), np.uint8)                         # [pairs] the smallest bucket that fits
  for start in range(0, len(src_len), 1 << 20):
    part = slice(start, start + (1 << 20))
    which[part] = table[np.maximum(src_len[part], tgt_len[part] + 1)]
  members, first, last, padded, start = [], [], [], [], 0
  for b, length in enumerate(lengths):
    bucket = _nonzero(which == b)
    if rng is not None:
      rng.shuffle(bucket)
    cap = bucket_rows(length, max_len, batch_tokens, fine=fine)
    cuts = packing_cuts(src_len, tgt_len, batch_tokens, cap, order=bucket)
    members.append(bucket)
    first.append(start + cuts[:-1])
    last.append(start + cuts[1:])
    padded.append(np.full(len(cuts) - 1, length, np.int64))
    start += len(bucket)
  del which
  order = rng.permutation(sum(map(len, first))) if rng is not None else slice(None)
  cat = np.concatenate
  return Plan(cat(members), cat(first)[order], cat(last)[order], cat(padded)[order])


def plan_packed(src_len, tgt_len, max_len: int, batch_tokens: int, rng) -> Plan:
  """One epoch of packed batches: pairs in shuffled order fill rows of max_len source and max_len
  target slots, rows_for(...) rows a batch."""
  order = np.arange(len(src_len), dtype=_index_dtype(len(src_len)))
  if rng is not None:
    rng.shuffle(order)
  row_bounds = packing_cuts(src_len, tgt_len, max_len, order=order)
  rows, per_batch = len(row_bounds) - 1, rows_for(max_len, batch_tokens, 1)
  first = np.arange(0, rows, per_batch)
  return Plan(order, first, np.minimum(first + per_batch, rows), np.full(len(first), max_len),
              row_bounds)


def assemble(sequences, length: int, members, row_bounds, rows: int, first_row: int = 0) -> dict:
  """Rows first_row .. first_row + rows of a batch of padded length `length` (see the module docstring):
  pairs `members` in rows `row_bounds` ([rows of the plan + 1] into members; rows past them are padding).
  sequences(indices) -> (src ids, src lengths, tgt ids, tgt lengths, tgt_weights ids or None), each side
  end to end (data.tasks.sequences); only the pairs of these rows are read."""
  planned = len(row_bounds) - 1                                    # rows with pairs; the rest are padding
  row_bounds = np.asarray(row_bounds, np.int64)[min(first_row, planned):min(first_row + rows, planned) + 1]
  mine = members[int(row_bounds[0]):int(row_bounds[-1])]
  src, src_len, tgt, tgt_len, weights = sequences(mine)
  per_row = np.diff(row_bounds)                                    # [rows here] pairs in each row
  row = np.repeat(np.arange(len(per_row)), per_row)                # [k] each pair's row
  first_of_row = np.repeat(row_bounds[:-1] - row_bounds[0], per_row)   # [k] its row's first pair
  segment = np.arange(len(mine)) - first_of_row + 1                # [k] numbered from 1 in each row
  batch = _empty(rows, length, length)
  flat = {key: batch[key].reshape(-1) for key in BATCH_KEYS}      # [rows * length] views
  for side, ids, size in (("src", src, src_len), ("tgt", tgt, tgt_len + 1)):
    before = np.cumsum(size) - size
    start = row * length + before - before[first_of_row]           # [k] each pair's first slot
    where = ranges(start, size)                                    # flat slots of every pair's tokens
    if side == "src":
      flat["src"][where] = ids
    else:   # tgt_in = BOS + target, tgt_out = target + EOS, per pair
      tokens = ranges(start, tgt_len)                              # the target's slots in tgt_out
      flat["tgt_out"][tokens] = ids
      flat["tgt_out"][start + tgt_len] = EOS
      flat["tgt_in"][tokens + 1] = ids
      flat["tgt_in"][start] = BOS
      if weights is not None:
        batch["tgt_weights"] = np.zeros((rows, length), np.int32)
        batch["tgt_weights"].reshape(-1)[where] = weights
    flat[f"{side}_segments"][where] = np.repeat(segment, size)
    flat[f"{side}_positions"][where] = where - np.repeat(start, size)
  return batch


class BatchIterator:
  """Infinite iterator over training batches, reshuffled every epoch from (seed, epoch).

  Which pairs form each batch depends only on the data, seed, batch_tokens, max_len and pack: never on
  the hardware. row_multiple (devices x grad_accum_steps) only pads each batch with empty rows (no loss
  weight) to a multiple the mesh can split, so a run resumes on 1, 2 or 8 devices, or 1 or 2 processes,
  with the same batches. Its whole position is (epoch, index of the next batch in that epoch's plan),
  which get_state/set_state save and restore. Each process assembles only its own block of every global
  batch's rows, reading only their pairs (process_index of process_count; row_multiple must be a
  multiple of process_count).

  The pairs: src_ids and tgt_ids, per-pair id sequences (translation pairs as they are), or
  `sequences=(src_len, tgt_len, get)`: every pair's lengths ([pairs] arrays, tgt without EOS) and
  get(indices) -> the ids of some (data.tasks.sequences; what data.make_train_iterator passes for a
  task over the cached corpus). Plans read the lengths only. finish: None, or finish(local batch,
  (seed, epoch, index), (first row, global rows)) -> batch, a task's last touch on every batch (the
  masked LM masks there), seeded by the batch's position so that a resumed run sees the same batches.
  """

  def __init__(self, src_ids=None, tgt_ids=None, *, max_len, batch_tokens, row_multiple, seed, pack=False,
               process_index=0, process_count=1, sequences=None, finish=None, fine_buckets=False):
    if row_multiple % process_count:
      raise ValueError(f"row_multiple={row_multiple} must be a multiple of process_count={process_count}")
    if sequences is None:
      pairs = TokenPairs.from_ids(src_ids, tgt_ids)
      sequences = (pairs.src.lengths, pairs.tgt.lengths,
                   lambda i: (*pairs.src.gather(i), *pairs.tgt.gather(i), None))
    self.src_len, self.tgt_len, self.sequences = sequences
    self.finish = finish
    self.max_len, self.batch_tokens, self.seed, self.pack = max_len, batch_tokens, seed, pack
    self.fine_buckets = fine_buckets
    self.row_multiple = row_multiple
    self.process_index, self.process_count = process_index, process_count
    self.epoch, self.index = 0, 0
    self._plan_epoch, self._plan = None, None

  def _epoch_plan(self) -> Plan:
    if self._plan_epoch != self.epoch:
      self._plan = None   # the last epoch's arrays go before the next epoch's are made
      rng = np.random.default_rng([self.seed, self.epoch])
      if self.pack:
        self._plan = plan_packed(self.src_len, self.tgt_len, self.max_len, self.batch_tokens, rng)
      else:
        self._plan = plan_buckets(self.src_len, self.tgt_len, self.max_len, self.batch_tokens, rng,
                                  self.fine_buckets)
      self._plan_epoch = self.epoch
    return self._plan

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    plan = self._epoch_plan()
    if self.index >= len(plan):
      self.epoch, self.index = self.epoch + 1, 0
      plan = self._epoch_plan()
    length, members, row_bounds = plan.batch(self.index)
    rows = self.rows(length)
    local = rows // self.process_count
    first = self.process_index * local
    batch = assemble(self.sequences, length, members, row_bounds, local, first)
    if self.finish is not None:
      batch = self.finish(batch, (self.seed, self.epoch, self.index), (first, rows))
    self.index += 1
    return batch

  def rows(self, length: int) -> int:
    """Global rows of a batch of padded length `length` (fixed per length: bounded compiles): the rows
    the plan allows, rounded up to row_multiple with empty rows (the batch's pairs never depend on it)."""
    if self.pack:
      rows = rows_for(length, self.batch_tokens, 1)
    else:
      rows = bucket_rows(length, self.max_len, self.batch_tokens, fine=self.fine_buckets)
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
