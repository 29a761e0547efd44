"""The report of a sweep (jobs/sweep.py): one row per trial, written as results.csv, results.md (a
Markdown table, the paper's numbers beside ours when the experiment file has a PAPER dict) and
results.png (dev perplexity and dev BLEU per trial).
"""
from __future__ import annotations

import csv
import pathlib

import experiments
import run
from data.vocab import VOCAB_FILE
from run import metrics as metrics_io
from jobs import sweep_directions
from train.flops import num_params


def format_overrides(overrides: dict) -> str:
  return " ".join(f"{k}={v}" for k, v in overrides.items()) or "(experiment defaults)"


def fmt_number(value, digits) -> str:
  return "-" if value is None else f"{value:.{digits}f}"


# ------------------------------------------------------------------------------------------------------
# One row per trial.
# ------------------------------------------------------------------------------------------------------
def trial_row(trial, trial_dir: pathlib.Path, status: dict, config_spec: str, shared_overrides,
              paper: dict) -> dict:
  """What the results table says about one trial (None where nothing was measured).

  trial: a jobs.sweep.Trial (name, overrides); status: its sweep_status.json.
  """
  config = experiments.load_experiment(config_spec)
  experiments.apply_overrides(config, list(shared_overrides))
  experiments.apply_overrides(config, trial.overrides)
  vocab_size = int(config.data.vocab_size)
  if (trial_dir / VOCAB_FILE).exists():   # the trained vocabulary can be a little smaller
    vocab_size = run.load_vocab(trial_dir).size
  try:
    params = num_params(run.model_config(config, vocab_size))
  except ValueError:   # an invalid model (the trial's log says why): no count
    params = None
  lines = metrics_io.read_metrics(trial_dir) if (trial_dir / metrics_io.METRICS).exists() else []
  train = [l for l in lines if "train/loss" in l]
  evals = [l for l in lines if "eval/loss" in l]
  bleus = [l for l in lines if "eval/bleu" in l]
  tests = [l for l in lines if "test/bleu" in l]
  ref = paper.get(trial.name, {})
  return {
      "trial": trial.name,
      "status": status["status"],
      "overrides": format_overrides(trial.overrides),
      "params": params,
      "steps": train[-1]["step"] if train else 0,
      "dev_loss": evals[-1]["eval/loss"] if evals else None,
      "dev_ppl": evals[-1]["eval/ppl"] if evals else None,
      "dev_bleu": bleus[-1]["eval/bleu"] if bleus else None,
      "dev_bleu_step": bleus[-1]["step"] if bleus else None,
      "test_bleu": tests[-1]["test/bleu"] if tests else None,
      "wall_clock_s": round(float(status.get("seconds", 0.0)), 1),
      "paper_ppl": ref.get("ppl"),
      "paper_bleu": ref.get("bleu"),
      "paper_params_m": ref.get("params_m"),
  }


def write_results(rows: list[dict], workdir: pathlib.Path, *, paper: bool, title: str,
                  baseline=()) -> list[pathlib.Path]:
  """Writes workdir/results.csv, results.md and results.png; returns their paths.

  baseline: trial names of the reference setting (the experiment's BASELINE); with it and the paper's
  numbers, results.md and results.png also say whether each effect's direction agrees with the paper's
  (jobs/sweep_directions.py).
  """
  columns = [c for c in rows[0] if paper or not c.startswith("paper_")]
  compare = paper and any(r["trial"] in baseline for r in rows)
  csv_path = workdir / "results.csv"
  with open(csv_path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  md_path = workdir / "results.md"
  md_path.write_text(f"# Sweep {title}\n\nRun directory: {workdir}\n\n" + markdown_table(rows, paper) + "\n"
                     + "dev = the config's dev split (newstest2013 for WMT14); PPL per target piece at the "
                       "last eval; BLEU: sacreBLEU at the last dev BLEU eval (its step in brackets)"
                     + ("; paper: Table 3 (tokenized BLEU, ~0.7-1.5 above sacreBLEU)" if paper else "")
                     + ".\n" + (f"\n{sweep_directions.markdown(rows, baseline)}" if compare else ""))
  png_path = workdir / "results.png"
  plot_results(rows, png_path, paper=paper, title=title,
               notes=sweep_directions.plot_notes(rows, baseline) if compare else None)
  return [csv_path, md_path, png_path]


def markdown_table(rows: list[dict], paper: bool) -> str:
  head = ["trial", "status", "overrides", "params", "steps", "dev loss", "dev PPL", "dev BLEU", "test BLEU",
          "wall-clock"]
  if paper:
    head[7:7] = ["paper PPL"]
    head[9:9] = ["paper BLEU"]
  out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    bleu = fmt_number(r["dev_bleu"], 2) + (f" ({r['dev_bleu_step']})" if r["dev_bleu"] is not None else "")
    cells = [r["trial"], r["status"], r["overrides"], _count(r["params"]), str(r["steps"]),
             fmt_number(r["dev_loss"], 4), fmt_number(r["dev_ppl"], 2), bleu, fmt_number(r["test_bleu"], 2),
             _duration(r["wall_clock_s"])]
    if paper:
      cells[7:7] = [fmt_number(r["paper_ppl"], 2)]
      cells[9:9] = [fmt_number(r["paper_bleu"], 1)]
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out) + "\n"


def _count(n) -> str:
  if n is None:
    return "-"
  return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def _duration(seconds: float) -> str:
  if seconds < 120:
    return f"{seconds:.0f} s"
  if seconds < 7200:
    return f"{seconds / 60:.0f} min"
  return f"{seconds / 3600:.1f} h"


_VERDICT_COLORS = {"agree": "#2e7d32", "disagree": "#c62828", "tie": "#777777", "baseline": "#1f3b73"}


def plot_results(rows: list[dict], path: pathlib.Path, *, paper: bool, title: str, notes=None) -> None:
  """Two panels of horizontal bars, one row per trial: dev PPL and BLEU, ours beside the paper's.

  BLEU is dev BLEU, or the end-of-run (test) BLEU if no trial measured dev BLEU; notes: {trial: {row key:
  word}} printed at each bar's right edge (the agree/disagree/tie verdicts of sweep_directions).
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = [r["trial"] for r in rows]
  n = len(rows)
  fig, axes = plt.subplots(1, 2, figsize=(11, 1.3 + 0.5 * n * (1.3 if paper else 1)), sharey=True)
  bleu = sweep_directions.bleu_key(rows)
  panels = [("dev_ppl", "paper_ppl", "dev perplexity (lower is better)", 2),
            (bleu, "paper_bleu", f"{bleu.split('_')[0]} BLEU (higher is better)", 1)]
  height = 0.38 if paper else 0.6
  for ax, (ours_key, paper_key, label, digits) in zip(axes, panels):
    ours = [r[ours_key] for r in rows]
    theirs = [r[paper_key] for r in rows] if paper else [None] * n
    values = [v for v in ours + theirs if v is not None]
    offset = height / 2 if paper else 0.0
    series = [(ours, -offset, "#1f77b4", "ours")]
    if paper:
      series.append((theirs, offset, "#b0b0b0", "paper"))
    for vals, shift, color, legend in series:
      ys = [i + shift for i, v in enumerate(vals) if v is not None]
      xs = [v for v in vals if v is not None]
      ax.barh(ys, xs, height=height, color=color, label=legend)
      for y, x in zip(ys, xs):
        ax.text(x, y, f" {x:.{digits}f}", va="center", fontsize=8)
    for i, r in enumerate(rows):
      if r[ours_key] is None:
        ax.text(0, i - offset, f"  {r['status'] if r['status'] != 'done' else 'not measured'}",
                va="center", fontsize=8, color="#c0392b")
    if values and ours_key == "dev_ppl" and min(values) > 0 and max(values) / min(values) > 20:
      ax.set_xscale("log")
      label += ", log scale"
    if values:
      lo = ax.get_xlim()[0]
      ax.set_xlim(lo, max(values) * (1.35 if ax.get_xscale() == "linear" else 3))
    ax.set_xlabel(label)
    ax.grid(axis="x", alpha=0.3)
    for i, r in enumerate(rows):
      word = (notes or {}).get(r["trial"], {}).get(ours_key)
      if word:
        ax.text(0.99, i, word, transform=ax.get_yaxis_transform(), ha="right", va="center", fontsize=8,
                color=_VERDICT_COLORS.get(word, "#555555"), fontweight="bold")
    if not values:
      ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", color="#888888")
  axes[0].set_yticks(range(n))
  axes[0].set_yticklabels(names)
  axes[0].invert_yaxis()
  done = sum(r["status"] == "done" for r in rows)
  fig.suptitle(f"sweep {title}: {done}/{n} trials done", fontsize=11, x=0.01, ha="left")
  if paper:
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, ["ours (this run's dev split)", "paper, Table 3 (newstest2013)"], loc="upper right",
               fontsize=8, frameon=False, ncol=2)
  fig.tight_layout(rect=(0, 0, 1, 1 - 0.12 / fig.get_figheight()))
  fig.savefig(path, dpi=110)
  plt.close(fig)
