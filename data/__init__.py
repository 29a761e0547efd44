"""Text -> token batches: the embedded corpus, TFDS corpora and your own files, one shared vocabulary.

    vocab = run.get_vocab(config.data, workdir)   # the run directory's vocab.model (run/)
    train_iter = make_train_iterator(config.data, vocab, seed=0, row_multiple=num_devices)  # pads only
    dev_batches = make_eval_batches(config.data, vocab, load_pairs(config.data, "dev"), row_multiple=8)

Both form config.data.task's batches (data/tasks.py; translation unless the config says otherwise).
"""
from data import tasks
from data.batching import (BatchIterator, assemble, bucket_lengths, bucket_rows, keep_fitting, plan_buckets,
                           tokenize)
from data.sources import DataError, check_config, load_pairs, load_pairs_with_origins
from data.vocab import BOS, EOS, PAD, UNK, Vocab, check_vocab


def source_eos(data_config) -> bool:
  """config.data.source_eos: whether sources end with EOS (False for runs saved before it existed)."""
  return bool(data_config.get("source_eos", False))


def task_ids(data_config, vocab, pairs, origins=None, max_len=None, what="data"):
  """Pairs of text -> the task's (src_ids, tgt_ids, tgt_weights or None) (data.tasks.sequences), without
  the sequences longer than max_len (counted and reported as `tokenize` does)."""
  src_ids, tgt_ids, _ = tokenize(vocab, pairs, what=what, source_eos=source_eos(data_config))
  src_ids, tgt_ids, weights = tasks.sequences(data_config, src_ids, tgt_ids)
  keep = keep_fitting(src_ids, tgt_ids, max_len, origins, what)
  pick = lambda items: None if items is None else [items[i] for i in keep]
  return pick(src_ids), pick(tgt_ids), pick(weights)


def make_train_iterator(data_config, vocab, *, seed, row_multiple, process_index=0, process_count=1):
  """The infinite, resumable training iterator (see data.batching.BatchIterator)."""
  pairs, origins = load_pairs_with_origins(data_config, "train")
  src_ids, tgt_ids, weights = task_ids(data_config, vocab, pairs, origins, int(data_config.max_len),
                                       "config.data train")
  return BatchIterator(src_ids, tgt_ids, max_len=int(data_config.max_len),
                       batch_tokens=int(data_config.batch_tokens), row_multiple=row_multiple, seed=seed,
                       pack=bool(data_config.pack), process_index=process_index,
                       process_count=process_count, tgt_weights=weights,
                       finish=tasks.finish_fn(data_config, vocab.size))


def make_eval_batches(data_config, vocab, pairs, *, row_multiple, process_index=0, process_count=1):
  """Every pair exactly once, in length buckets, no shuffling and no length filter. A list of batches.

  row_multiple: rows of each global batch (all devices of all processes) are a multiple of it; with
  process_count > 1 each process gets its own block of rows of every batch.
  """
  src_ids, tgt_ids, weights = task_ids(data_config, vocab, pairs, what="eval")
  finish = tasks.finish_fn(data_config, vocab.size)   # the masked LM: the same masks at every eval
  longest = max(max(len(s), len(t) + 1) for s, t in zip(src_ids, tgt_ids))
  max_len = max(int(data_config.max_len), -(-longest // 8) * 8)
  multiple = row_multiple
  if multiple % process_count:
    raise ValueError(f"row_multiple={row_multiple} must be a multiple of process_count={process_count}")
  out = []
  for length, members in plan_buckets(src_ids, tgt_ids, max_len, int(data_config.batch_tokens), multiple,
                                      rng=None):
    rows = bucket_rows(length, max_len, int(data_config.batch_tokens), multiple)   # fixed shapes: bounded compiles
    batch = assemble(src_ids, tgt_ids, length, members, rows, packed=False, tgt_weights=weights)
    if finish is not None:
      batch = finish(batch, (len(out),))
    local = rows // process_count
    out.append({k: v[process_index * local:(process_index + 1) * local] for k, v in batch.items()})
  return out


__all__ = ["BOS", "EOS", "PAD", "UNK", "BatchIterator", "DataError", "Vocab", "check_config", "check_vocab",
           "load_pairs", "make_eval_batches", "make_train_iterator", "source_eos", "task_ids", "tasks"]
