"""Checkpoint averaging (the paper decodes base models with the average of the last 5 checkpoints, big
models of the last 20).

    python -m train.average --workdir runs/default --last 5 [--allow_fewer]

writes workdir/averaged/<newest averaged step>/ with the element-wise mean of the parameters of the last K
checkpoints; `load_params(workdir, 'averaged')` (and decoding) reads it. A run trained with
config.train.average_every_steps > 0 averages its step checkpoints (workdir/checkpoints_to_average, that
many steps apart), never the wall-clock or preemption saves of workdir/checkpoints; other runs average the
newest of workdir/checkpoints. Fewer than K checkpoints is refused, naming those there are, unless
--allow_fewer (at the end of training: config.train.average_allow_fewer=True).
"""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import shutil

import jax
import numpy as np

from run import checkpoint as ckpt
from run.config import CONFIG_FILE
from run.console import log_to_console
from run.user_errors import UserError, reported
from run.workdir import WRITTEN_BY_TRAIN, run_file
from train import multihost

log = logging.getLogger("train.average")   # not __name__: that is "__main__" under python -m train.average


def average_params(param_trees):
  """Element-wise mean of a list of identically-shaped parameter pytrees (accumulated in float64,
  returned in each leaf's dtype)."""
  def mean(*leaves):
    total = np.zeros(np.shape(leaves[0]), np.float64)
    for leaf in leaves:
      total += np.asarray(leaf, np.float64)
    return (total / len(leaves)).astype(np.asarray(leaves[0]).dtype)
  return jax.tree_util.tree_map(mean, *param_trees)


def averaging_directory(workdir) -> str:
  """Which of the run's checkpoint sets is averaged: ckpt.TO_AVERAGE where the run writes step checkpoints
  for averaging (config.json's train.average_every_steps > 0, or that directory exists), else
  ckpt.CHECKPOINTS."""
  workdir = pathlib.Path(workdir)
  if (workdir / ckpt.TO_AVERAGE).is_dir():
    return ckpt.TO_AVERAGE
  try:
    every = json.loads((workdir / CONFIG_FILE).read_text()).get("train", {}).get("average_every_steps", 0)
  except (OSError, ValueError, AttributeError):
    every = 0
  return ckpt.TO_AVERAGE if every else ckpt.CHECKPOINTS


def choose_steps(workdir, last: int, allow_fewer: bool = False,
                 allow_how: str = "pass --allow_fewer to average those") -> tuple[str, list[int]]:
  """(the directory averaged, the last `last` steps in it). Fewer than `last`: a one-line UserError naming
  the steps there are, unless allow_fewer."""
  if last < 1:
    raise ValueError(f"--last must be >= 1, got {last}")
  workdir = pathlib.Path(workdir).absolute()
  directory = averaging_directory(run_file(workdir, ckpt.CHECKPOINTS).parent)
  path = workdir / directory
  if path.is_dir():
    manager = ckpt.make_manager(workdir, directory=directory, read_only=True)
    steps = sorted(manager.all_steps())
    manager.close()
  else:
    steps = []
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


def average_checkpoints(workdir, last: int, allow_fewer: bool = False) -> tuple[pathlib.Path, list[int]]:
  """Averages the parameters of the last `last` checkpoints of workdir (choose_steps) into workdir/averaged.

  Returns (the averaged checkpoint's directory, the steps averaged). Replaces an earlier average.
  """
  workdir = pathlib.Path(workdir).absolute()
  directory, chosen = choose_steps(workdir, last, allow_fewer)
  return write_average(workdir, directory, chosen), chosen


def write_average(workdir, directory: str, chosen: list[int]) -> pathlib.Path:
  """The mean of the parameters of steps `chosen` of workdir/directory, written to workdir/averaged."""
  trees = [jax.device_get(ckpt.load_params(workdir, step, directory=directory)[0]) for step in chosen]
  averaged = average_params(trees)

  # Write next to the final place, then swap, so a crash never leaves a half-written average.
  final = workdir / ckpt.AVERAGED
  staging = workdir / (ckpt.AVERAGED + ".tmp")
  shutil.rmtree(staging, ignore_errors=True)
  writer = ckpt.make_manager(workdir, directory=staging.name, async_save=False)
  meta = {"step": chosen[-1], "averaged_steps": chosen, "averaged_from": directory}
  fingerprint = ckpt.read_meta(workdir, chosen[-1], directory=directory).get("vocab_fingerprint")
  if fingerprint:
    meta["vocab_fingerprint"] = fingerprint
  ckpt.save(writer, chosen[-1], averaged, None, meta)
  writer.wait_until_finished()
  writer.close()
  shutil.rmtree(final, ignore_errors=True)
  staging.rename(final)
  return final / str(chosen[-1])


def average_and_test(workdir, last: int, test, writer, step: int, allow_fewer: bool = False):
  """The end of a run that averages: process 0 writes the mean of the last `last` checkpoints to
  workdir/averaged (the others wait), then every process scores it with `test` (parameters -> BLEU; None:
  no test). Logs both with `writer` at `step`; returns (the steps averaged, the BLEU or None). Fewer
  checkpoints than `last` is refused in every process alike (a UserError), unless allow_fewer."""
  directory, steps = choose_steps(workdir, last, allow_fewer,
                                  "set config.train.average_allow_fewer=True to average those (or run "
                                  "python -m train.average --allow_fewer)")
  if multihost.is_primary():
    write_average(pathlib.Path(workdir).absolute(), directory, steps)
  multihost.barrier("averaged")
  writer.write(step, {"test/averaged_steps": " ".join(map(str, steps or []))})
  if test is None:
    return steps, None
  bleu = test(ckpt.load_params(workdir, "averaged")[0])
  writer.write(step, {"test/bleu_averaged": bleu})
  return steps, bleu


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m train.average", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="run directory")
  parser.add_argument("--last", type=int, default=5, help="how many of the newest checkpoints (default 5)")
  parser.add_argument("--allow_fewer", action="store_true",
                      help="average the checkpoints there are when fewer than --last (else refused)")
  args = parser.parse_args(argv)
  if args.last < 1:
    parser.error(f"--last must be >= 1, got {args.last}")
  log_to_console()
  with reported():   # user errors: one line `error: ...`, exit status 2
    path, steps = average_checkpoints(args.workdir, args.last, args.allow_fewer)
  log.info(f"averaged steps {steps} -> {path}")
  log.info(f"decode with: python -m decode --workdir {args.workdir} --checkpoint averaged --input FILE")


if __name__ == "__main__":
  main()
