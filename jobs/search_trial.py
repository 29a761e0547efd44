"""One trial of a search (jobs/search.py): its overrides from the experiment's `search_space(trial)`, its
run as a normal `python -m train` in a run directory of its own, and its dev metric, read from the run's
metrics.jsonl after every evaluation and reported to Optuna. A trial the pruner stops gets SIGTERM, which
makes the trainer save a checkpoint and exit as any interrupted run does: its run directory resumes by hand
with the same command.

The search space is a function beside get_config; it names each parameter by the config key it sets and
returns the overrides (other keys may be derived from the sampled ones):

    def search_space(trial):
      return {"train.learning_rate": trial.suggest_float("train.learning_rate", 1e-3, 3e-2, log=True),
              "model.num_encoder_layers": trial.suggest_int("model.num_encoder_layers", 1, 4)}
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import pathlib
import signal
import subprocess
import time

import experiments
from run import metrics as metrics_io
from run.user_errors import UserError
from run.workdir import RunDirLocked, RunLock
from jobs import slurm, sweep, sweep_trial

# --metric: the metrics.jsonl key each evaluation writes, and which way is better. dev_nll is the dev loss
# without label smoothing (comparable across label_smoothing values; per target token, so not across
# vocabularies: a space that changes the vocabulary wants dev_bleu); dev_loss includes the smoothing.
METRICS = {"dev_nll": ("eval/nll", "minimize"), "dev_loss": ("eval/loss", "minimize"),
           "dev_bleu": ("eval/bleu", "maximize")}
HEARTBEAT = "search_heartbeat"   # in the trial's run directory: touched by the worker that follows it
_SUGGEST = ("suggest_float", "suggest_int", "suggest_categorical", "suggest_uniform", "suggest_loguniform",
            "suggest_discrete_uniform")


class FixedKeys:
  """An Optuna trial whose suggest_* returns the study's fixed value (--config.KEY=VALUE) for a parameter
  named by a fixed key, without sampling it; everything else goes to the trial."""

  def __init__(self, trial, fixed: dict):
    self._trial, self._fixed = trial, fixed

  def __getattr__(self, name):
    attribute = getattr(self._trial, name)
    if name not in _SUGGEST:
      return attribute

    def suggest(param, *args, **kwargs):
      return self._fixed[param] if param in self._fixed else attribute(param, *args, **kwargs)
    return suggest


class _ExperimentValues:
  """Answers every suggest_* with the experiment's own value of the key the parameter names."""

  def __init__(self, config):
    self.config, self.params = config, {}

  def __getattr__(self, name):
    if name not in _SUGGEST:
      raise AttributeError(f"search_space() asked the trial for {name!r}; only suggest_* can be answered")

    def suggest(param, *args, **kwargs):
      self.params[param] = config_value(self.config, param)
      return self.params[param]
    return suggest


def config_value(config, dotted: str):
  """config['train']['learning_rate'] for 'train.learning_rate'."""
  for name in dotted.split("."):
    config = config[name]
  return config


def experiment_params(space, config) -> dict:
  """The parameters of `space` at the experiment's own settings (config): the hand-tuned trial."""
  recorder = _ExperimentValues(config)
  space(recorder)
  return recorder.params


def search_space_of(path: str):
  """The experiment file's search_space function; a UserError that says what to add if it has none."""
  module = experiments.load_module(path)
  space = getattr(module, "search_space", None)
  if space is None or len(inspect.signature(space).parameters) != 1:
    raise UserError(f"{path} has no search_space(trial) function; add one beside get_config that returns "
                    f"{{'config.key': trial.suggest_float('config.key', low, high, log=True), ...}} "
                    f"(see experiments/small_corpus.py)")
  return space


def trial_overrides(space, trial, fixed: dict, config_spec: str) -> dict:
  """{dotted key: value} for one trial, checked against the experiment's locked config.

  fixed: the study's --config.KEY=VALUE overrides, parsed; they win over the search space.
  """
  path = config_spec.partition(":")[0]
  chosen = space(FixedKeys(trial, fixed))
  chosen = dict(trial.params if chosen is None else chosen)
  overrides = {key: value for key, value in chosen.items() if key not in fixed}
  config = experiments.load_experiment(config_spec)
  try:
    experiments.apply_overrides(config, dict(fixed))
    experiments.apply_overrides(config, dict(overrides))
  except (KeyError, TypeError, ValueError) as error:
    raise UserError(f"{path}: search_space(): {str(error).strip(chr(39))}") from error
  for key, value in overrides.items():
    if value is None:
      raise UserError(f"{path}: search_space() sets {key}=None, which the command line cannot express; "
                      f"leave the key out to keep the experiment's default")
  return json.loads(json.dumps(overrides))   # plain Python values (numpy scalars from a sampler)


def dev_values(trial_dir: pathlib.Path, key: str) -> list[tuple[int, float]]:
  """[(step, value)] of every evaluation in the run's metrics.jsonl that has `key`, in order."""
  path = trial_dir / metrics_io.METRICS
  if not path.exists():
    return []
  values = []
  for line in path.read_text(errors="replace").splitlines():
    try:
      record = json.loads(line)
      value = float(record[key])
    except (ValueError, KeyError, TypeError):
      continue   # another kind of line, or one half-written
    if math.isfinite(value):
      values.append((int(record["step"]), value))
  return values


def last_line(path: pathlib.Path) -> str:
  """The last non-empty line of a log (what a failed trial's error is recorded as)."""
  lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if l.strip()] if path.exists() else []
  return lines[-1][:300] if lines else "(empty log)"


# ------------------------------------------------------------------------------------------------------
# Starting and stopping a trainer.
# ------------------------------------------------------------------------------------------------------
def start_local(command, trial_dir, log):
  """The trial's trainer under jobs.sweep_trial in a session of its own, as a sweep's (a worker killed or
  hung up leaves it running, and the retry of its trial watches it instead of starting it again); or a
  handle on the one an earlier worker left running."""
  if sweep_trial.holder(trial_dir) is None:
    _wait_unlocked(pathlib.Path(trial_dir))
  return sweep.start_local(command, trial_dir, log)


def terminate(process) -> None:
  """SIGTERM to a trial's trainer: a local process, or every task of its SLURM job (scancel --signal
  reaches the trainer under submitit's task, which lets SIGTERM pass); it saves a checkpoint and exits."""
  if isinstance(process, slurm.SlurmTrial):
    subprocess.run(["scancel", "--signal=TERM", str(process.job_id)], capture_output=True, timeout=60)
  elif process.poll() is None:
    process.send_signal(signal.SIGTERM)


def _wait_unlocked(trial_dir: pathlib.Path, seconds: float = 120.0) -> None:
  """Waits while a trainer still holds the run directory (a stopped worker's, saving its checkpoint)."""
  deadline = time.time() + seconds
  while True:
    try:
      RunLock(trial_dir).acquire().release()
      return
    except RunDirLocked:
      if time.time() > deadline:
        raise
      time.sleep(1.0)


# ------------------------------------------------------------------------------------------------------
# Following one trial.
# ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
  state: str                   # complete | pruned | failed | interrupted
  value: float | None = None   # the last dev metric
  step: int = 0                # the step of that evaluation
  error: str = ""
  seconds: float = 0.0


def follow(trial, overrides: dict, command, trial_dir: pathlib.Path, *, start, key: str, stop,
           poll_seconds: float) -> Outcome:
  """Runs `command` (the trial's `python -m train`, with overrides) for an Optuna trial in trial_dir and
  follows it to the end; returns its Outcome.

  start(command, trial_dir, log) -> a Popen-like handle (start_local, or jobs.slurm.trial_starter's);
  key: the metrics.jsonl key reported (METRICS); stop: a train.signals.SignalFlag: when it is raised, the
  trainer gets SIGTERM and the outcome is 'interrupted'.
  """
  trial_dir.mkdir(parents=True, exist_ok=True)
  log = open(trial_dir / sweep.LOG, "a")
  log.write(f"\n$ {' '.join(command)}\n")
  log.flush()
  began, before = time.time(), sweep.read_status(trial_dir).get("seconds", 0.0)
  process = start(command, trial_dir, log)
  sweep.write_status(trial_dir, status="running", returncode=None, overrides=overrides, command=command,
                     pid=process.pid,
                     optuna_trial=trial.number, worker=trial.user_attrs.get("worker"))
  reported, pruned, interrupted = set(), False, False
  earlier = {step for step, _ in dev_values(trial_dir, key)}   # a retry is pruned on what it trains itself
  try:
    while True:
      done = process.poll() is not None
      (trial_dir / HEARTBEAT).touch()
      for step, value in dev_values(trial_dir, key):
        if step in reported:
          continue
        trial.report(value, step)
        reported.add(step)
        if not (pruned or interrupted or done) and step not in earlier and trial.should_prune():
          terminate(process)
          pruned = True
      if done:
        break
      if stop.received and not interrupted and not pruned:
        terminate(process)
        interrupted = True
      time.sleep(poll_seconds)
  finally:
    if process.poll() is None:   # only if following raised: leave no trainer behind
      terminate(process)
      process.wait()
    log.close()
  seconds = before + time.time() - (   # not the status's: the trial process may have added its own
      getattr(process, "started", None) or began)
  values = dev_values(trial_dir, key)
  step, value = values[-1] if values else (0, None)
  if process.returncode != 0:
    outcome = Outcome("failed", value, step, last_line(trial_dir / sweep.LOG), seconds)
  elif (interrupted or pruned) and sweep.reached_end(trial_dir):   # SIGTERM came after the last step
    outcome = Outcome("complete", value, step, "", seconds)
  elif interrupted:
    outcome = Outcome("interrupted", value, step, f"interrupted by {stop.received}", seconds)
  elif pruned:
    outcome = Outcome("pruned", value, step, "", seconds)
  elif value is None:
    outcome = Outcome("failed", None, 0, f"no {key} in {trial_dir / metrics_io.METRICS}: evaluate with "
                      f"config.train.eval_every (and bleu_every for dev_bleu)", seconds)
  else:
    outcome = Outcome("complete", value, step, "", seconds)
  sweep.write_status(trial_dir, status=outcome.state, returncode=process.returncode, seconds=seconds)
  if outcome.state == "complete":
    (trial_dir / sweep.DONE).write_text(f"finished {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
  return outcome
