"""What can be checked before a job waits in the queue: jobs.submit, jobs.sweep and jobs.search run these
on the login node, before sbatch, so that a mistake costs seconds instead of the queue wait.

    workdir = preflight.check_train_flags(TRAIN_FLAGS, options)   # a UserError (one line) on any mistake

For each run it checks, in this order:
  - the platform: GPUs asked for (--gpus_per_node > 0) with a JAX_PLATFORMS that leaves them out (sbatch
    passes the submitting shell's environment on to the job; run/devices.py);
  - the trainer's flags: --config, --workdir and --config.KEY=VALUE (a typo'd key, a missing experiment
    file), loaded by experiments.load_experiment and apply_overrides as `python -m train` loads them, for
    the platform the job runs on (an experiment's for_platform);
  - the data: data.check_config (a missing --config.data.*_path file, an unprepared TFDS corpus) and a
    config.data.tfds_data_dir that does not exist;
  - config.train.init_checkpoint: its run directory holds the checkpoint it names;
  - the run directory: not a file, creatable and writable, and, where it already holds a run, the
    config.json it recorded allows resuming with this config (run/config.py's check_resume).
Paths are checked from the current directory, which is where the job starts.
"""
from __future__ import annotations

import argparse
import os
import pathlib

import experiments
from data import check_config
from data.sources import resolved_source
from run import checkpoint as ckpt
from run import config as config_io
from run import devices
from run.user_errors import UserError
from run.workdir import make_run_dir

DEFAULT_EXPERIMENT = pathlib.Path(experiments.__file__).parent / "default.py"   # python -m train's default
# The trainer's flags that make sense in a SLURM job beside --config, --workdir and --config.KEY=VALUE
# (SLURM itself gives each task its coordinator, process count and id).
PASSED_ON = ("--distributed", "--allow_device_mismatch", "--check_devices")


def check_platform(options) -> None:
  """A UserError where options (jobs.slurm.SlurmOptions) ask for GPUs that JAX_PLATFORMS leaves out."""
  if options.gpus_per_node:
    problem = devices.gpu_platform_problem(f"--gpus_per_node {options.gpus_per_node} asks for GPUs", os.environ)
    if problem:
      raise UserError(f"{problem} (sbatch passes this shell's JAX_PLATFORMS on to the job)")


def train_config(flags: list[str], platform: str):
  """The trainer's flags (what follows `python -m train`) -> (its config, its run directory), loaded as the
  trainer loads them on `platform` ('gpu', 'cpu'). A usage mistake is a UserError naming the flag."""
  parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
  parser.add_argument("--config", default=str(DEFAULT_EXPERIMENT))
  parser.add_argument("--workdir", default=None)
  parser.add_argument("--distributed")   # passed on: the trainer checks their values
  parser.add_argument("--allow_device_mismatch", action="store_true")
  parser.add_argument("--check_devices", action="store_true")
  args, rest = parser.parse_known_args(flags)
  overrides = [a for a in rest if a.startswith("--config.") and "=" in a]
  bad = [a for a in rest if a not in overrides]
  if bad:
    raise UserError(f"the training flags {bad} are not python -m train's: give --config=FILE[:arg], "
                    f"--workdir=DIR and --config.KEY=VALUE (or {', '.join(PASSED_ON)})")
  try:
    config = experiments.load_experiment(args.config, platform=platform)
    experiments.apply_overrides(config, [a.removeprefix("--config.") for a in overrides])
  except (FileNotFoundError, AttributeError, KeyError, TypeError, ValueError) as error:
    raise UserError(str(error).strip("'\"")) from None
  return config, pathlib.Path(args.workdir or config.workdir)


def check_data(config) -> None:
  """The config's data: its files exist, its TFDS corpus is prepared where it says."""
  data_dir = config.data.get("tfds_data_dir", "")
  if resolved_source(config.data) == "tfds" and data_dir and not os.path.isdir(data_dir):
    raise UserError(f"config.data.tfds_data_dir={data_dir!r} is not a directory: prepare the corpus there "
                    f"(python -m data.prepare {config.data.tfds_name} --data_dir {data_dir}) or give the "
                    f"directory that holds it")
  check_config(config.data)   # a DataError, as one line


def check_init_checkpoint(config) -> None:
  """config.train.init_checkpoint ("RUN[:STEP|:averaged]"): RUN holds that checkpoint."""
  spec = config.train.get("init_checkpoint", "")
  if not spec:
    return
  run, _, which = spec.partition(":")
  directory = pathlib.Path(run) / (ckpt.AVERAGED if which == "averaged" else ckpt.CHECKPOINTS)
  steps = _steps(directory)
  fix = f"give config.train.init_checkpoint a run directory that has it, or '' to start from scratch"
  if not steps:
    raise UserError(f"config.train.init_checkpoint={spec!r}: no checkpoints in {directory}; {fix}")
  if which.isdigit() and int(which) not in steps:
    raise UserError(f"config.train.init_checkpoint={spec!r}: {directory} has steps {sorted(steps)}, not "
                    f"{which}; {fix}")


def check_run_dir(config, workdir: pathlib.Path) -> None:
  """The run directory can be created and written, and a run already in it can resume with `config`."""
  make_run_dir(workdir)   # a file, or a path that cannot be created: UserError
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise UserError(f"the run directory {workdir} is not writable by you: give another --workdir")
  has_checkpoints = bool(_steps(workdir / ckpt.CHECKPOINTS))
  if int(config.data.max_len) == 0 and has_checkpoints:   # what the trainer resumes with (train/train.py)
    with config.unlocked():
      config.data.max_len = config_io.recorded_max_len(workdir)
  config_io.check_resume(config, workdir, has_checkpoints)


def check_train_flags(flags: list[str], options) -> pathlib.Path:
  """Everything above for one run of `python -m train FLAGS` as a job with `options` (SlurmOptions).
  -> its run directory (absolute). Raises a one-line UserError on the first mistake."""
  check_platform(options)
  config, workdir = train_config(flags, "gpu" if options.gpus_per_node else "cpu")
  check_data(config)
  workdir = workdir.absolute()
  if not _steps(workdir / ckpt.CHECKPOINTS):   # the trainer reads init_checkpoint only when starting afresh
    check_init_checkpoint(config)
  check_run_dir(config, workdir)
  return workdir


def _steps(directory: pathlib.Path) -> set[int]:
  """The steps of a checkpoint set on disk (its numbered directories), without opening Orbax."""
  try:
    return {int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir()}
  except OSError:
    return set()


def check_runs(runs: list[list[str]], options) -> list[pathlib.Path]:
  """check_train_flags for every run's flags (a sweep's trials: all checked before any is queued)."""
  return [check_train_flags(flags, options) for flags in runs]
