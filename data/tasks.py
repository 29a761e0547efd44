"""What the train loop trains: config.data.task, and each task's token sequences (docs/family.md).

    translation       source -> target, the paper's encoder-decoder (the default)
    lm                a language model on one side's text (decoder-only)
    decoder_only_mt   BOS source SEP target -> source SEP target EOS, loss on target + EOS (decoder-only)
    mlm               BERT's masked LM on one side's text (encoder-only), loss on the masked tokens

config.data.task and config.data.text_side (the side lm and mlm read: target for lm, source for mlm
by default) are read with defaults, not declared in experiments/default.py: a new key there would change
the config.json of every run saved before it, and train/ refuses to resume a run whose data.* changed.

Every task is written as translation pairs that the batching code (data/batching.py) buckets and packs
as it always has, assemble writing tgt_in = BOS + tgt and tgt_out = tgt + EOS per pair:
    translation       (src, tgt) unchanged
    lm                ([], text)
    decoder_only_mt   ([], src + [SEP] + tgt), with tgt_weights 0 on src + [SEP]  (data.lm.decoder_only_pair)
    mlm               (text, []), masked per batch by `mask_batch` (data.lm.mlm_mask)
"""
from __future__ import annotations

import numpy as np

from data.lm import decoder_only_pair, mlm_mask
from data.sources import DataError
from data.vocab import EOS

TASKS = {"translation": "encoder_decoder", "lm": "decoder_only", "decoder_only_mt": "decoder_only",
         "mlm": "encoder_only"}     # task -> the config.model.arch it trains
TRANSLATING = ("translation", "decoder_only_mt")   # the tasks whose model translates (dev and test BLEU)
SIDES = ("source", "target")
_MLM_STREAM = 0x6d6c6d              # the masked LM's random stream, apart from the batch plan's


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


def sequences(data_config, src_ids, tgt_ids):
  """Tokenized pairs (int32 arrays; sources end with EOS if config.data.source_eos) -> (src_ids,
  tgt_ids, tgt_weights or None) as the task's batches hold them (see the module docstring)."""
  task = task_of(data_config)
  if task == "translation":
    return src_ids, tgt_ids, None
  empty = [np.zeros(0, np.int32)] * len(src_ids)
  if task == "decoder_only_mt":
    triples = [decoder_only_pair(s, t) for s, t in zip(src_ids, tgt_ids)]
    return empty, [tokens_in[1:] for tokens_in, _, _ in triples], [w for _, _, w in triples]
  text = [s[s != EOS] for s in src_ids] if text_side(data_config) == "source" else tgt_ids
  return (empty, text, None) if task == "lm" else (text, empty, None)


def finish_fn(data_config, vocab_size: int):
  """The task's last touch on each assembled batch, finish(batch, key) -> batch with key a tuple of
  ints that names the batch (BatchIterator passes (seed, epoch, index)), or None."""
  if task_of(data_config) != "mlm":
    return None
  return lambda batch, key: mask_batch(batch, np.random.default_rng([*key, _MLM_STREAM]), vocab_size)


def mask_batch(batch: dict, rng: np.random.Generator, vocab_size: int) -> dict:
  """A masked-LM batch (the text in src*, empty targets) -> src corrupted by BERT's 80/10/10 masking,
  tgt_out the original text, tgt_weights 1 on the chosen tokens only (never padding); tgt_in,
  tgt_segments and tgt_positions mirror src's (the encoder-only model reads src alone)."""
  inputs, targets, weights = mlm_mask(batch["src"], rng, vocab_size)
  return {**batch, "src": inputs, "tgt_in": inputs, "tgt_out": targets,
          "tgt_segments": batch["src_segments"], "tgt_positions": batch["src_positions"],
          "tgt_weights": weights.astype(np.int32)}
