"""Text -> token batches: the embedded corpus, TFDS corpora and your own files, one shared vocabulary.

    vocab = run.get_vocab(config.data, workdir)   # the run directory's vocab.model (run/)
    pairs = tokenized(config.data, vocab)        # the training split, tokenized once (data/cache.py)
    choice = derive_train_max_len(config.data, pairs)   # config.data.max_len=0: from the corpus
    train_iter = make_train_iterator(config.data, vocab, seed=0, row_multiple=num_devices)  # pads only
    # config.data.synthetic_path: back-translated pairs join the stream, tagged (data/mixing.py)
    dev_batches = make_eval_batches(config.data, vocab, load_pairs(config.data, "dev"), row_multiple=8)

Both form config.data.task's batches (data/tasks.py; translation unless the config says otherwise).
"""
from data import mixing, tasks
from data.batching import (BatchIterator, Kept, assemble, bucket_lengths, bucket_rows, fitting,
                           plan_buckets, tokenize)
from data.cache import tokenized
from data.max_len import MaxLenChoice, derive_max_len
from data.sources import (SYNTHETIC, DataError, check_config, load_pairs, load_pairs_with_origins,
                          synthetic_path)
from data.tasks import source_eos
from data.tokens import TokenPairs
from data.vocab import BOS, EOS, PAD, UNK, Vocab, check_vocab


def task_sequences(data_config, pairs, max_len=None, what="data"):
  """(src_len, tgt_len, get) of config.data.task's sequences over `pairs` (data.tokens.TokenPairs),
  without those longer than max_len (counted and reported, the first few by origin): what
  BatchIterator(sequences=...) reads."""
  src_len, tgt_len = tasks.lengths(data_config, pairs)
  keep = fitting(src_len, tgt_len, max_len, pairs.origin, what)
  get = tasks.sequences(data_config, pairs)
  if len(keep) == len(pairs):
    return src_len, tgt_len, get
  return Kept(src_len, keep), Kept(tgt_len, keep), lambda indices: get(keep[indices])


def derive_train_max_len(data_config, pairs) -> MaxLenChoice:
  """The max_len that keeps nearly every training pair (data.max_len.derive_max_len) over the task's
  sequence lengths of `pairs` (data.tokens.TokenPairs, the training split's cache): what
  config.data.max_len=0 asks for. The caller sets config.data.max_len to its .max_len."""
  if not len(pairs):
    raise DataError("config.data.max_len=0 derives max_len from the training split, which has no pairs")
  return derive_max_len(*tasks.lengths(data_config, pairs))


def make_train_iterator(data_config, vocab, *, seed, row_multiple, process_index=0, process_count=1):
  """The infinite, resumable training iterator (see data.batching.BatchIterator) over the training
  split's cache, made first if absent."""
  pairs = tokenized(data_config, vocab, "train")
  if synthetic_path(data_config):   # back-translated pairs mixed in, tagged (data/mixing.py)
    sequences = mixing.mixed_sequences(data_config, vocab, pairs, tokenized(data_config, vocab, SYNTHETIC),
                                       int(data_config.max_len), seed)
  else:
    sequences = task_sequences(data_config, pairs, int(data_config.max_len), "config.data train")
  return BatchIterator(max_len=int(data_config.max_len), batch_tokens=int(data_config.batch_tokens),
                       row_multiple=row_multiple, seed=seed, pack=bool(data_config.pack),
                       process_index=process_index, process_count=process_count, sequences=sequences,
                       finish=tasks.finish_fn(data_config, vocab.size),
                       fine_buckets=bool(data_config.get("fine_buckets", False)))


def make_eval_batches(data_config, vocab, pairs, *, row_multiple, process_index=0, process_count=1):
  """Every pair exactly once, in length buckets, no shuffling and no length filter. A list of batches.

  row_multiple: rows of each global batch (all devices of all processes) are a multiple of it; with
  process_count > 1 each process gets its own block of rows of every batch.
  """
  src_ids, tgt_ids, _ = tokenize(vocab, pairs, what="eval")
  src_len, tgt_len, get = task_sequences(data_config, TokenPairs.from_ids(src_ids, tgt_ids))
  finish = tasks.finish_fn(data_config, vocab.size)   # the masked LM: the same masks at every eval
  longest = int(max(src_len.max(initial=0), tgt_len.max(initial=0) + 1))
  max_len = max(int(data_config.max_len), -(-longest // 8) * 8)
  if row_multiple % process_count:
    raise ValueError(f"row_multiple={row_multiple} must be a multiple of process_count={process_count}")
  fine = bool(data_config.get("fine_buckets", False))
  plan, out = plan_buckets(src_len, tgt_len, max_len, int(data_config.batch_tokens), rng=None, fine=fine), []
  for b in range(len(plan)):
    length, members, row_bounds = plan.batch(b)
    rows = bucket_rows(length, max_len, int(data_config.batch_tokens), row_multiple, fine)   # fixed shapes
    local = rows // process_count
    batch = assemble(get, length, members, row_bounds, local, process_index * local)
    if finish is not None:
      batch = finish(batch, (len(out),), (process_index * local, rows))
    out.append(batch)
  return out


__all__ = ["BOS", "EOS", "PAD", "UNK", "BatchIterator", "DataError", "TokenPairs", "Vocab", "check_config",
           "check_vocab", "derive_train_max_len", "load_pairs", "make_eval_batches", "make_train_iterator",
           "mixing", "source_eos", "task_sequences", "tasks", "tokenized"]
