"""The report of a search (jobs/search.py): results.csv and results.md, best first, with each trial's
parameters, last dev metric, status and cost; PNG plots (optimization history, each parameter against the
metric, the dev metric of every trial by step); the best configuration as a `python -m train` command.
"""
from __future__ import annotations

import csv
import pathlib
import shlex
import time
import warnings

import matplotlib

matplotlib.use("Agg")   # files only, no display
import matplotlib.pyplot as plt   # noqa: E402
import optuna   # noqa: E402
from optuna.trial import TrialState   # noqa: E402

from run import metrics as metrics_io   # noqa: E402
from jobs.sweep_report import format_overrides   # noqa: E402

__all__ = ["format_overrides", "counts", "progress_line", "rows", "write_report"]
STATES = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed",
          TrialState.RUNNING: "running", TrialState.WAITING: "queued"}
_ORDER = ("complete", "pruned", "running", "queued", "failed")
PLOTS = {"history.png": optuna.visualization.matplotlib.plot_optimization_history,
         "params.png": optuna.visualization.matplotlib.plot_slice,
         "dev_by_step.png": optuna.visualization.matplotlib.plot_intermediate_values}


def _state(trial) -> str:
  if trial.state == TrialState.FAIL and trial.user_attrs.get("requeued"):
    return "requeued"
  return STATES.get(trial.state, trial.state.name.lower())


def counts(study) -> dict:
  """{'complete': 3, 'pruned': 2, ...} over the study's trials."""
  result: dict = {}
  for trial in study.get_trials(deepcopy=False):
    result[_state(trial)] = result.get(_state(trial), 0) + 1
  return result


def _best(study):
  try:
    return study.best_trial
  except ValueError:   # no complete trial yet
    return None


def progress_line(study, total: int) -> str:
  """'9/24 trials done: 5 complete, 3 pruned, 1 failed; 2 running; best 2.1634 (trial 4)'."""
  n = counts(study)
  done = n.get("complete", 0) + n.get("pruned", 0) + n.get("failed", 0)
  best = _best(study)
  best_text = f"best {best.value:.4f} (trial {best.number})" if best else "no complete trial yet"
  return (f"{done}/{total} trials done: {n.get('complete', 0)} complete, {n.get('pruned', 0)} pruned, "
          f"{n.get('failed', 0)} failed; {n.get('running', 0)} running; {best_text}")


def _params(trial) -> dict:
  """The trial's parameters; a queued one's are those it was queued with (Optuna's enqueue_trial)."""
  return trial.params or dict(trial.system_attrs.get("fixed_params", {}))


def rows(study, workdir: pathlib.Path, metric: str) -> list[dict]:
  """One row per trial, best first: complete trials by their value, then pruned ones by their last
  value, then running, queued, failed."""
  names = sorted({name for t in study.get_trials(deepcopy=False) for name in t.params})
  sign = -1.0 if study.direction == optuna.study.StudyDirection.MAXIMIZE else 1.0
  table = []
  for trial in study.get_trials(deepcopy=False):
    steps = dict(trial.intermediate_values)
    last_step = max(steps) if steps else None
    value = trial.value if trial.value is not None else (steps[last_step] if steps else None)
    trial_dir = workdir / str(trial.user_attrs.get("run_dir", ""))
    metrics_path = trial_dir / metrics_io.METRICS
    trained = 0
    if trial.user_attrs.get("run_dir") and metrics_path.is_file():
      trained = max((line.get("step", 0) for line in metrics_io.read_metrics(trial_dir)), default=0)
    table.append({"trial": trial.number, "status": _state(trial), metric: value,
                  "at_step": last_step, **{name: _params(trial).get(name) for name in names},
                  "steps_trained": trained, "wall_clock_s": trial.user_attrs.get("seconds"),
                  "run_dir": trial.user_attrs.get("run_dir", ""),
                  "error": trial.user_attrs.get("error", "")})
  order = lambda r: (_ORDER.index(r["status"]) if r["status"] in _ORDER else len(_ORDER),
                     sign * r[metric] if r[metric] is not None else float("inf"), r["trial"])
  return sorted(table, key=order)


def best_command(study, config_spec: str, shared, workdir: pathlib.Path) -> str | None:
  """The best complete trial's configuration as a ready `python -m train` command, or None."""
  best = _best(study)
  if best is None:
    return None
  flags = [*(f"--{s}" for s in shared), *(f"--config.{k}={v}" for k, v in
                                           best.user_attrs.get("overrides", best.params).items())]
  return shlex.join(["python", "-m", "train", f"--config={config_spec}", f"--workdir={workdir / 'best'}",
                     *flags])


def _cell(value, column: str = "") -> str:
  if isinstance(value, float):
    return f"{value:.1f}" if column == "wall_clock_s" or abs(value) >= 1000 else f"{value:.4g}"
  return "-" if value in (None, "") else str(value).replace("|", "/")


def write_report(study, workdir: pathlib.Path, config_spec: str, shared, metric: str):
  """Writes workdir/results.csv, results.md and the plots; returns (their paths, the best command)."""
  table = rows(study, workdir, metric)
  paths = []
  if not table:
    return paths, None
  csv_path = workdir / "results.csv"
  with open(csv_path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(table[0]))
    writer.writeheader()
    writer.writerows(table)
  paths.append(csv_path)
  for name, plot in PLOTS.items():
    if not any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
      break
    try:
      with warnings.catch_warnings():   # a single point's axis limits, experimental API
        warnings.simplefilter("ignore")
        axes = plot(study) if name == "dev_by_step.png" else plot(study, target_name=metric)
    except ValueError:   # e.g. no parameter to plot
      continue
    figure = getattr(axes, "figure", None) or axes.flat[0].figure
    figure.set_size_inches(max(6.4, 3.2 * len(getattr(axes, "flat", [axes]))), 4.2)
    figure.savefig(workdir / name, dpi=100, bbox_inches="tight")
    plt.close(figure)
    paths.append(workdir / name)
  command = best_command(study, config_spec, shared, workdir)
  n = counts(study)
  header = [f"# Search: {config_spec}", "",
            f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; study `{study.study_name}`, {metric} "
            f"({study.direction.name.lower()}); " + ", ".join(f"{v} {k}" for k, v in n.items()) + ".",
            f"Fixed for every trial: {' '.join(shared) or '(nothing)'}." + "".join(
                f" Trial {t.number} ran the experiment's own settings." for t in study.trials
                if t.user_attrs.get("baseline")), "",
            f"Best configuration, trained in full:\n\n```bash\n{command}\n```" if command else
            "No trial has completed yet.", ""]
  columns = list(table[0])
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(_cell(r[c], c) for c in columns) + " |" for r in table]
  plots = [f"![{p.stem}]({p.name})" for p in paths if p.suffix == ".png"]
  (workdir / "results.md").write_text("\n".join(header + lines + [""] + plots) + "\n")
  paths.insert(1, workdir / "results.md")
  return paths, command
