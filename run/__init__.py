"""One way to open a run: `RunDir(workdir)`, once per command, passed on to whatever reads or writes it;
`RunDir(workdir).load(checkpoint)` (or `load_run(workdir, checkpoint)`) -> Run(config, model, params,
vocab, step) for decoding and export.

This package owns the run directory written by `python -m train` (layout in docs/runs.md):

    config.json        run/config.py      the experiment config the run was trained with
    vocab.model        data/vocab.py      the SentencePiece vocabulary (its fingerprint is in every checkpoint)
    vocab.json         data/cache.py      the sentences it was trained on: sample size, corpus pairs
    checkpoints/<step> run/checkpoint.py  Orbax checkpoints: params, opt_state, meta
    checkpoints_to_average/<step>         params and meta: the step checkpoints an average reads
    averaged/<step>    run/checkpoint.py  the average written at the end of training or by train.average
    LOCK, versions.json, atomic writes    run/workdir.py
    metrics.jsonl, tb/ run/metrics.py

Training, averaging, the Hugging Face import, decoding, export, the sweep table and notebooks open runs
through here, once per command (one Orbax CheckpointManager per checkpoint set per process); nothing in
`run/` imports train/, decode/ or export/ (tests/test_imports.py keeps it so). What training and decoding share
besides: `model_config` (the one place a config becomes a model), run/mesh.py (the device mesh) and
run/devices.py (which devices and CPUs each process of a cluster job may use, and the check of them).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
from typing import Any

import ml_collections

from data import cache as data_cache
from data.vocab import VOCAB_FILE, VOCAB_INFO, PairVocab, Vocab, check_vocab, open_vocab
from model import Compute, Transformer, TransformerConfig
from run import checkpoint as ckpt
from run import layout
from run import config as config_io
from run.config import CONFIG_FILE, load_run_config
from run.metrics import MetricsWriter
from run.user_errors import UserError
from run.workdir import DAMAGED, RunLock, make_run_dir, read_file, run_file, write_atomically, write_versions


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


@dataclasses.dataclass(frozen=True)
class Keep:
  """How a checkpoint set that a command writes is kept: the last `last` steps (None: all) and the steps
  of `also` (early stopping's best), saved asynchronously or not."""
  last: int | None = None
  also: ckpt.KeepSteps | None = None
  async_save: bool = True


class RunDir:
  """A run directory, opened once per command and passed on: its config, vocabulary, checkpoint sets (one
  Orbax CheckpointManager per set, opened when first used and kept), metrics, lock and versions.

  write: {checkpoint set (ckpt.CHECKPOINTS, ckpt.TO_AVERAGE): Keep} for the sets this command writes;
  every other set is opened read-only. Use as a context manager, or call close() (which waits for
  asynchronous saves). Nothing is created on disk until a writer asks (create(), a save, the lock).
  """

  def __init__(self, path, *, write: dict | None = None):
    self.path = pathlib.Path(path).absolute()
    self.write = dict(write or {})
    self._managers = {}

  def __repr__(self) -> str:
    return f"RunDir({str(self.path)!r})"

  def __enter__(self) -> "RunDir":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def file(self, name: str) -> pathlib.Path:
    """RUN/name (the run directory must exist: else a UserError naming it)."""
    return run_file(self.path, name)

  # Files: config.json, vocab.model, versions.json, metrics, the lock.
  def create(self) -> "RunDir":
    """Creates the directory (for a trainer or an import); a file in its place is a UserError."""
    make_run_dir(self.path)
    return self

  def config(self) -> ml_collections.ConfigDict:
    """config.json: the locked config the run was trained with."""
    return load_run_config(self.path)

  def save_config(self, config: ml_collections.ConfigDict) -> pathlib.Path:
    return config_io.save_config(config, self.path)

  def recorded_max_len(self) -> int:
    return config_io.recorded_max_len(self.path)

  def check_resume(self, config: ml_collections.ConfigDict, has_checkpoints: bool) -> list[str]:
    return config_io.check_resume(config, self.path, has_checkpoints)

  def vocab(self) -> Vocab | PairVocab:
    return load_vocab(self.path)

  def get_vocab(self, data_config, write: bool = True) -> Vocab | PairVocab:
    return get_vocab(data_config, self.path, write=write)

  def write_versions(self) -> pathlib.Path:
    return write_versions(self.path)

  def metrics(self, resume_step: int = 0, tensorboard: bool = True, drop_reports: bool = False):
    return MetricsWriter(self.path, resume_step=resume_step, tensorboard=tensorboard, drop_reports=drop_reports)

  def lock(self) -> RunLock:
    """The single-trainer lock (a context manager: `with run.lock(): ...`)."""
    return RunLock(self.path)

  # Checkpoints.
  def checkpoints(self, directory: str = ckpt.CHECKPOINTS):
    """The CheckpointManager of checkpoint set `directory`, opened on first use (as `write` says)."""
    if directory not in self._managers:
      keep = self.write.get(directory)
      if keep is None:
        self._managers[directory] = ckpt.make_manager(self.path, directory=directory, read_only=True)
      else:
        self._managers[directory] = ckpt.make_manager(self.path, keep=keep.last, directory=directory,
                                                      async_save=keep.async_save, keep_also=keep.also)
    return self._managers[directory]

  def steps(self, directory: str = ckpt.CHECKPOINTS) -> list[int]:
    """The steps of a checkpoint set, oldest first ([] where the set does not exist)."""
    if directory not in self.write and not (self.path / directory).is_dir():
      return []
    return sorted(self.checkpoints(directory).all_steps())

  def averaged_set(self) -> str:
    """Which checkpoint set an average of this run reads: ckpt.TO_AVERAGE where the run writes step
    checkpoints for averaging (config.json's train.average_every_steps > 0, or that directory exists),
    else ckpt.CHECKPOINTS."""
    if self.file(ckpt.TO_AVERAGE).is_dir() or ckpt.TO_AVERAGE in self.write:
      return ckpt.TO_AVERAGE
    every = self.config().train.get("average_every_steps", 0) if self.file(CONFIG_FILE).exists() else 0
    return ckpt.TO_AVERAGE if every else ckpt.CHECKPOINTS

  def load_params(self, checkpoint=None, *, directory: str | None = None):
    """-> (params, step): ckpt.read_params of the set (RUN/averaged for checkpoint='averaged')."""
    directory = directory or (ckpt.AVERAGED if checkpoint == "averaged" else ckpt.CHECKPOINTS)
    if directory not in self.write:
      ckpt.check_readable(self.path / directory)
    return ckpt.read_params(self.checkpoints(directory), checkpoint)

  def read_meta(self, step: int, directory: str = ckpt.CHECKPOINTS) -> dict:
    return ckpt.read_meta(self.path, step, directory=directory)

  def update_meta(self, step: int, changes: dict) -> None:
    """RUN/checkpoints/<step>'s meta with `changes` applied, rewritten atomically (ckpt.update_meta)."""
    ckpt.update_meta(self.path, step, changes)

  def best_step(self) -> int | None:
    return ckpt.best_step(self.path, sorted(self.checkpoints().all_steps(), reverse=True))

  def replace_average(self, step: int, params, meta: dict) -> pathlib.Path:
    """Writes RUN/averaged/<step> (the parameters of an average, its meta), replacing what RUN/averaged
    held: written beside it, then swapped in, so a crash never leaves half an average."""
    final = self.path / ckpt.AVERAGED
    staging = self.path / (ckpt.AVERAGED + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    writer = ckpt.make_manager(self.path, directory=staging.name, async_save=False)
    ckpt.save(writer, step, params, None, meta)
    writer.wait_until_finished()
    writer.close()
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    if ckpt.AVERAGED in self._managers:
      self._managers[ckpt.AVERAGED].reload()
    return final / str(step)

  def wait(self) -> None:
    """Blocks until every asynchronous save has finished."""
    for manager in self._managers.values():
      manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the saves and closes every manager (the object can be opened again)."""
    managers, self._managers = self._managers, {}
    for manager in managers.values():
      manager.wait_until_finished()
      manager.close()

  # The run for decoding and export.
  def load(self, checkpoint: int | str | None = None, *, check=None) -> Run:
    """The run's model, ready to decode. checkpoint: None = the run's model (the best dev loss's
    checkpoint for a run trained with early stopping, else the newest readable training checkpoint);
    'latest' = the newest; 'best'; an int = that step; 'averaged' = the average written at the end of
    training or by `python -m train.average`. The checkpoint's vocabulary fingerprint must match
    vocab.model. check: an optional callable(TransformerConfig) run before any checkpoint is read (export
    uses it to refuse an architecture its format cannot express without loading the weights first)."""
    config = self.config()
    vocab = self.vocab()
    try:
      cfg = model_config(config, vocab.size)
    except (TypeError, ValueError) as error:   # a key or value of the model (or compute) section that no model has
      raise UserError(f"{self.path / CONFIG_FILE}: its model section does not describe a model "
                      f"({' '.join(str(error).split())[:200]}): {DAMAGED}") from None
    if check is not None:
      check(cfg)
    params, step = self.load_params(checkpoint)
    directory = ckpt.AVERAGED if checkpoint == "averaged" else ckpt.CHECKPOINTS
    try:
      check_vocab(vocab, self.read_meta(step, directory).get("vocab_fingerprint"),
                  f"checkpoint {step} of {self.path}")
    except ValueError as error:
      raise UserError(str(error)) from None
    model, params = layout.unrolled(Transformer(cfg), params)   # decoding and export read layer by layer
    return Run(config=config, model=model, params=params, vocab=vocab, step=step)


def load_run(workdir, checkpoint: int | str | None = None, *, check=None) -> Run:
  """Opens run directory `workdir` for decoding, export or analysis: RunDir(workdir).load(checkpoint,
  check=check), the directory closed again."""
  with RunDir(workdir) as opened:
    return opened.load(checkpoint, check=check)


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
