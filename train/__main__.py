"""`python -m train`: train an experiment, evaluate it, and print how to decode with it.

    python -m train                                         # experiments/default.py, workdir runs/default
    python -m train --config=experiments/default.py:smoke --workdir=/tmp/smoke
    python -m train --config.train.num_steps=5000 --config.model.num_encoder_layers=4

Rerunning a command resumes its run directory. A misspelled --config.* key is an error.

Every entry point (train, jobs.sweep, train.average, decode, export, benchmarks) parses its flags with
argparse, in its own __main__ (or main()), and nowhere else. argparse is in the standard library, gives
each command a --help with its usage, and lets tests call main(argv) in-process; `--config.KEY=VALUE`
overrides go through experiments.apply_overrides, the same function the sweep, the benchmarks and the
tests use, so an override means the same thing everywhere (absl's config_flags parsed them a second way).

Several processes (docs/multihost.md): launched by SLURM's srun, Open MPI or `python -m jobs.launch`,
each process joins the job by itself; by hand, give every process the same --coordinator_address and
--num_processes and its own --process_id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).
Process 0 logs `processes x local devices = global devices`; a process that sees other devices than the
job asked for stops the run in one line (--allow_device_mismatch runs anyway; --check_devices only checks).
"""
from __future__ import annotations

from kernels import host_memory

if __name__ == "__main__":   # first: before JAX starts a thread; on the CPU only (kernels/host_memory.py)
  host_memory.keep_freed_memory_on_cpu("train")

import argparse
import logging
import os
import pathlib
import sys

import jax
from absl import logging as absl_logging   # Orbax logs through absl

import experiments
from data import tasks
from run import user_errors
from run.console import log_to_console
from run.checkpoint import CheckpointMismatch
from run.config import diff_configs
from train import estimate, multihost
from train.train import NonFiniteError, train_and_evaluate

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_DEFAULT = os.path.relpath(_ROOT / "experiments" / "default.py")
log = logging.getLogger("train")   # not __name__: that is "__main__" under python -m train


def _for_platform(spec: str, overrides: list, config, platform: str):
  """The experiment's config for the backend JAX started on, where its file defines for_platform (e.g.
  experiments/finetune.py: bfloat16 and a larger batch on a GPU), the command line's overrides applied
  again on top; the keys it changed are logged. Other experiments: `config` unchanged."""
  adapted = experiments.load_experiment(spec, platform=platform)
  experiments.apply_overrides(adapted, [a.removeprefix("--config.") for a in overrides])
  changed = diff_configs(config.to_dict(), adapted.to_dict())
  if changed:
    log.info(f"[train] {spec.partition(':')[0]} on {platform}: {'; '.join(changed)} (its for_platform; "
             f"--config.KEY=VALUE sets any of them)")
  return adapted


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m train", description=__doc__.split("\n")[0],
                                   epilog="--config.KEY=VALUE overrides one key of the experiment's config "
                                          "(e.g. --config.train.num_steps=5000).")
  parser.add_argument("--config", default=_DEFAULT, help=f"experiment file[:arg] (default {_DEFAULT})")
  parser.add_argument("--workdir", default=None, help="run directory (default: the config's workdir)")
  group = parser.add_argument_group("several processes (docs/multihost.md)")
  group.add_argument("--distributed", choices=multihost.MODES, default="auto",
                     help="join a multi-process job: auto (when launched as one: srun, mpirun, jobs.launch "
                          "or the flags below), on (always; JAX detects the cluster, e.g. a TPU pod slice), off")
  group.add_argument("--coordinator_address", default=None, help="HOST:PORT of process 0 (manual launch)")
  group.add_argument("--num_processes", type=int, default=None, help="processes in the job (manual launch)")
  group.add_argument("--process_id", type=int, default=None, help="this process's index, 0..N-1")
  group.add_argument("--allow_device_mismatch", action="store_true",
                     help="run even if a process sees other devices than the job asked for (SLURM's GPUs "
                          "and tasks per node, Open MPI, a TPU host): warn instead of refusing")
  group.add_argument("--check_devices", action="store_true",
                     help="join the job, have every process log its devices, check them, and exit "
                          "(a cluster's preflight; no config or run directory needed)")
  parser.add_argument("--estimate", action="store_true",
                      help="print the run's steps, tokens and projected hours and device-hours on this host's "
                           "devices (train/estimate.py), and exit: nothing starts")
  args, rest = parser.parse_known_args(argv)
  bad = [a for a in rest if not (a.startswith("--config.") and "=" in a)]
  if bad:
    parser.error(f"unexpected arguments {bad}; use --config=FILE[:arg] --workdir=DIR --config.KEY=VALUE")
  try:
    config = experiments.load_experiment(args.config)
    experiments.apply_overrides(config, [a.removeprefix("--config.") for a in rest])
  except (FileNotFoundError, AttributeError, KeyError, TypeError, ValueError) as error:
    parser.error(str(error).strip("'\""))
  if args.estimate:   # a dry run, before any process group or run directory starts
    print(estimate.report_here(_for_platform(args.config, rest, config, jax.default_backend()), jax.devices()))
    return
  absl_logging.set_verbosity(absl_logging.WARNING)   # Orbax logs every file it renames at INFO
  log_to_console()
  if jax.config.jax_compilation_cache_dir is None:   # a JAX_COMPILATION_CACHE_DIR the user set wins
    jax.config.update("jax_compilation_cache_dir", str(pathlib.Path.home() / ".cache" / "aiayn_jax"))
  # Every program is cached, not only those over JAX's default 1 s of compiling: the eval step's length
  # buckets and the beam searches compile in well under that, and reading them back is faster than
  # compiling them again at every start. A JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS the user set wins.
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  try:
    multihost.initialize(args.distributed, args.coordinator_address, args.num_processes, args.process_id)
  except ValueError as error:
    parser.error(str(error))
  if __name__ == "__main__":
    host_memory.check_backend("train", jax.default_backend())
  with user_errors.reported():   # a device layout other than the job's: one line `error: ...`, status 2
    multihost.check_devices(allow_mismatch=args.allow_device_mismatch, every_process=args.check_devices)
  if args.check_devices:
    return
  config = _for_platform(args.config, rest, config, jax.default_backend())

  workdir = args.workdir or config.workdir
  experiment = pathlib.Path(args.config.partition(":")[0])
  if config.data.source == "files" and experiment.resolve() == (_ROOT / "experiments" / "default.py"):
    log.info("[train] hint: for your own corpus, experiments/small_corpus.py is tuned for real text "
             "(docs/small_corpus.md); this is the default experiment, tuned for the synthetic corpus")
  try:
    with user_errors.reported():   # one line `error: ...`, exit status 2
      outcome = train_and_evaluate(config, workdir)
  except (NonFiniteError, CheckpointMismatch) as error:
    log.error(f"[train] error: {error}")
    sys.exit(1)
  if outcome.interrupted or not multihost.is_primary():
    return
  log.info("")
  if outcome.eval:
    log.info(f"dev loss {outcome.eval['eval/loss']:.4f}  ppl {outcome.eval['eval/ppl']:.3f}  "
             f"accuracy {outcome.eval['eval/accuracy']:.4f}  (step {outcome.step})")
  if outcome.test_bleu is not None:
    which = "" if outcome.best_step is None else f"   (step {outcome.best_step}: the best dev loss)"
    log.info(f"test sacreBLEU {outcome.test_bleu:.2f}   {outcome.test_signature}{which}")
    if outcome.test_bleu_averaged is not None:
      log.info(f"test sacreBLEU {outcome.test_bleu_averaged:.2f}   average of the checkpoints of steps "
               f"{outcome.averaged_steps} (decode it with --checkpoint averaged)")
    for src, ref, hyp in outcome.samples or []:
      log.info(f"  src: {src}\n  ref: {ref}\n  hyp: {hyp}\n")
  log.info(f"run directory: {outcome.workdir}")
  shown = os.path.relpath(outcome.workdir)
  shown = outcome.workdir if shown.startswith("..") else shown
  task = tasks.task_of(config.data)
  if tasks.translates(config.data):
    log.info(f"decode with:   python -m decode --workdir {shown} --input FILE --output FILE")
  elif task == "lm":
    log.info(f"continue a text with:   python -m decode --workdir {shown} --prompt TEXT")


if __name__ == "__main__":
  main()
