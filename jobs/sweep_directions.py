"""Which way each trial moves the result against a baseline, ours beside the paper's, and whether they agree.

A sweep whose experiment file names BASELINE (trial names that train the reference setting, e.g. twice with
different seeds) gets this section in its results.md and verdicts in its results.png. Pure functions of the
rows jobs/sweep_report.py builds:

    rows = directions(results, ("base", "base_seed1"))   # one row per other trial

For each metric (PPL: lower is better; BLEU: higher is better) a trial's direction is 'better', 'worse' or
'same' against the baseline. Ours: the difference from the mean of the baseline trials, 'same' when it is
within their spread (max - min), the noise of training the same setting again. The paper's: the difference
from its base row, 'same' within PAPER_TIES (the paper gives single runs and no spread). The verdict:
  agree     both say the same thing (both 'same' included);
  disagree  opposite directions, or we see an effect beyond our noise where the paper sees none;
  tie       our difference is within our noise where the paper sees an effect: this scale cannot tell.

A row trained with more than one seed (trials ROW, ROW_seed1, ROW_seed2, ...) is judged once, by the mean
of its seeds, and its noise is the larger of the baseline's spread and its own: a row whose seeds scatter
more than the baseline's needs a larger effect to count.
"""
from __future__ import annotations

import csv
import re

# Differences the paper's Table 3 reports that we read as "no effect": about 1% of its base PPL (4.92),
# and a quarter of a BLEU point (it prints one decimal).
PAPER_TIES = {"ppl": 0.05, "bleu": 0.25}
LOWER_IS_BETTER = {"ppl": True, "bleu": False}


def bleu_key(rows: list[dict]) -> str:
  """'dev_bleu' if any trial measured it, else 'test_bleu' (a sweep that scores BLEU only at the end)."""
  return "dev_bleu" if any(r.get("dev_bleu") is not None for r in rows) else "test_bleu"


def direction(delta, tolerance: float, lower_is_better: bool):
  """'better', 'worse' or 'same' (|delta| <= tolerance) for a metric's change; None if delta is None."""
  if delta is None:
    return None
  if abs(delta) <= tolerance:
    return "same"
  return "better" if (delta < 0) == lower_is_better else "worse"


def verdict(ours, paper):
  """'agree', 'disagree' or 'tie' (see the module docstring); None if either direction is unknown."""
  if ours is None or paper is None:
    return None
  if ours == paper:
    return "agree"
  return "tie" if ours == "same" else "disagree"


def baseline_stats(rows: list[dict], baseline, key: str):
  """(mean, spread, n) of rows[key] over the measured baseline trials; (None, None, 0) if none is."""
  values = [r[key] for r in rows if r["trial"] in baseline and r.get(key) is not None]
  if not values:
    return None, None, 0
  return sum(values) / len(values), max(values) - min(values), len(values)


def seeds_of(rows: list[dict], baseline) -> dict[str, list[dict]]:
  """{row: [its trials, first seed first]} for every non-baseline trial: ROW_seedK joins ROW when ROW is a
  trial of the sweep, otherwise it is a row of its own."""
  names = {r["trial"] for r in rows}
  groups: dict[str, list[dict]] = {}
  for r in rows:
    if r["trial"] in baseline:
      continue
    match = re.fullmatch(r"(.+)_seed\d+", r["trial"])
    row = match.group(1) if match and match.group(1) in names and match.group(1) not in baseline else r["trial"]
    groups.setdefault(row, []).append(r)
  for row, trials in groups.items():
    trials.sort(key=lambda t: t["trial"] != row)   # the row's own trial (its paper numbers) first
  return groups


def directions(rows: list[dict], baseline, *, paper_ties=None) -> list[dict]:
  """One dict per non-baseline trial: for m in ('ppl', 'bleu'): ours_m, ours_delta_m, ours_dir_m,
  paper_m, paper_delta_m, paper_dir_m, verdict_m; None where something was not measured.

  rows: sweep_report.trial_row dicts (trial, dev_ppl, dev_bleu/test_bleu, paper_ppl, paper_bleu);
  baseline: the trial names of the reference setting (the first one's paper numbers are the paper's base).
  Our tolerance is the baseline trials' spread; with one baseline trial it is 0 (every difference counts).
  A row with several seeds (seeds_of) gives one dict: ours_m is their mean, seeds_m how many were
  measured, spread_m their spread, and the tolerance the larger of the two spreads. Until every seed of
  a row is measured, the row is judged on those that are.
  """
  baseline = tuple(baseline)
  ties = dict(PAPER_TIES, **(paper_ties or {}))
  keys = {"ppl": "dev_ppl", "bleu": bleu_key(rows)}
  paper_base = next((r for r in rows if r["trial"] == baseline[0]), {})
  out = []
  for name, trials in seeds_of(rows, baseline).items():
    row = trials[0]
    # One seed, or seeds that agree: its status; else the seeds that are not done, e.g. 'A_h1_seed1 failed'.
    status = row.get("status") if len({t.get("status") for t in trials}) == 1 else ", ".join(
        f"{t['trial']} {t.get('status')}" for t in trials if t.get("status") not in (None, "done")) or None
    result = {"trial": name, "status": status, "trials": [t["trial"] for t in trials]}
    for metric, key in keys.items():
      mean, spread, _ = baseline_stats(rows, baseline, key)
      values = [t[key] for t in trials if t.get(key) is not None]
      ours = sum(values) / len(values) if values else None
      own_spread = max(values) - min(values) if values else 0.0
      ours_delta = None if ours is None or mean is None else ours - mean
      paper, paper_ref = row.get(f"paper_{metric}"), paper_base.get(f"paper_{metric}")
      paper_delta = None if paper is None or paper_ref is None else paper - paper_ref
      ours_dir = direction(ours_delta, max(spread or 0.0, own_spread), LOWER_IS_BETTER[metric])
      paper_dir = direction(paper_delta, ties[metric], LOWER_IS_BETTER[metric])
      result.update({f"seeds_{metric}": len(values), f"spread_{metric}": own_spread,
                     f"ours_{metric}": ours, f"ours_delta_{metric}": ours_delta, f"ours_dir_{metric}": ours_dir,
                     f"paper_{metric}": paper, f"paper_delta_{metric}": paper_delta,
                     f"paper_dir_{metric}": paper_dir, f"verdict_{metric}": verdict(ours_dir, paper_dir)})
    out.append(result)
  return out


def second_seed_rows(results_csv, rows, baseline, metric: str = "ppl") -> tuple:
  """The rows of a first pass (every row once, the baseline trials) whose `metric` verdict ('ppl' or
  'bleu') is 'tie' or 'disagree': the rows that want a second seed (experiments/table3.py's
  OVERFIT_SECOND_SEED).

  results_csv: the results.csv jobs.sweep writes (one line per trial: trial, status, dev_ppl, dev_bleu,
  paper_ppl, paper_bleu, ...); rows: the first pass's row names in the sweep's order; baseline: the
  trial names of the reference setting. Each row is judged by its first seed alone against the mean and
  spread of the baseline, as directions() does. Returns the doubtful rows in the order of `rows`. Raises
  ValueError naming the rows or baseline trials that have no result yet: the first pass must be complete
  before its verdicts choose.
  """
  numbers = ("dev_ppl", "dev_bleu", "test_bleu", "paper_ppl", "paper_bleu")
  with open(results_csv, newline="") as f:
    results = [{k: (float(v) if v else None) if k in numbers else v for k, v in line.items()}
               for line in csv.DictReader(f)]
  by_name = {r["trial"]: r for r in results}
  first_pass = list(rows) + [name for name in baseline if name not in rows]
  key = "dev_ppl" if metric == "ppl" else bleu_key(results)
  missing = [name for name in first_pass if by_name.get(name, {}).get(key) is None]
  if missing:
    raise ValueError(f"second_seed_rows: {results_csv} has no {key} for {missing}: finish the first pass "
                     f"(rerun the sweep; finished trials are skipped) before choosing second seeds")
  doubtful = {r["trial"] for r in directions([by_name[name] for name in first_pass], baseline)
              if r[f"verdict_{metric}"] in ("tie", "disagree")}
  return tuple(name for name in rows if name in doubtful)


def _cell(value, delta, word, digits, seeds=1) -> str:
  if value is None:
    return "-"
  mean = f"{value:.{digits}f}" + (f" (mean of {seeds} seeds)" if seeds > 1 else "")
  return mean + ("" if delta is None else f" ({delta:+.{digits}f}, {word})")


def markdown(rows: list[dict], baseline) -> str:
  """The results.md section: the baseline's mean and spread, then one line per trial with both verdicts."""
  baseline = tuple(baseline)
  key = bleu_key(rows)
  lines = ["## Direction of each effect against the baseline", ""]
  for metric, k, digits in (("PPL", "dev_ppl", 3), ("BLEU", key, 2)):
    mean, spread, n = baseline_stats(rows, baseline, k)
    values = ", ".join(f"{r['trial']} {r[k]:.{digits}f}" for r in rows
                       if r["trial"] in baseline and r.get(k) is not None)
    if n >= 2:
      lines.append(f"- {metric} ({k}): baseline mean {mean:.{digits}f} over {values}; spread {spread:.{digits}f}: "
                   f"a difference within it is a tie.")
    elif n == 1:
      lines.append(f"- {metric} ({k}): baseline {values}; one seed, no spread: every difference counts.")
    else:
      lines.append(f"- {metric} ({k}): the baseline ({', '.join(baseline)}) was not measured.")
  lines.append("- A row with several seeds (ROW, ROW_seed1, ...) is judged by their mean, its tolerance the "
               "larger of the baseline's spread and its own.")
  lines.append(f"- Paper: Table 3 against its base row; differences within {PAPER_TIES['ppl']} PPL or "
               f"{PAPER_TIES['bleu']} BLEU read as no effect (single runs). Verdicts: agree; disagree; tie = "
               f"our difference is within our noise where the paper sees an effect.")
  lines += ["", "| trial | our PPL | paper PPL | PPL | our BLEU | paper BLEU | BLEU |", "|---|---|---|---|---|---|---|"]
  table = directions(rows, baseline)
  for r in table:
    cells = [r["trial"] + ("" if r["status"] in (None, "done") else f" ({r['status']})")]
    for metric, digits in (("ppl", 2), ("bleu", 2)):
      cells += [_cell(r[f"ours_{metric}"], r[f"ours_delta_{metric}"], r[f"ours_dir_{metric}"], digits,
                      r[f"seeds_{metric}"]),
                _cell(r[f"paper_{metric}"], r[f"paper_delta_{metric}"], r[f"paper_dir_{metric}"], digits),
                r[f"verdict_{metric}"] or "-"]
    lines.append("| " + " | ".join(cells) + " |")
  for metric in ("ppl", "bleu"):
    counts = {v: sum(r[f"verdict_{metric}"] == v for r in table) for v in ("agree", "disagree", "tie")}
    lines.append(f"\n{metric.upper()}: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".")
  return "\n".join(lines) + "\n"


def plot_notes(rows: list[dict], baseline) -> dict:
  """{trial: {'dev_ppl': verdict, <bleu key>: verdict}} for the results.png panels ('base' for baseline)."""
  key = bleu_key(rows)
  notes = {name: {"dev_ppl": "baseline", key: "baseline"} for name in baseline}
  for r in directions(rows, baseline):
    for trial in r["trials"]:   # each seed's bar carries its row's verdict
      notes[trial] = {"dev_ppl": r["verdict_ppl"], key: r["verdict_bleu"]}
  return notes
