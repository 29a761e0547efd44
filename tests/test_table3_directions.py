"""The direction/tie logic of jobs/sweep_directions.py on hand-made numbers, and the results.md/png it
adds to a sweep's report.
"""
import pytest

from jobs import sweep_directions as sd
from jobs.sweep_report import write_results

BASELINE = ("base", "base_seed1")


def _row(trial, ppl, bleu, paper_ppl=None, paper_bleu=None, status="done", dev_bleu=None):
  return {"trial": trial, "status": status, "overrides": "", "params": None, "steps": 10, "dev_loss": None,
          "dev_ppl": ppl, "dev_bleu": dev_bleu, "dev_bleu_step": None, "test_bleu": bleu, "wall_clock_s": 1.0,
          "paper_ppl": paper_ppl, "paper_bleu": paper_bleu, "paper_params_m": None}


# Baseline: PPL 5.0 and 5.2 (mean 5.1, spread 0.2); BLEU 20.0 and 19.0 (mean 19.5, spread 1.0).
ROWS = [
    _row("base", 5.0, 20.0, 4.92, 25.8),
    _row("A_h1", 5.5, 18.0, 5.29, 24.9),        # both worse beyond the noise, as the paper: agree, agree
    _row("A_h16", 5.25, 19.6, 4.91, 25.8),      # within the noise; the paper: no effect either: agree, agree
    _row("C_N8", 5.15, 21.0, 4.88, 25.5),       # PPL same/same: agree; BLEU better vs paper worse: disagree
    _row("D_ls0.0", 4.6, 19.8, 4.67, 25.3),     # PPL better/better: agree; BLEU within noise vs worse: tie
    _row("E_learned", 5.6, 19.5, 4.92, 25.7),   # PPL worse where the paper sees none: disagree
    _row("C_N2", None, None, 6.11, 23.7, status="failed"),
    _row("base_seed1", 5.2, 19.0),
]


def _by_trial(rows):
  return {r["trial"]: r for r in sd.directions(rows, BASELINE)}


def test_direction_respects_tolerance_and_which_way_is_better():
  assert sd.direction(0.2, 0.2, lower_is_better=True) == "same"     # at the tolerance: a tie
  assert sd.direction(0.21, 0.2, lower_is_better=True) == "worse"   # PPL up
  assert sd.direction(-0.21, 0.2, lower_is_better=True) == "better"
  assert sd.direction(0.21, 0.2, lower_is_better=False) == "better"  # BLEU up
  assert sd.direction(None, 0.2, lower_is_better=False) is None


def test_verdicts_agree_disagree_tie():
  assert sd.verdict("worse", "worse") == sd.verdict("same", "same") == "agree"
  assert sd.verdict("better", "worse") == "disagree"
  assert sd.verdict("worse", "same") == "disagree"   # an effect the paper does not see
  assert sd.verdict("same", "better") == "tie"       # the paper's effect is within our noise
  assert sd.verdict(None, "worse") is None


def test_baseline_mean_and_spread_come_from_both_seeds():
  assert sd.baseline_stats(ROWS, BASELINE, "dev_ppl") == pytest.approx((5.1, 0.2, 2))
  assert sd.baseline_stats(ROWS, BASELINE, "test_bleu") == pytest.approx((19.5, 1.0, 2))
  assert sd.baseline_stats(ROWS, ("nobody",), "dev_ppl") == (None, None, 0)


def test_directions_on_hand_made_numbers():
  rows = _by_trial(ROWS)
  assert set(rows) == {"A_h1", "A_h16", "C_N8", "D_ls0.0", "E_learned", "C_N2"}   # not the baseline
  expected = {  # trial: (our PPL dir, paper PPL dir, PPL verdict, our BLEU dir, paper BLEU dir, BLEU verdict)
      "A_h1": ("worse", "worse", "agree", "worse", "worse", "agree"),
      "A_h16": ("same", "same", "agree", "same", "same", "agree"),
      "C_N8": ("same", "same", "agree", "better", "worse", "disagree"),
      "D_ls0.0": ("better", "better", "agree", "same", "worse", "tie"),
      "E_learned": ("worse", "same", "disagree", "same", "same", "agree"),
      "C_N2": (None, "worse", None, None, "worse", None),
  }
  for trial, want in expected.items():
    r = rows[trial]
    got = tuple(r[f"{k}_{m}"] for m in ("ppl", "bleu") for k in ("ours_dir", "paper_dir", "verdict"))
    assert got == want, trial
  assert rows["A_h1"]["ours_delta_ppl"] == pytest.approx(0.4)
  assert rows["A_h1"]["paper_delta_bleu"] == pytest.approx(-0.9)


def test_a_single_baseline_seed_counts_every_difference():
  rows = _by_trial([r for r in ROWS if r["trial"] != "base_seed1"])
  assert rows["A_h16"]["ours_dir_ppl"] == "worse"    # +0.25 over 5.0, no spread to call it a tie
  assert rows["D_ls0.0"]["ours_dir_bleu"] == "worse"


def test_dev_bleu_is_preferred_when_measured():
  rows = [dict(r, dev_bleu=r["test_bleu"] and 100 - r["test_bleu"]) for r in ROWS]
  assert sd.bleu_key(rows) == "dev_bleu" and sd.bleu_key(ROWS) == "test_bleu"
  assert _by_trial(rows)["A_h1"]["ours_dir_bleu"] == "better"   # 82 vs 80.5: read from dev_bleu


def test_results_md_and_png_carry_the_verdicts(tmp_path):
  paths = write_results(ROWS, tmp_path, paper=True, title="hand-made", baseline=BASELINE)
  assert [p.name for p in paths] == ["results.csv", "results.md", "results.png"]
  text = (tmp_path / "results.md").read_text()
  assert "baseline mean 5.100 over base 5.000, base_seed1 5.200; spread 0.200" in text
  section = text.split("## Direction of each effect")[1]
  line = next(l for l in section.splitlines() if l.startswith("| C_N8 |"))
  assert line.split(" | ")[3:] == ["agree", "21.00 (+1.50, better)", "25.50 (-0.30, worse)", "disagree |"]
  assert "| C_N2 (failed) | - |" in text
  assert "PPL: 4 agree, 1 disagree, 0 tie." in text and "BLEU: 3 agree, 1 disagree, 1 tie." in text
  assert (tmp_path / "results.png").stat().st_size > 10_000
  # Without a baseline (or the paper's numbers) the report is as before: no direction section.
  write_results(ROWS, tmp_path, paper=True, title="hand-made")
  assert "Direction of each effect" not in (tmp_path / "results.md").read_text()


def test_a_row_with_two_seeds_is_judged_once_by_their_mean_and_the_larger_spread(tmp_path):
  seeds = [_row("E_learned_seed1", 5.0, 19.5),    # E_learned's mean 5.3: +0.2 over base, within 0.2
           _row("A_h1_seed1", 5.7, 18.4),          # A_h1's mean 5.6 (spread 0.2), still worse
           _row("D_ls0.0_seed1", 5.2, 19.8),      # D_ls0.0's seeds 4.6 and 5.2: spread 0.6 > base's 0.2
           _row("lonely_seed1", 5.5, 19.0)]       # no trial 'lonely': a row of its own
  rows = _by_trial(ROWS + seeds)
  assert set(rows) == {"A_h1", "A_h16", "C_N8", "D_ls0.0", "E_learned", "C_N2", "lonely_seed1"}
  assert rows["A_h1"]["trials"] == ["A_h1", "A_h1_seed1"] and rows["A_h1"]["seeds_ppl"] == 2
  assert rows["A_h1"]["ours_ppl"] == pytest.approx(5.6) and rows["A_h1"]["verdict_ppl"] == "agree"
  # One seed said "worse where the paper sees no effect"; the mean of two says "within the noise".
  assert rows["E_learned"]["ours_delta_ppl"] == pytest.approx(0.2)
  assert (rows["E_learned"]["ours_dir_ppl"], rows["E_learned"]["verdict_ppl"]) == ("same", "agree")
  # D_ls0.0's mean, 4.9, is 0.2 below base's 5.1: within its own seeds' spread of 0.6.
  assert rows["D_ls0.0"]["spread_ppl"] == pytest.approx(0.6)
  assert (rows["D_ls0.0"]["ours_dir_ppl"], rows["D_ls0.0"]["verdict_ppl"]) == ("same", "tie")
  # The report shows the mean and how many seeds, and each seed's bar carries the row's verdict.
  write_results(ROWS + seeds, tmp_path, paper=True, title="hand-made", baseline=BASELINE)
  text = (tmp_path / "results.md").read_text()
  assert "| A_h1 | 5.60 (mean of 2 seeds) (+0.50, worse) |" in text
  assert "| A_h1_seed1 |" not in text.split("## Direction of each effect")[1]
  notes = sd.plot_notes(ROWS + seeds, BASELINE)
  assert notes["E_learned_seed1"] == notes["E_learned"] == {"dev_ppl": "agree", "test_bleu": "agree"}
