"""`python -m jobs.sweep`: run every trial of an experiment's sweep, each as its own run directory.

    python -m jobs.sweep --config experiments/table3.py --workdir runs/table3 [--parallel N] \\
        [--only base,C_N2] [--config.data.tfds_data_dir=DIR ...]

The experiment file declares its trials with `sweep(add)` or `sweep(add, arg)` (arg: the ':arg' of
--config), calling `add(name=..., **{'model.num_heads': 1, ...})` once per trial. Trial NAME runs as

    python -m train --config FILE[:arg] --workdir DIR/NAME [--config.k=v shared by all] --config.k=v ...

with its output in DIR/NAME/sweep.log, under `python -m jobs.sweep_trial` in a session of its own, which
writes the trial's result and DONE marker itself when the trainer finishes (so a trial outlives a closed
terminal or a killed sweep command, and is still marked). Rerunning the command skips trials with a DONE
marker, watches trials whose process an earlier command left running, resumes interrupted ones (the
trainer resumes from its checkpoints) and retries failed ones. A failed trial is recorded (status
FAILED, its log) and the others go on. DIR/results.csv, DIR/results.md and DIR/results.png (dev PPL and
BLEU per trial, beside the paper's numbers when the experiment file has a PAPER dict keyed by trial
name) are written at the start, each time a trial ends and at the end; `python -m jobs.status DIR`
shows every trial while it runs (docs/sweeps.md).

Ctrl-C or SIGTERM: the trials in flight get SIGTERM, save a checkpoint and stop; rerun to go on.

--launcher slurm (with --partition, --nodes, --tasks_per_node, --gpus_per_node, --time, --sbatch KEY=VALUE;
see jobs/slurm.py) submits each trial as its own SLURM job, --parallel of them queued or running at once,
and watches them with one squeue call a tick: SLURM queues, requeues and preempts; the sweep still skips
finished trials, records failures and writes the results. Each trial's job records its own result and
DONE marker when its trainer finishes, watched or not. A squeue or sacct that fails is retried and
reported, never read as a job's end. Stopping (or killing) the sweep leaves the jobs to SLURM; rerunning
the same command skips the trials that are done, watches again the jobs still queued or running, and
submits only the trials for which SLURM says every job submitted (DIR/NAME/slurm_jobs.txt) has ended
without finishing them: nothing that finished or runs is submitted twice.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import experiments
from run.user_errors import UserError, reported
from run.workdir import RunDirLocked, RunLock
from train import estimate
from train.signals import SignalFlag
from jobs import preflight, slurm, sweep_trial
from jobs.sweep_report import fmt_number, format_overrides, markdown_table, trial_row, write_results
from jobs.sweep_trial import (DONE, HPARAMS, LOG, STATUS, TrialResult, mark_done, read_status, reached_end,
                              write_hparams, write_status)

_NAME = re.compile(r"^[A-Za-z0-9_.+=-]+$")


@dataclasses.dataclass
class Trial:
  name: str
  overrides: dict               # dotted key -> value, e.g. {'model.num_heads': 1}


# ------------------------------------------------------------------------------------------------------
# Declaring trials.
# ------------------------------------------------------------------------------------------------------
def _default_name(overrides: dict) -> str:
  return ",".join(f"{key.split('.')[-1]}={value}" for key, value in overrides.items()) or "default"


def declared_trials(config_spec: str, shared=()) -> tuple[list[Trial], dict]:
  """Trials declared by the experiment file's sweep(add[, arg]), checked against its locked config.

  Returns (trials, paper): paper is the file's PAPER dict ({trial name: {'ppl', 'bleu', ...}}) or {}.
  Raises ValueError naming the file and trial for a missing sweep function, a bad or duplicate name, or
  an override of a key that does not exist (experiments.apply_overrides names the key).
  """
  path, _, arg = config_spec.partition(":")
  module = experiments.load_module(path)
  if not hasattr(module, "sweep"):
    raise UserError(f"{path} has no sweep(add) function; add one that calls add(name=..., **overrides) "
                     f"per trial (see experiments/table3.py)")
  trials = []

  def add(name=None, **overrides):
    name = name or _default_name(overrides)
    if not _NAME.match(name):
      raise UserError(f"{path}: trial name {name!r} must be letters, digits and _ . + = - (it names a "
                       f"directory)")
    if any(t.name == name for t in trials):
      raise UserError(f"{path}: two trials are named {name!r}; give each add() a unique name=")
    trials.append(Trial(name, dict(overrides)))

  takes_arg = len(inspect.signature(module.sweep).parameters) >= 2
  module.sweep(add, arg or None) if takes_arg else module.sweep(add)
  if not trials:
    raise UserError(f"{path}: sweep() declared no trials")
  for trial in trials:
    config = experiments.load_experiment(config_spec)
    try:
      experiments.apply_overrides(config, list(shared))
      experiments.apply_overrides(config, trial.overrides)
    except (KeyError, TypeError, ValueError) as error:
      raise UserError(f"{path}: trial {trial.name!r}: {error}") from error
    for key, value in trial.overrides.items():
      if value is None:
        raise UserError(f"{path}: trial {trial.name!r} sets {key}=None, which the command line cannot "
                         f"express; leave the key out to keep the experiment's default")
  return trials, dict(getattr(module, "PAPER", {}) or {})


TRAINER = (sys.executable, "-m", "train")


def trial_command(config_spec: str, trial_dir: pathlib.Path, shared, overrides: dict,
                  trainer=TRAINER) -> list[str]:
  """The `python -m train ...` command line of one trial (trainer: the command before the flags)."""
  path, sep, arg = config_spec.partition(":")
  flags = [f"--config.{key}={value}" for key, value in overrides.items()]
  return [*trainer, f"--config={os.path.abspath(path)}{sep}{arg}",
          f"--workdir={trial_dir}", *[f"--{s}" for s in shared], *flags]


# ------------------------------------------------------------------------------------------------------
# Running.
# ------------------------------------------------------------------------------------------------------
class _Running:
  def __init__(self, trial: Trial, process: subprocess.Popen, log, trial_dir: pathlib.Path):
    self.trial, self.process, self.log, self.dir = trial, process, log, trial_dir
    self.start = time.time()

  def seconds(self) -> float:
    """How long the trial ran while this runner watched it: a SLURM job from when it was first seen
    running (0 if it never ran: its time in the queue is not the trial's), a local process from its start."""
    if hasattr(self.process, "started"):
      return 0.0 if self.process.started is None else time.time() - self.process.started
    return time.time() - self.start


class _RunningElsewhere:
  """A Popen-like handle on a local trial that a killed sweep command left running (its
  jobs.sweep_trial process still holds the trial's lock): watched until it ends, stopped by SIGTERM."""

  def __init__(self, pid: int, trial_dir: pathlib.Path, log):
    self.pid, self.dir, self.returncode = pid, trial_dir, None
    log.write(f"[sweep] watching the trial's process {pid} again (started by an earlier sweep command)\n")
    log.flush()

  def poll(self):
    if self.returncode is None and sweep_trial.holder(self.dir) is None:
      # The trial process records how its trainer ended (sweep_trial.main); none recorded: it was killed.
      code = read_status(self.dir).get("returncode")
      self.returncode = 0 if (self.dir / DONE).exists() else 1 if code is None else code
    return self.returncode

  def send_signal(self, sig) -> None:
    if self.poll() is None and self.pid > 0:
      os.kill(self.pid, sig)

  def wait(self):
    while self.poll() is None:
      time.sleep(0.2)
    return self.returncode


def start_local(command, trial_dir, log):
  """The trial's trainer under jobs.sweep_trial, which records the trial's result and DONE itself, in a
  session of its own (a SIGHUP or SIGKILL of this command leaves it running); or, where an earlier sweep
  command's trial process still runs, a handle that watches it."""
  running = sweep_trial.holder(trial_dir)
  if running is not None:
    return _RunningElsewhere(running, pathlib.Path(trial_dir), log)
  with sweep_trial.stopping_blocked():
    return subprocess.Popen([sys.executable, "-m", "jobs.sweep_trial", str(trial_dir), "--", *command],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_sweep(config_spec: str, workdir, *, parallel: int = 1, shared=(), only=None,
              poll_seconds: float = 0.5, out=None, trainer=TRAINER, start=start_local) -> dict:
  """Runs the trials of config_spec's sweep under workdir; returns {trial name: final status}.

  shared: overrides for every trial, as 'config.k=v' strings; only: trial names to run (default all);
  trainer: the command that trains one trial (tests substitute a fast fake); start(command, trial_dir,
  log) -> a Popen-like handle runs it (default: a local subprocess; jobs.slurm.trial_starter: a job).
  parallel: the trials running (or queued on SLURM) at once. Writes the results table and plot at the
  start, each time a trial ends, and at the end, also after an interruption.
  """
  workdir = pathlib.Path(workdir).absolute()
  out = out or sys.stdout
  shared = [s.removeprefix("--") for s in shared]
  shared_overrides = [s.removeprefix("config.") for s in shared]
  trials, paper = declared_trials(config_spec, shared_overrides)
  if only:
    unknown = sorted(set(only) - {t.name for t in trials})
    if unknown:
      raise UserError(f"--only: no trials named {unknown}; the sweep has {[t.name for t in trials]}")
    trials = [t for t in trials if t.name in only]
  workdir.mkdir(parents=True, exist_ok=True)
  say = lambda text: print(f"[sweep] {text}", file=out, flush=True)
  try:
    lock = RunLock(workdir).acquire()
  except RunDirLocked:
    raise RunDirLocked(f"another `python -m jobs.sweep` is running in {workdir}; wait for it or stop "
                       f"it") from None

  todo = []
  for trial in trials:
    trial_dir = workdir / trial.name
    if (trial_dir / DONE).exists():
      recorded = read_status(trial_dir).get("overrides")
      if recorded is not None and recorded != _jsonable(trial.overrides):
        say(f"warning: {trial.name} finished with overrides {recorded}, the sweep now says "
            f"{_jsonable(trial.overrides)}; delete {trial_dir} to rerun it")
      say(f"skip {trial.name} (done)")
    else:
      todo.append(trial)
  say(f"{len(trials)} trials, {len(trials) - len(todo)} done, {len(todo)} to run, {parallel} at a time; "
      f"logs in {workdir}/<trial>/{LOG}; see them all with: python -m jobs.status {workdir}")
  baseline = getattr(experiments.load_module(config_spec.partition(":")[0]), "BASELINE", ())

  def results() -> tuple[list[dict], list[pathlib.Path]]:
    rows = [trial_row(t, workdir / t.name, read_status(workdir / t.name), config_spec, shared_overrides,
                      paper) for t in trials]
    return rows, write_results(rows, workdir, paper=bool(paper), title=config_spec, baseline=baseline)

  results()

  stop = SignalFlag().install()
  running: list[_Running] = []
  started = 0
  try:
    while (todo or running):
      if stop.received:
        for r in running:
          if r.process.poll() is None:
            r.process.send_signal(signal.SIGTERM)
        todo = []
      while todo and len(running) < parallel and not stop.received:
        trial = todo.pop(0)
        trial_dir = workdir / trial.name
        if (trial_dir / DONE).exists():   # its own job finished it since the sweep looked
          say(f"skip {trial.name} (done)")
          continue
        started += 1
        trial_dir.mkdir(parents=True, exist_ok=True)
        resumed = (trial_dir / "checkpoints").exists()
        log = open(trial_dir / LOG, "a")
        command = trial_command(config_spec, trial_dir, shared, trial.overrides, trainer)
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        process = start(command, trial_dir, log)
        write_status(trial_dir, status="running", returncode=None, overrides=_jsonable(trial.overrides),
                     command=command, pid=process.pid)
        running.append(_Running(trial, process, log, trial_dir))
        say(f"start {trial.name} ({started}/{started + len(todo)}{', resuming' if resumed else ''}): "
            f"{format_overrides(trial.overrides)}")
      time.sleep(poll_seconds)
      for r in list(running):
        code = r.process.poll()
        if code is None:
          continue
        running.remove(r)
        r.log.close()
        seconds = read_status(r.dir).get("seconds", 0.0) + r.seconds()
        if (r.dir / DONE).exists():   # the trial's own job recorded its result (TrialResult)
          if read_status(r.dir).get("status") != "done":   # our "running" overwrote it: once more
            write_status(r.dir, status="done", returncode=0)
          row = trial_row(r.trial, r.dir, read_status(r.dir), config_spec, shared_overrides, paper)
          say(f"done {r.trial.name} in {read_status(r.dir).get('seconds', 0.0):.0f} s: dev ppl "
              f"{fmt_number(row['dev_ppl'], 3)}, dev BLEU {fmt_number(row['dev_bleu'], 2)}")
        elif code == 0 and reached_end(r.dir):
          write_status(r.dir, status="done", returncode=0, seconds=seconds)
          write_hparams(r.dir, r.trial.overrides)
          mark_done(r.dir)
          row = trial_row(r.trial, r.dir, read_status(r.dir), config_spec, shared_overrides, paper)
          say(f"done {r.trial.name} in {seconds:.0f} s: dev ppl {fmt_number(row['dev_ppl'], 3)}, "
              f"dev BLEU {fmt_number(row['dev_bleu'], 2)}")
        elif code == 0 or stop.received:
          write_status(r.dir, status="interrupted", returncode=code, seconds=seconds)
          say(f"interrupted {r.trial.name}; rerun the command to resume it")
        else:
          write_status(r.dir, status="failed", returncode=code, seconds=seconds)
          say(f"FAILED {r.trial.name} (exit {code}); see {r.dir / LOG}:\n" + _tail(r.dir / LOG))
        results()   # the table follows the sweep as each trial ends
  finally:
    stop.restore()
    for r in running:   # only if the loop itself raised: do not leave trainers behind
      if r.process.poll() is None:
        r.process.send_signal(signal.SIGTERM)
        r.process.wait()
    lock.release()

  rows, paths = results()
  counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed", "interrupted", "pending")}
  say(", ".join(f"{n} {s}" for s, n in counts.items() if n))
  print(markdown_table(rows, bool(paper)), file=out)
  say("results: " + "  ".join(str(p) for p in paths))
  if stop.received:
    say(f"stopped by {stop.received}; rerun the same command to finish the sweep")
  return {row["trial"]: row["status"] for row in rows}


def _tail(path: pathlib.Path, lines: int = 8) -> str:
  text = path.read_text(errors="replace").rstrip().splitlines()[-lines:]
  return "\n".join("    " + line for line in text)


def _jsonable(overrides: dict) -> dict:
  return json.loads(json.dumps(overrides))


# ------------------------------------------------------------------------------------------------------
# Command line.
# ------------------------------------------------------------------------------------------------------
def add_launcher_flags(parser: argparse.ArgumentParser) -> None:
  """--launcher local|slurm and the SLURM flags (jobs/slurm.py), as jobs.sweep and jobs.search take them."""
  parser.add_argument("--launcher", choices=("local", "slurm"), default="local",
                      help="local subprocesses (default) or one SLURM job per trial")
  slurm.add_flags(parser)


def parse_with_overrides(parser: argparse.ArgumentParser, argv, what: str):
  """(args, ['--config.KEY=VALUE', ...]): anything else the parser does not know is a usage error."""
  args, rest = parser.parse_known_args(argv)
  bad = [a for a in rest if not (a.startswith("--config.") and "=" in a)]
  if bad:
    parser.error(f"unexpected arguments {bad}; {what} look like --config.train.num_steps=1000")
  return args, rest


def experiment_parser(prog: str, doc: str, epilog: str, *, config_help: str, workdir_help: str):
  """The flags every command over an experiment's trials starts with: --config and --workdir."""
  parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0], epilog=epilog)
  parser.add_argument("--config", required=True, help=config_help)
  parser.add_argument("--workdir", required=True, help=workdir_help)
  return parser


def main(argv=None) -> int:
  parser = experiment_parser(
      "python -m jobs.sweep", __doc__,
      "Other --config.KEY=VALUE flags apply to every trial (e.g. --config.data.tfds_data_dir=DIR).",
      config_help="experiment file[:arg] with a sweep() function",
      workdir_help="sweep directory; trial NAME runs in DIR/NAME")
  parser.add_argument("--parallel", type=int, default=1,
                      help="trials running at once, or on SLURM queued or running at once (default 1)")
  parser.add_argument("--only", default="", help="comma-separated trial names to run (default: all)")
  add_launcher_flags(parser)
  parser.add_argument("--estimate", action="store_true",
                      help="print each trial's steps, tokens and projected hours on --nodes x --gpus_per_node "
                           "GPUs (train/estimate.py), and exit: nothing starts")
  args, rest = parse_with_overrides(parser, argv, "shared overrides")
  if args.parallel < 1:
    parser.error(f"--parallel must be >= 1, got {args.parallel}")
  only = [name for name in args.only.split(",") if name]
  if args.estimate:   # a dry run (train/estimate.py): each trial's config as its job loads it; nothing starts
    with reported():
      shared, gpus = [s.removeprefix("--") for s in rest], args.gpus_per_node if args.launcher == "slurm" else 0
      configs = [(t.name, preflight.train_config(trial_command(args.config, pathlib.Path(args.workdir) / t.name,
                                                               shared, t.overrides, trainer=()),
                                                 "gpu" if gpus else "cpu")[0])
                 for t in declared_trials(args.config, [s.removeprefix("config.") for s in shared])[0]
                 if not only or t.name in only]
      print(estimate.for_sweep(configs, max(1, args.nodes * gpus), estimate.gpu_kinds(gpus)))
    return 0
  with reported():   # user errors: one line `error: ...`, exit status 2
    start, poll_seconds = start_local, 0.5
    if args.launcher == "slurm":
      try:
        # Each trial's job writes its own result and DONE marker; one squeue call a tick for all of them.
        start, poll_seconds = slurm.trial_starter(slurm.options_from(args), on_success=TrialResult), slurm.TICK
      except ValueError as error:
        parser.error(str(error))
      # Every trial's flags checked as its job would load them, before any job is queued (jobs/preflight.py).
      shared = [s.removeprefix("--") for s in rest]
      trials = declared_trials(args.config, [s.removeprefix("config.") for s in shared])[0]
      preflight.check_runs([trial_command(args.config, pathlib.Path(args.workdir).absolute() / t.name, shared,
                                          t.overrides, trainer=()) for t in trials if not only or t.name in only],
                           slurm.options_from(args))
    statuses = run_sweep(args.config, args.workdir, parallel=args.parallel, shared=rest, only=only or None,
                         poll_seconds=poll_seconds, start=start)
  return 0 if all(s == "done" for s in statuses.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
