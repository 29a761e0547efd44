"""One way to open a run: `load_run(workdir, checkpoint=None) -> Run(config, model, params, vocab, step)`.

This package owns the run directory written by `python -m train` (layout in docs/runs.md):

    config.json        run/config.py      the experiment config the run was trained with
    vocab.model        data/vocab.py      the SentencePiece vocabulary (its fingerprint is in every checkpoint)
    vocab.json         data/cache.py      the sentences it was trained on: sample size, corpus pairs
    checkpoints/<step> run/checkpoint.py  Orbax checkpoints: params, opt_state, meta
    averaged/<step>    run/checkpoint.py  the average written by `python -m train.average`
    LOCK, versions.json, atomic writes    run/workdir.py
    metrics.jsonl, tb/ run/metrics.py

Decoding, export, averaging, the sweep table and notebooks open runs through here; nothing in `run/`
imports train/, decode/ or export/ (tests/test_imports.py keeps it so). What training and decoding share
besides: `model_config` (the one place a config becomes a model), run/mesh.py (the device mesh) and
run/devices.py (which devices and CPUs each process of a cluster job may use, and the check of them).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from typing import Any

import ml_collections

from data import cache as data_cache
from data.vocab import VOCAB_FILE, VOCAB_INFO, PairVocab, Vocab, check_vocab, open_vocab
from model import Compute, Transformer, TransformerConfig
from run import checkpoint as ckpt
from run import layout
from run.config import CONFIG_FILE, load_run_config
from run.user_errors import UserError
from run.workdir import DAMAGED, read_file, run_file, write_atomically


@dataclasses.dataclass(frozen=True)
class Run:
  """A trained run, ready to decode: `translate(run.model, run.params, run.vocab, sentences)`."""
  config: ml_collections.ConfigDict   # the whole experiment config (model, data, train, decode)
  model: Transformer
  params: Any                         # the parameter pytree, on the first local device
  vocab: Vocab | PairVocab
  step: int                           # the training step of the checkpoint (of its newest step if averaged)

  @property
  def model_config(self) -> TransformerConfig:
    return self.model.cfg


def checkpoint_arg(text):
  """A --checkpoint value -> load_run's `checkpoint`: None/'' -> None (the run's model: the best dev
  loss's checkpoint for a run with early stopping, else the newest), 'latest', 'best', 'averaged', or a step.

  The `type=` of every --checkpoint flag (decode, export); a bad value is a usage error naming it.
  """
  if text is None or isinstance(text, int) or text in ("averaged", "latest", "best"):
    return text
  if text == "":
    return None
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"--checkpoint {text!r}: use a step number, 'averaged', 'latest' or "
                                     f"'best'") from None


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> TransformerConfig:
  """The model of a run: the architecture (config.model plus the vocabulary's size) computed as
  config.compute says. The one place a config becomes a model: `Transformer(model_config(config, vocab.size))`."""
  return TransformerConfig(vocab_size=vocab_size, compute=Compute(**config.compute.to_dict()),
                           **config.model.to_dict())


def load_vocab(workdir) -> Vocab:
  """workdir/vocab.model; missing or not a SentencePiece model of ours is a UserError naming it."""
  path = run_file(workdir, VOCAB_FILE)
  model = read_file(path, binary=True)
  try:
    return open_vocab(model, path)
  except Exception as error:  # noqa: BLE001 - sentencepiece's error for bytes that are not its model
    raise UserError(f"{path} is not a SentencePiece vocabulary of this codebase "
                    f"({' '.join(str(error).split())[:200]}): {DAMAGED}") from None


def load_run(workdir, checkpoint: int | str | None = None, *, check=None) -> Run:
  """Opens run directory `workdir` for decoding, export or analysis.

  checkpoint: None = the run's model (the best dev loss's checkpoint for a run trained with early stopping,
  else the newest readable training checkpoint); 'latest' = the newest; 'best'; an int = that step;
  'averaged' = the average written by `python -m train.average`. The checkpoint's vocabulary fingerprint
  must match vocab.model.
  check: an optional callable(TransformerConfig) run before any checkpoint is read (export uses it to
  refuse an architecture its format cannot express without loading the weights first).
  """
  config = load_run_config(workdir)
  vocab = load_vocab(workdir)
  try:
    cfg = model_config(config, vocab.size)
  except (TypeError, ValueError) as error:   # a key or value of the model (or compute) section that no model has
    raise UserError(f"{pathlib.Path(workdir) / CONFIG_FILE}: its model section does not describe a model "
                    f"({' '.join(str(error).split())[:200]}): {DAMAGED}") from None
  if check is not None:
    check(cfg)
  params, step = ckpt.load_params(workdir, checkpoint)
  try:
    check_vocab(vocab, ckpt.read_meta(workdir, step, checkpoint).get("vocab_fingerprint"),
                f"checkpoint {step} of {workdir}")
  except ValueError as error:
    raise UserError(str(error)) from None
  model, params = layout.unrolled(Transformer(cfg), params)   # decoding and export read layer by layer
  return Run(config=config, model=model, params=params, vocab=vocab, step=step)


def get_vocab(data_config, workdir, write: bool = True) -> Vocab | PairVocab:
  """workdir/vocab.model if it exists; else a copy of config.data.vocab_file where that is set (a
  pretrained run's vocab.model, for fine-tuning: experiments/finetune.py); else trained on a bounded
  sample of the training split (or taken from the data cache, where a run with the same corpus and
  vocabulary settings left it) and written atomically, with workdir/vocab.json recording the sample it
  was trained on. write=False: the same vocabulary, the run directory left to the process that writes it
  (process 0 of a multi-process job)."""
  path = pathlib.Path(workdir) / VOCAB_FILE
  if path.exists():
    return load_vocab(workdir)
  if data_config.get("vocab_file", ""):
    source = pathlib.Path(data_config.vocab_file)
    if not source.is_file():
      raise UserError(f"config.data.vocab_file={str(source)!r} does not exist: name a run's vocab.model")
    if not write:
      return open_vocab(source.read_bytes(), source)
    write_atomically(path, source.read_bytes())
    return load_vocab(workdir)
  model, info = data_cache.train_vocab_cached(data_config)   # a bounded sample, never the whole corpus
  if not write:
    return open_vocab(model, path)
  write_atomically(path.with_name(VOCAB_INFO), json.dumps(info, indent=1) + "\n")   # sample size etc.
  write_atomically(path, model)
  return open_vocab(model, path)
