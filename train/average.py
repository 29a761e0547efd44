"""Checkpoint averaging (the paper decodes base models with the average of the last 5 checkpoints, big
models of the last 20).

    python -m train.average --workdir runs/default [--last K] [--allow_fewer] [--overwrite]

writes workdir/averaged/<newest averaged step>/ with the element-wise mean of the parameters of the last K
checkpoints; `--checkpoint averaged` (decode, export) reads it. K defaults to the run's own
config.train.average_last (and --allow_fewer to its average_allow_fewer), so that by default the command
writes what the end of training wrote. A run trained with config.train.average_every_steps > 0 averages
its step checkpoints (workdir/checkpoints_to_average, that many steps apart), never the wall-clock or
preemption saves of workdir/checkpoints; other runs average the newest of workdir/checkpoints. Fewer than
K checkpoints is refused, naming those there are, unless --allow_fewer (at the end of training:
config.train.average_allow_fewer=True). An average of other steps than workdir/averaged holds (the end of
training's, or an earlier command's) is refused unless --overwrite; the same steps again are left as
they are. The checkpoints are read one at a time into a running float64 sum: host memory holds one
checkpoint beside the sum, whatever K.
"""
from __future__ import annotations

import argparse
import logging
import pathlib

import jax
import numpy as np

from run import RunDir
from run import checkpoint as ckpt
from run.config import CONFIG_FILE
from run.console import log_to_console
from run.user_errors import UserError, reported
from run.workdir import WRITTEN_BY_TRAIN
from train import multihost

log = logging.getLogger("train.average")   # not __name__: that is "__main__" under python -m train.average


def average_params(param_trees):
  """Element-wise mean of a list of identically-shaped parameter pytrees (accumulated in float64,
  returned in each leaf's dtype), all in memory at once: stream_average does the same one tree at a time."""
  def mean(*leaves):
    total = np.zeros(np.shape(leaves[0]), np.float64)
    for leaf in leaves:
      total += np.asarray(leaf, np.float64)
    return (total / len(leaves)).astype(np.asarray(leaves[0]).dtype)
  return jax.tree_util.tree_map(mean, *param_trees)


def stream_average(load, steps: list[int]):
  """The element-wise mean of the parameter trees load(step) for each of `steps`, read one at a time:
  host memory holds one tree beside the float64 sum. Equal, bit for bit, to average_params of them all
  (the same float64 additions in the same order)."""
  total, treedef, dtypes = None, None, None
  for step in steps:
    leaves, structure = jax.tree_util.tree_flatten(load(step))
    if total is None:
      treedef, dtypes = structure, [np.asarray(leaf).dtype for leaf in leaves]
      total = [np.zeros(np.shape(leaf), np.float64) for leaf in leaves]
    elif structure != treedef:
      raise UserError(f"step {step}'s parameters are another tree than step {steps[0]}'s: the checkpoints "
                      f"averaged must be of one model")
    for i in range(len(leaves)):
      total[i] += np.asarray(jax.device_get(leaves[i]), np.float64)
      leaves[i] = None   # each leaf freed once added
    del leaves
  return jax.tree_util.tree_unflatten(treedef, [(t / len(steps)).astype(d) for t, d in zip(total, dtypes)])


def choose_steps(run: RunDir, last: int, allow_fewer: bool = False,
                 allow_how: str = "pass --allow_fewer to average those") -> tuple[str, list[int]]:
  """(the checkpoint set averaged, the last `last` steps in it). Fewer than `last`: a one-line UserError
  naming the steps there are, unless allow_fewer."""
  if last < 1:
    raise ValueError(f"--last must be >= 1, got {last}")
  directory = run.averaged_set()
  path = run.path / directory
  steps = run.steps(directory)
  what = ("step checkpoints for averaging (the wall-clock and preemption checkpoints never join an average)"
          if directory == ckpt.TO_AVERAGE else "checkpoints")
  if not steps:
    raise UserError(f"no {what} in {path}: {WRITTEN_BY_TRAIN}")
  if len(steps) < last and not allow_fewer:
    raise UserError(f"averaging the last {last} checkpoints, but {path} holds only {len(steps)} {what}: "
                    f"steps {steps}; {allow_how}, or train longer")
  chosen = steps[-last:]
  if len(chosen) < last:
    log.info(f"[average] only {len(chosen)} checkpoints in {path}; averaging {chosen} (allowed)")
  return directory, chosen


def write_average(run: RunDir, directory: str, chosen: list[int]) -> pathlib.Path:
  """The mean of the parameters of steps `chosen` of the run's set `directory` (read one at a time),
  written to RUN/averaged (replacing what it held). -> the average's checkpoint directory."""
  averaged = stream_average(lambda step: run.load_params(step, directory=directory)[0], chosen)
  meta = {"step": chosen[-1], "averaged_steps": chosen, "averaged_from": directory}
  fingerprint = run.read_meta(chosen[-1], directory).get("vocab_fingerprint")
  if fingerprint:
    meta["vocab_fingerprint"] = fingerprint
  return run.replace_average(chosen[-1], averaged, meta)


def recorded_average(run: RunDir) -> tuple[str, list[int]] | None:
  """(the set averaged, its steps) of the average RUN/averaged holds, None where it holds none."""
  steps = run.steps(ckpt.AVERAGED)
  if not steps:
    return None
  meta = run.read_meta(steps[-1], ckpt.AVERAGED)
  return meta.get("averaged_from", ckpt.CHECKPOINTS), list(meta.get("averaged_steps", [steps[-1]]))


def average_checkpoints(run: RunDir | str | pathlib.Path, last: int | None = None,
                        allow_fewer: bool | None = None, overwrite: bool = False):
  """`python -m train.average`: averages the last `last` checkpoints of the run (None: its
  config.train.average_last; allow_fewer None: its average_allow_fewer) into RUN/averaged.

  Returns (the averaged checkpoint's directory, the steps averaged). An average of other steps already
  there is a UserError unless overwrite; the same steps are not written again.
  """
  if not isinstance(run, RunDir):   # a path (tests, notebooks): opened here, for this call
    with RunDir(run) as opened:
      return average_checkpoints(opened, last, allow_fewer, overwrite)
  # The run's own averaging settings (a directory of checkpoints without config.json: none).
  train = run.config().train if last is None or run.file(CONFIG_FILE).exists() else {}
  if last is None:
    last = int(train.get("average_last", 0))
    if last < 1:
      raise UserError(f"{run.path / 'config.json'}: config.train.average_last=0, the run does not average "
                      f"its checkpoints: pass --last K, how many of the newest to average")
    log.info(f"[average] the last {last} checkpoints (config.train.average_last of {run.path})")
  if allow_fewer is None:
    allow_fewer = bool(train.get("average_allow_fewer", False))
  directory, chosen = choose_steps(run, last, allow_fewer)
  before = recorded_average(run)
  path = run.path / ckpt.AVERAGED / str(chosen[-1])
  if before == (directory, chosen):
    log.info(f"[average] {run.path / ckpt.AVERAGED} already holds the average of steps {chosen} of "
             f"{directory}; nothing written")
    return path, chosen
  if before is not None and not overwrite:
    raise UserError(f"{run.path / ckpt.AVERAGED} holds the average of steps {before[1]} of {before[0]} "
                    f"(the end of training's or an earlier average's); averaging steps {chosen} would replace "
                    f"it: pass --overwrite to replace it")
  if before is not None:
    log.info(f"[average] replacing the average of steps {before[1]} of {before[0]} (--overwrite)")
  path = write_average(run, directory, chosen)
  log.info(f"[average] averaged steps {chosen} -> {path}")
  return path, chosen


def average_and_test(run: RunDir, last: int, test, writer, step: int, allow_fewer: bool = False):
  """The end of a run that averages: process 0 writes the mean of the last `last` checkpoints to
  RUN/averaged (the others wait), then every process scores it with `test` (parameters -> BLEU; None:
  no test). Logs both with `writer` at `step`; returns (the steps averaged, the BLEU or None). Fewer
  checkpoints than `last` is refused in every process alike (a UserError), unless allow_fewer."""
  directory, steps = choose_steps(run, last, allow_fewer,
                                  "set config.train.average_allow_fewer=True to average those (or run "
                                  "python -m train.average --allow_fewer)")
  if multihost.is_primary():
    write_average(run, directory, steps)
  multihost.barrier("averaged")
  writer.write(step, {"test/averaged_steps": " ".join(map(str, steps or []))})
  if test is None:
    return steps, None
  bleu = test(run.load_params("averaged")[0])
  writer.write(step, {"test/bleu_averaged": bleu})
  return steps, bleu


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m train.average", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="run directory")
  parser.add_argument("--last", type=int, default=None,
                      help="how many of the newest checkpoints (default: the run's config.train.average_last)")
  parser.add_argument("--allow_fewer", action="store_true", default=None,
                      help="average the checkpoints there are when fewer than --last (default: the run's "
                           "config.train.average_allow_fewer; else refused)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace an average of other steps that RUN/averaged holds (else refused)")
  args = parser.parse_args(argv)
  if args.last is not None and args.last < 1:
    parser.error(f"--last must be >= 1, got {args.last}")
  log_to_console()
  with reported(), RunDir(args.workdir) as run:   # user errors: one line `error: ...`, exit status 2
    average_checkpoints(run, args.last, args.allow_fewer, args.overwrite)
  log.info(f"decode with: python -m decode --workdir {args.workdir} --checkpoint averaged --input FILE")


if __name__ == "__main__":
  main()
