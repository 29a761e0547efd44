"""`python -m train`: train an experiment, evaluate it, and print how to decode with it.

    python -m train                                         # experiments/default.py, workdir runs/default
    python -m train --config=experiments/default.py:smoke --workdir=/tmp/smoke
    python -m train --config.train.num_steps=5000 --config.model.num_encoder_layers=4

Rerunning a command resumes its run directory. A misspelled --config.* key is an error.

Several processes (docs/multihost.md): launched by SLURM's srun, Open MPI or `python -m train.launch`,
each process joins the job by itself; by hand, give every process the same --coordinator_address and
--num_processes and its own --process_id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).
"""
from __future__ import annotations

import os
import pathlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_DEFAULT = os.path.relpath(_ROOT / "experiments" / "default.py")

_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT, "experiment file[:arg]", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (default: the config's workdir)")
_DISTRIBUTED = flags.DEFINE_enum("distributed", "auto", ["auto", "on", "off"],
                                 "join a multi-process job: auto (when launched as one), on (always; JAX "
                                 "detects the cluster, e.g. a TPU pod slice), off")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0 (manual launch)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes in the job (manual launch)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index, 0..num_processes-1")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; use --config=... --workdir=...")
  logging.set_verbosity(logging.WARNING)   # Orbax logs every file it renames at INFO
  import jax
  jax.config.update("jax_compilation_cache_dir", str(pathlib.Path.home() / ".cache" / "aiayn_jax"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  from train import multihost
  try:
    multihost.initialize(_DISTRIBUTED.value, _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  except ValueError as error:
    raise app.UsageError(str(error)) from None
  from train.checkpoint import CheckpointMismatch
  from train.train import NonFiniteError, train_and_evaluate
  from train.run_dir import RunDirLocked

  config = _CONFIG.value
  workdir = _WORKDIR.value or config.workdir
  try:
    outcome = train_and_evaluate(config, workdir)
  except (NonFiniteError, RunDirLocked, CheckpointMismatch) as error:
    print(f"[train] error: {error}", file=sys.stderr)
    sys.exit(1)
  if outcome.interrupted or not multihost.is_primary():
    return
  print()
  if outcome.eval:
    print(f"dev loss {outcome.eval['eval/loss']:.4f}  ppl {outcome.eval['eval/ppl']:.3f}  "
          f"accuracy {outcome.eval['eval/accuracy']:.4f}  (step {outcome.step})")
  if outcome.test_bleu is not None:
    print(f"test sacreBLEU {outcome.test_bleu:.2f}   {outcome.test_signature}")
    for src, ref, hyp in outcome.samples or []:
      print(f"  src: {src}\n  ref: {ref}\n  hyp: {hyp}\n")
  print(f"run directory: {outcome.workdir}")
  shown = os.path.relpath(outcome.workdir)
  shown = outcome.workdir if shown.startswith("..") else shown
  print(f"decode with:   python -m decode --workdir {shown} --input FILE --output FILE")


if __name__ == "__main__":
  app.run(main)
