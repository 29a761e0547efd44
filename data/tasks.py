"""What the train loop trains: config.data.task, and each task's token sequences (docs/family.md).

    translation       source -> target, the paper's encoder-decoder (the default)
    lm                a language model on one side's text (decoder-only)
    decoder_only_mt   BOS source SEP target -> source SEP target EOS, loss on target + EOS (decoder-only)
    mlm               BERT's masked LM on one side's text (encoder-only), loss on the masked tokens

config.data.task and config.data.text_side (the side lm and mlm read: target for lm, source for mlm
by default) are read with defaults, not declared in experiments/default.py: a new key there would change
the config.json of every run saved before it, and train/ refuses to resume a run whose data.* changed.

Every task is written as translation pairs (`sequences`, from the tokenized pairs' flat arrays) that the
batching code (data/batching.py) buckets and packs as it always has, assemble writing tgt_in = BOS + tgt and tgt_out = tgt + EOS per pair:
    translation       (src, tgt) unchanged
    lm                ([], text)
    decoder_only_mt   ([], src + [SEP] + tgt), with tgt_weights 0 on src + [SEP]  (as data.lm.decoder_only_pair)
    mlm               (text, []), masked per batch by `mask_batch` (data.lm.mlm_mask)
"""
from __future__ import annotations

import numpy as np

from data.lm import SEP, mlm_mask
from data.sources import DataError
from data.tokens import join
from data.vocab import EOS

TASKS = {"translation": "encoder_decoder", "lm": "decoder_only", "decoder_only_mt": "decoder_only",
         "mlm": "encoder_only"}     # task -> the config.model.arch it trains
TRANSLATING = ("translation", "decoder_only_mt")   # the tasks whose model translates (dev and test BLEU)
SIDES = ("source", "target")
_MLM_STREAM = 0x6d6c6d              # the masked LM's random stream, apart from the batch plan's


def source_eos(data_config) -> bool:
  """config.data.source_eos: whether sources end with EOS (False for runs saved before it existed)."""
  return bool(data_config.get("source_eos", False))


def task_of(data_config) -> str:
  """config.data.task, 'translation' where the config has no such key."""
  return data_config.get("task", "translation")


def translates(data_config) -> bool:
  """Whether the task's model translates (and so has a dev and test BLEU)."""
  return task_of(data_config) in TRANSLATING


def text_side(data_config) -> str:
  """The side lm and mlm read: config.data.text_side, else target for lm and source for mlm."""
  return data_config.get("text_side", "") or ("source" if task_of(data_config) == "mlm" else "target")


def check_task(data_config, arch: str) -> None:
  """Raises DataError (one line) for an unknown task, a task the architecture cannot train, or a bad
  text_side."""
  task = task_of(data_config)
  allowed = ", ".join(f"{name} (arch {needs})" for name, needs in TASKS.items())
  if task not in TASKS:
    raise DataError(f"config.data.task={task!r} is not one of: {allowed}")
  if TASKS[task] != arch:
    raise DataError(f"config.data.task={task!r} needs config.model.arch={TASKS[task]!r}, not {arch!r}; "
                    f"the tasks: {allowed}")
  if text_side(data_config) not in SIDES:
    raise DataError(f"config.data.text_side={text_side(data_config)!r} is not one of {list(SIDES)}")


def lengths(data_config, pairs):
  """The task's sequence lengths of every pair of `pairs` (data.tokens.TokenPairs): (src [pairs],
  tgt [pairs]), tgt without the EOS or BOS the batch adds. What batch planning and the max_len filter
  read; `sequences` makes the ids they count."""
  task, eos = task_of(data_config), int(source_eos(data_config))
  src, tgt = pairs.src.lengths, pairs.tgt.lengths
  zero = np.zeros(len(pairs), np.uint8)
  if task == "translation":
    return (src + eos if eos else src), tgt
  if task == "decoder_only_mt":   # source (+ EOS) + SEP + target
    return zero, src.astype(np.int32) + (eos + 1) + tgt
  text = src if text_side(data_config) == "source" else tgt
  return (zero, text) if task == "lm" else (text, zero)


def sequences(data_config, pairs):
  """get(indices) -> the ids of pairs `indices` of `pairs` (data.tokens.TokenPairs) as the task's batches
  hold them (see the module docstring): (src ids end to end, src lengths [k], tgt ids end to end, tgt
  lengths [k], tgt_weights or None), the weights (decoder_only_mt: 0 on source + SEP) laid out as
  tgt_out is: len(tgt) + 1 per pair. The config is read once, here."""
  task, eos, side = task_of(data_config), source_eos(data_config), text_side(data_config)

  def get(indices):
    src, src_len = pairs.src.gather(indices)
    tgt, tgt_len = pairs.tgt.gather(indices)
    none = (np.zeros(0, np.int32), np.zeros(len(src_len), np.int64))
    if eos and task in TRANSLATING:
      src, src_len = join([(src, src_len), EOS])
    if task == "translation":
      return src, src_len, tgt, tgt_len, None
    if task == "decoder_only_mt":
      seq, seq_len = join([(src, src_len), SEP, (tgt, tgt_len)])
      zeros, ones = np.zeros(len(src), np.int32), np.ones(len(tgt), np.int32)
      weights, _ = join([(zeros, src_len), 0, (ones, tgt_len), 1])
      return *none, seq, seq_len, weights
    text = (src, src_len) if side == "source" else (tgt, tgt_len)
    return (*none, *text, None) if task == "lm" else (*text, *none, None)
  return get


def finish_fn(data_config, vocab_size: int):
  """The task's last touch on each assembled batch, finish(batch, key, rows) -> batch with key a tuple
  of ints that names the batch (BatchIterator passes (seed, epoch, index)) and rows = (first, total):
  the batch holds rows first.. of a global batch of `total` rows (its random draws are the global
  batch's, so a process's rows do not depend on how many processes share the batch). Or None."""
  if task_of(data_config) != "mlm":
    return None
  return lambda batch, key, rows=None: mask_batch(batch, np.random.default_rng([*key, _MLM_STREAM]),
                                                  vocab_size, rows)


def mask_batch(batch: dict, rng: np.random.Generator, vocab_size: int, rows=None) -> dict:
  """A masked-LM batch (the text in src*, empty targets) -> src corrupted by BERT's 80/10/10 masking,
  tgt_out the original text, tgt_weights 1 on the chosen tokens only (never padding); tgt_in,
  tgt_segments and tgt_positions mirror src's (the encoder-only model reads src alone). rows: see
  finish_fn."""
  inputs, targets, weights = mlm_mask(batch["src"], rng, vocab_size, rows=rows)
  return {**batch, "src": inputs, "tgt_in": inputs, "tgt_out": targets,
          "tgt_segments": batch["src_segments"], "tgt_positions": batch["src_positions"],
          "tgt_weights": weights.astype(np.int32)}
