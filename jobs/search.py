"""`python -m jobs.search`: an Optuna study over an experiment's search space, each trial a normal run.

    python -m jobs.search --config experiments/small_corpus.py --workdir runs/search --trials 24 \\
        [--parallel 2] [--metric dev_nll|dev_loss|dev_bleu] [--sampler tpe|qmc|random] \\
        [--pruner hyperband|halving|median|none] [--storage URL] [--launcher local|slurm ...] \\
        [--config.KEY=VALUE ...]

The experiment file's `search_space(trial)` (jobs/search_trial.py) gives each trial's overrides; trial N
runs as `python -m train --config FILE --workdir DIR/trial_NNNN --config.KEY=VALUE ...`, its output in
DIR/trial_NNNN/sweep.log, as a sweep's trials do. A --config.KEY=VALUE flag fixes that key for the whole
study (the search space's parameter of that name is not sampled). The sampler is TPE (or a scrambled Sobol
sequence, `qmc`, or `random`); the pruner (Hyperband by default, from the experiment's eval_every to
num_steps) reads the dev metric each evaluation writes to the run's metrics.jsonl and stops a trial that
trails: SIGTERM, the trainer saves a checkpoint and exits, the trial is 'pruned', and its run directory
resumes by hand with its command.

The study lives in DIR/study.journal (Optuna's journal file, with a lock that works on NFS), or in the
database of --storage (e.g. postgresql://...). Any number of workers share a study: rerun the command in
another shell or on another host with the same --workdir (or --storage); each asks the study for the next
trial, and no two run the same one. --trials N is the study's total. Rerunning continues the study: a
trial whose worker died (no heartbeat for --stale_after seconds, or its process is gone from this host) is
marked failed and queued again, and the retry resumes its run directory; a trial that fails is recorded
with the last line of its log. Ctrl-C or SIGTERM: the trials in flight save a checkpoint and are queued
again. At the end (also after Ctrl-C): DIR/results.md, results.csv and PNG plots (jobs/search_report.py),
with the best configuration as a `python -m train` command.

--launcher slurm (the flags of jobs/slurm.py) runs each trial as a SLURM job through submitit, as
`python -m jobs.sweep --launcher slurm` does; --parallel jobs at a time. --processes P runs each local
trial as P processes (jobs/launch.py); on SLURM, --tasks_per_node and --nodes do that.
"""
from __future__ import annotations

import os
import pathlib
import platform
import sys
import threading
import time
import warnings

import optuna
from optuna.trial import TrialState

import experiments
from run.user_errors import UserError, reported
from train.signals import SignalFlag
from jobs import preflight, search_report, search_trial, slurm, sweep

JOURNAL = "study.journal"
SAMPLERS = ("tpe", "qmc", "random")
PRUNERS = ("hyperband", "halving", "median", "none")
STALE_AFTER = 300.0   # seconds without a heartbeat after which another worker's running trial is stale
_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def make_sampler(name: str, seed: int | None):
  if name == "tpe":
    return optuna.samplers.TPESampler(seed=seed)
  if name == "qmc":   # the Sobol index is the study's: workers with one seed draw different points
    return optuna.samplers.QMCSampler(scramble=True, seed=seed or 0, warn_independent_sampling=False,
                                      warn_asynchronous_seeding=False)
  return optuna.samplers.RandomSampler(seed=seed)


def make_pruner(name: str, min_steps: int, max_steps: int):
  """A pruner whose resource is the training step: evaluations from min_steps (eval_every) on."""
  if name == "hyperband":
    return optuna.pruners.HyperbandPruner(min_resource=min_steps, max_resource=max(max_steps, min_steps))
  if name == "halving":
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_steps)
  if name == "median":
    return optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=min_steps)
  return optuna.pruners.NopPruner()


def open_study(workdir: pathlib.Path, config_spec: str, fixed: list[str], metric: str,
               storage: str | None) -> optuna.Study:
  """Creates or loads the study of workdir; a UserError if it was started with another experiment,
  other fixed keys or another metric."""
  if storage is None:
    path = str(workdir / JOURNAL)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        path, lock_obj=optuna.storages.journal.JournalFileOpenLock(path)))
  direction = search_trial.METRICS[metric][1]
  study = optuna.create_study(storage=storage, study_name=workdir.name, direction=direction,
                              load_if_exists=True)
  definition = {"config": config_spec, "fixed": list(fixed), "metric": metric}
  recorded = study.user_attrs.get("definition")
  if recorded is None:
    study.set_user_attr("definition", definition)
  elif recorded != definition:
    raise UserError(f"{workdir}: the study there was started with {recorded}, not {definition}; rerun "
                    f"with those flags to continue it, or use another --workdir")
  return study


def counted(trials) -> list:
  """The trials that count toward --trials: all but the failed ones queued again as a retry."""
  return [t for t in trials if not (t.state == TrialState.FAIL and t.user_attrs.get("requeued"))]


def requeue(study: optuna.Study, trial, reason: str) -> None:
  """Marks a running trial failed (reason: its error) and queues a retry that resumes its run directory."""
  storage = study._storage   # attributes of a trial another worker (maybe dead) created
  storage.set_trial_user_attr(trial._trial_id, "error", reason)
  storage.set_trial_user_attr(trial._trial_id, "requeued", True)
  study.tell(trial.number, state=TrialState.FAIL)
  if not any(t.user_attrs.get("retry_of") == trial.number for t in study.get_trials(deepcopy=False)):
    study.enqueue_trial(trial.params, user_attrs={"run_dir": trial.user_attrs.get("run_dir"),
                                                  "retry_of": trial.number})


def _stale(trial, workdir: pathlib.Path, stale_after: float) -> str | None:
  """Why a running trial of another worker has no worker any more, or None if it may still have one."""
  host, _, pid = str(trial.user_attrs.get("worker", "")).rpartition(":")
  if host == platform.node() and pid.isdigit() and int(pid) != os.getpid():
    try:
      os.kill(int(pid), 0)
    except ProcessLookupError:
      return f"worker {host}:{pid} stopped mid-trial"
    except PermissionError:
      pass
  beat = workdir / str(trial.user_attrs.get("run_dir", "")) / search_trial.HEARTBEAT
  last = beat.stat().st_mtime if beat.is_file() else trial.datetime_start.timestamp()
  if time.time() - last > stale_after:
    return f"worker {trial.user_attrs.get('worker', '?')} silent for {time.time() - last:.0f} s"
  return None


class _Search:
  """What the workers of one process share."""

  def __init__(self, study, config_spec, workdir, fixed, shared, trials, start, trainer, key, poll_seconds,
               stale_after, out):
    self.study, self.config_spec, self.workdir = study, config_spec, workdir
    self.fixed, self.shared, self.trials = fixed, shared, trials
    self.start, self.trainer, self.key, self.poll_seconds = start, trainer, key, poll_seconds
    self.stale_after, self.out = stale_after, out
    self.space = search_trial.search_space_of(config_spec.partition(":")[0])
    self.lock, self.mine, self.error = threading.RLock(), set(), None
    self.stop = SignalFlag()
    self.progress = ""

  def say(self, text: str) -> None:
    with self.lock:
      clear = "\r\033[K" if self.progress and self.out.isatty() else ""
      print(f"{clear}[search] {text}", file=self.out, flush=True)
      self.progress = ""

  def recover(self) -> None:
    for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
      reason = trial.number not in self.mine and _stale(trial, self.workdir, self.stale_after)
      if reason:
        requeue(self.study, trial, reason + "; queued again")
        self.say(f"trial {trial.number}: {reason}; queued again to resume {trial.user_attrs.get('run_dir')}")

  def next_trial(self):
    """The next trial to run (a queued retry first), or None when the study has all its trials."""
    while not (self.stop.received or self.error):
      with self.lock:
        self.recover()
        trials = self.study.get_trials(deepcopy=False)
        waiting = any(t.state == TrialState.WAITING for t in trials)
        if waiting or len(counted(trials)) < self.trials:
          trial = self.study.ask()
          self.mine.add(trial.number)
          return trial
        others = [t for t in trials if t.state == TrialState.RUNNING and t.number not in self.mine]
      if not others:
        return None
      time.sleep(max(self.poll_seconds, 1.0))   # another worker's trials may yet be queued again
    return None

  def work(self) -> None:
    try:
      while (trial := self.next_trial()) is not None:
        self.run(trial)
    except Exception as error:   # noqa: BLE001 -- ends the other workers too, re-raised by run_search
      self.error = self.error or error

  def run(self, trial) -> None:
    try:
      overrides = search_trial.trial_overrides(self.space, trial, self.fixed, self.config_spec)
    except UserError as error:
      trial.set_user_attr("error", str(error))
      self.study.tell(trial, state=TrialState.FAIL)
      raise
    run_dir = trial.user_attrs.get("run_dir") or f"trial_{trial.number:04d}"
    trial_dir = self.workdir / run_dir
    for key, value in dict(run_dir=run_dir, overrides=overrides,
                           worker=f"{platform.node()}:{os.getpid()}").items():
      trial.set_user_attr(key, value)
    retry = trial.user_attrs.get("retry_of")
    self.say(f"start trial {trial.number}{f' (resumes trial {retry})' if retry is not None else ''}: "
             f"{search_report.format_overrides(overrides)}")
    command = sweep.trial_command(self.config_spec, trial_dir, self.shared, overrides, self.trainer)
    outcome = search_trial.follow(trial, overrides, command, trial_dir, start=self.start, key=self.key,
                                  stop=self.stop, poll_seconds=self.poll_seconds)
    trial.set_user_attr("seconds", round(outcome.seconds, 1))
    if outcome.state == "complete":
      self.study.tell(trial, outcome.value)
    elif outcome.state == "pruned":
      self.study.tell(trial, state=TrialState.PRUNED)
    elif outcome.state == "failed":
      trial.set_user_attr("error", outcome.error)
      self.study.tell(trial, state=TrialState.FAIL)
    else:
      requeue(self.study, trial, outcome.error + "; queued again")
    value = "-" if outcome.value is None else f"{outcome.value:.4g}"
    self.say(f"{outcome.state} trial {trial.number} in {outcome.seconds:.0f} s at step {outcome.step}: "
             f"{self.key} {value}" + (f"; {outcome.error}" if outcome.state == "failed" else ""))

  def show_progress(self) -> None:
    line = search_report.progress_line(self.study, self.trials)
    with self.lock:
      if self.out.isatty():
        print(f"\r\033[K[search] {line}", end="", file=self.out, flush=True)
      elif line != self.progress:
        print(f"[search] {line}", file=self.out, flush=True)
      self.progress = line


def run_search(config_spec: str, workdir, *, trials: int, parallel: int = 1, shared=(), metric="dev_nll",
               sampler="tpe", pruner="hyperband", storage=None, seed=None, start=search_trial.start_local,
               trainer=sweep.TRAINER, poll_seconds=0.5, stale_after=STALE_AFTER, baseline_first=False,
               out=None) -> dict:
  """Runs (or continues) the study of workdir until it has `trials` trials; returns {state: count}.

  shared: 'config.KEY=VALUE' strings fixed for the whole study; trainer, start: as in jobs.sweep.run_sweep
  (tests substitute a fast fake trainer; jobs.slurm.trial_starter runs trials as SLURM jobs);
  baseline_first: a new study's first trial runs the experiment's own settings, for comparison.
  """
  workdir = pathlib.Path(workdir).absolute()
  out = out or sys.stdout
  path, sep, arg = config_spec.partition(":")
  config_spec = f"{os.path.abspath(path)}{sep}{arg}"
  shared = [s.removeprefix("--") for s in shared]
  fixed_list = [s.removeprefix("config.") for s in shared]
  config = experiments.load_experiment(config_spec)
  try:
    experiments.apply_overrides(config, fixed_list)
  except (KeyError, TypeError, ValueError) as error:
    raise UserError(str(error).strip("'\"")) from error
  fixed = {key: search_trial.config_value(config, key) for key in (s.split("=", 1)[0] for s in fixed_list)}
  if metric == "dev_bleu" and not int(config.train.bleu_every):
    raise UserError("--metric dev_bleu needs periodic dev BLEU: fix --config.train.bleu_every=N (a "
                    "multiple of eval_every), or use --metric dev_nll")
  workdir.mkdir(parents=True, exist_ok=True)
  optuna.logging.set_verbosity(optuna.logging.WARNING)
  warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
  study = open_study(workdir, config_spec, fixed_list, metric, storage)
  study.sampler = make_sampler(sampler, None if seed is None else seed + len(study.trials))
  eval_every = int(config.train.bleu_every if metric == "dev_bleu" else config.train.eval_every) or 1
  study.pruner = make_pruner(pruner, eval_every, int(config.train.num_steps))
  search = _Search(study, config_spec, workdir, fixed, shared, trials, start, trainer,
                   search_trial.METRICS[metric][0], poll_seconds, stale_after, out)
  if baseline_first and not study.trials:
    params = {k: v for k, v in search_trial.experiment_params(search.space, config).items() if k not in fixed}
    study.enqueue_trial(params, user_attrs={"baseline": True})
  search.say(f"study {study.study_name} in {workdir}: {trials} trials, {parallel} at a time, {metric} "
             f"({study.direction.name.lower()}), {sampler} sampler, {pruner} pruner; logs in "
             f"{workdir}/trial_NNNN/{sweep.LOG}")
  began = time.time()
  search.stop.install()
  workers = [threading.Thread(target=search.work, daemon=True) for _ in range(parallel)]
  try:
    for worker in workers:
      worker.start()
    while any(w.is_alive() for w in workers):
      search.show_progress()
      time.sleep(max(poll_seconds, 1.0))
  finally:
    search.stop.restore()
    if any(w.is_alive() for w in workers):   # only if this loop raised: stop the trials, let them save
      search.stop.received = search.stop.received or "an error"
      for worker in workers:
        worker.join()
  search.show_progress()
  print(file=out)
  search.say(f"{time.time() - began:.0f} s in this worker")
  paths, best = search_report.write_report(study, workdir, config_spec, shared, metric)
  search.say("results: " + "  ".join(str(p) for p in paths))
  if best:
    search.say(f"best configuration, trained in full:\n    {best}")
  if search.stop.received:
    search.say(f"stopped by {search.stop.received}; rerun the same command to continue the study")
  if search.error:
    raise search.error
  return search_report.counts(study)


# ------------------------------------------------------------------------------------------------------
# Command line.
# ------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
  parser = sweep.experiment_parser(
      "python -m jobs.search", __doc__, "Other --config.KEY=VALUE flags fix that key for every trial of the study.",
      config_help="experiment file[:arg] with a search_space(trial)",
      workdir_help="study directory; trial N runs in DIR/trial_NNNN")
  parser.add_argument("--trials", type=int, required=True, help="the study's total number of trials")
  parser.add_argument("--parallel", type=int, default=1, help="trials at once in this worker (default 1)")
  parser.add_argument("--metric", choices=tuple(search_trial.METRICS), default="dev_nll",
                      help="what the study optimizes, from each evaluation (default dev_nll: the dev loss "
                           "without label smoothing)")
  parser.add_argument("--sampler", choices=SAMPLERS, default="tpe", help="default tpe; qmc: scrambled Sobol")
  parser.add_argument("--pruner", choices=PRUNERS, default="hyperband", help="default hyperband")
  parser.add_argument("--seed", type=int, default=None, help="the sampler's seed (default: random)")
  parser.add_argument("--storage", default=None,
                      help=f"an Optuna RDB URL (default: the journal file DIR/{JOURNAL})")
  parser.add_argument("--baseline_first", action="store_true",
                      help="a new study's first trial runs the experiment's own settings (the hand-tuned ones)")
  parser.add_argument("--stale_after", type=float, default=STALE_AFTER,
                      help=f"seconds without a heartbeat before another worker's trial is queued again "
                           f"(default {STALE_AFTER:.0f})")
  parser.add_argument("--processes", type=int, default=1, help="local: processes per trial (jobs.launch)")
  parser.add_argument("--devices_per_process", type=int, default=None, help="local: CPU devices each")
  sweep.add_launcher_flags(parser)
  args, rest = sweep.parse_with_overrides(parser, argv, "fixed keys")
  for name in ("trials", "parallel", "processes"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  trainer, start, poll = sweep.TRAINER, search_trial.start_local, 0.5
  if args.processes > 1:
    devices = [f"--devices_per_process={args.devices_per_process}"] if args.devices_per_process else []
    trainer = (sys.executable, "-m", "jobs.launch", f"--processes={args.processes}", *devices, "--")
  if args.launcher == "slurm":
    try:
      start, poll = slurm.trial_starter(slurm.options_from(args)), 5.0
    except ValueError as error:
      parser.error(str(error))
  with reported():   # user errors: one line `error: ...`, exit status 2
    if args.launcher == "slurm":   # before any trial is queued: the experiment with the fixed keys
      preflight.check_train_flags([f"--config={args.config}", f"--workdir={args.workdir}", *rest],
                                  slurm.options_from(args))
    counts = run_search(args.config, args.workdir, trials=args.trials, parallel=args.parallel, shared=rest,
                        metric=args.metric, sampler=args.sampler, pruner=args.pruner, storage=args.storage,
                        seed=args.seed, start=start, trainer=trainer, poll_seconds=poll,
                        stale_after=args.stale_after, baseline_first=args.baseline_first)
  return 0 if counts.get("complete") else 1


if __name__ == "__main__":
  sys.exit(main())
