"""Checkpoint averaging (the paper decodes base models with the average of the last 5 checkpoints, big
models of the last 20).

    python -m train.average --workdir runs/default --last 5

writes workdir/averaged/<newest averaged step>/ with the element-wise mean of the parameters of the last K
checkpoints; `load_params(workdir, 'averaged')` (and decoding) reads it.
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import shutil

import jax
import numpy as np

from run import checkpoint as ckpt
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


def average_checkpoints(workdir, last: int) -> tuple[pathlib.Path, list[int]]:
  """Averages the parameters of the last `last` checkpoints of workdir into workdir/averaged.

  Returns (the averaged checkpoint's directory, the steps averaged). Replaces an earlier average.
  """
  if last < 1:
    raise ValueError(f"--last must be >= 1, got {last}")
  workdir = pathlib.Path(workdir).absolute()
  if not run_file(workdir, ckpt.CHECKPOINTS).is_dir():
    raise UserError(f"no checkpoints in {workdir / ckpt.CHECKPOINTS}: {WRITTEN_BY_TRAIN}")
  manager = ckpt.make_manager(workdir, read_only=True)
  steps = sorted(manager.all_steps())
  manager.close()
  if not steps:
    raise UserError(f"no checkpoints in {workdir / ckpt.CHECKPOINTS}: {WRITTEN_BY_TRAIN}")
  chosen = steps[-last:]
  if len(chosen) < last:
    log.info(f"[average] only {len(chosen)} checkpoints in {workdir / ckpt.CHECKPOINTS}; averaging {chosen}")
  trees = [jax.device_get(ckpt.load_params(workdir, step)[0]) for step in chosen]
  averaged = average_params(trees)

  # Write next to the final place, then swap, so a crash never leaves a half-written average.
  final = workdir / ckpt.AVERAGED
  staging = workdir / (ckpt.AVERAGED + ".tmp")
  shutil.rmtree(staging, ignore_errors=True)
  writer = ckpt.make_manager(workdir, directory=staging.name, async_save=False)
  meta = {"step": chosen[-1], "averaged_steps": chosen}
  fingerprint = ckpt.read_meta(workdir, chosen[-1]).get("vocab_fingerprint")
  if fingerprint:
    meta["vocab_fingerprint"] = fingerprint
  ckpt.save(writer, chosen[-1], averaged, None, meta)
  writer.wait_until_finished()
  writer.close()
  shutil.rmtree(final, ignore_errors=True)
  staging.rename(final)
  return final / str(chosen[-1]), chosen


def average_and_test(workdir, last: int, test, writer, step: int):
  """The end of a run that averages: process 0 writes the mean of the last `last` checkpoints to
  workdir/averaged (the others wait), then every process scores it with `test` (parameters -> BLEU; None:
  no test). Logs both with `writer` at `step`; returns (the steps averaged, the BLEU or None)."""
  steps = average_checkpoints(workdir, last)[1] if multihost.is_primary() else None
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
  args = parser.parse_args(argv)
  if args.last < 1:
    parser.error(f"--last must be >= 1, got {args.last}")
  log_to_console()
  with reported():   # user errors: one line `error: ...`, exit status 2
    path, steps = average_checkpoints(args.workdir, args.last)
  log.info(f"averaged steps {steps} -> {path}")
  log.info(f"decode with: python -m decode --workdir {args.workdir} --checkpoint averaged --input FILE")


if __name__ == "__main__":
  main()
