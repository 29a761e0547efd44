"""experiments/table3.py:cpu_overfit: the cpu rule on a slice of the corpus, several passes over it.

The slice spans the whole training file, is written once and atomically, and every row keeps the cpu
variant's shrinking but trains the overfit regime's steps at its learning rate.
"""
import csv
import pathlib

import pytest

import experiments
from jobs import sweep_directions

ROOT = pathlib.Path(__file__).resolve().parent.parent
TABLE3 = ROOT / "experiments" / "table3.py"
T3 = experiments.load_module(TABLE3)


def _corpus(directory: pathlib.Path, train_pairs: int = 100) -> pathlib.Path:
  directory.mkdir(parents=True)
  (directory / "train.tsv").write_text("".join(f"source {i}\tziel {i}\n" for i in range(train_pairs)))
  for split in ("dev", "test"):
    (directory / f"{split}.tsv").write_text("a\tb\n")
  return directory


def _trials(arg):
  out = []
  T3.sweep(lambda name, **overrides: out.append((name, overrides)), arg)
  return dict(out)


def test_slice_spans_the_file_and_is_written_once(tmp_path):
  assert T3.slice_lines(list(range(10)), 3) == [0, 3, 6]
  assert T3.slice_lines(list(range(5)), 8) == [0, 1, 2, 3, 4]      # fewer lines than asked: all of them
  corpus = _corpus(tmp_path / "c")
  path = pathlib.Path(T3.overfit_slice(str(corpus), pairs=10))
  assert path.read_text().splitlines() == [f"source {i}\tziel {i}" for i in range(0, 100, 10)]
  path.write_text("kept\tkept\n")                                   # an existing slice is not rewritten
  assert pathlib.Path(T3.overfit_slice(str(corpus), pairs=10)).read_text() == "kept\tkept\n"
  assert not list(corpus.glob(".*.tmp"))
  with pytest.raises(FileNotFoundError, match="build_po_corpus.py"):
    T3.overfit_slice(str(tmp_path / "nowhere"))


def test_overfit_rows_are_the_cpu_rows_on_the_slice_with_more_steps(tmp_path):
  corpus = _corpus(tmp_path / "c", train_pairs=3 * T3.OVERFIT_PAIRS)
  cpu = T3.get_config(f"cpu,corpus={corpus}")
  over = T3.get_config(f"cpu_overfit,corpus={corpus}")
  # The model differs from the cpu variant's by its widths only (OVERFIT_SCALE instead of CPU_SCALE).
  widths = ("d_model", "d_ff")
  assert {k: v for k, v in over.model.items() if k not in widths} == \
      {k: v for k, v in cpu.model.items() if k not in widths}
  for key in widths:
    assert over.model[key] * T3.OVERFIT_SCALE == cpu.model[key] * T3.CPU_SCALE
  assert over.model.d_model == 512 // T3.OVERFIT_SCALE
  assert over.data.train_path == str(corpus / f"train_slice{T3.OVERFIT_PAIRS}.tsv")
  assert len(pathlib.Path(over.data.train_path).read_text().splitlines()) == T3.OVERFIT_PAIRS
  assert (over.data.dev_path, over.data.test_path) == (cpu.data.dev_path, cpu.data.test_path)
  assert over.train.num_steps == T3.OVERFIT_STEPS > cpu.train.num_steps
  peak = T3.OVERFIT_LR_SCALE * T3.cpu_peak_lr(over.model.d_model)
  assert over.train.learning_rate == pytest.approx(peak, rel=1e-4)
  assert over.train.dev_sentences == T3.OVERFIT_DEV_PAIRS   # dev loss and BLEU on the first dev pairs
  assert over.data.vocab_size == T3.OVERFIT_VOCAB == 0 != cpu.data.vocab_size   # 0: by the slice's size
  # Dev BLEU is measured before the end, at eval steps only (train/train.py), so on a multiple of eval_every.
  assert 0 < over.train.bleu_every < over.train.num_steps and over.train.bleu_every % over.train.eval_every == 0

  cpu_rows, rows = _trials(f"cpu,corpus={corpus}"), _trials(f"cpu_overfit,corpus={corpus}")
  assert list(rows)[:len(cpu_rows)] == list(cpu_rows)
  assert [n for n in rows if n not in cpu_rows] == [f"{r}_seed1" for r in T3.OVERFIT_SECOND_SEED]
  assert rows["big"]["train.num_steps"] == 3 * T3.OVERFIT_STEPS
  assert rows["C_d256"]["train.learning_rate"] == pytest.approx(
      T3.OVERFIT_LR_SCALE * T3.cpu_peak_lr(256 // T3.OVERFIT_SCALE), rel=1e-4)
  assert rows["A_h1"]["model.d_k"] == 512 // T3.OVERFIT_SCALE


def test_every_overfit_row_is_its_full_size_row_shrunk_by_the_overfit_rule(tmp_path):
  """One rule for every row: widths / OVERFIT_SCALE, layers / CPU_LAYER_SCALE, the rest as the paper."""
  corpus = _corpus(tmp_path / "c", train_pairs=3 * T3.OVERFIT_PAIRS)
  rows = _trials(f"cpu_overfit,corpus={corpus}")
  for name, overrides in _trials(None).items():
    full = experiments.apply_overrides(experiments.load_experiment(str(TABLE3)), overrides)
    small = experiments.apply_overrides(
        experiments.load_experiment(f"{TABLE3}:cpu_overfit,corpus={corpus}"), rows[name])
    for key in ("d_model", "d_ff", "d_k", "d_v"):   # None: d_model / num_heads on both sides
      assert (small.model[key] is None and full.model[key] is None) or \
          small.model[key] * T3.OVERFIT_SCALE == full.model[key], (name, key)
    for key in ("num_encoder_layers", "num_decoder_layers"):
      assert small.model[key] * T3.CPU_LAYER_SCALE == full.model[key], (name, key)
    for key in ("num_heads", "dropout_rate", "positions", "pre_norm", "share_embeddings"):
      assert small.model[key] == full.model[key], (name, key)
    assert small.train.label_smoothing == full.train.label_smoothing, name
    peak = T3.OVERFIT_LR_SCALE * T3.cpu_peak_lr(small.model.d_model)
    assert small.train.learning_rate == pytest.approx(peak, rel=1e-4), name
    assert small.train.num_steps == (3 if name == "big" else 1) * T3.OVERFIT_STEPS, name
  with pytest.raises(ValueError, match="not divisible by 4"):
    T3.scale_to_cpu({"model.d_ff": 1022}, width_scale=4)


def test_first_pass_is_every_row_once_and_base_twice_then_the_chosen_second_seeds(tmp_path, monkeypatch):
  corpus = _corpus(tmp_path / "c", train_pairs=3 * T3.OVERFIT_PAIRS)
  monkeypatch.setattr(T3, "OVERFIT_SECOND_SEED", ())
  first = _trials(f"cpu_overfit,corpus={corpus}")
  assert list(first) == [name for name, _ in T3.full_size_rows()] + ["base_seed1"]
  assert first["base_seed1"] == {"seed": 1}
  monkeypatch.setattr(T3, "OVERFIT_SECOND_SEED", ("A_h1", "C_N8"))
  rows = _trials(f"cpu_overfit,corpus={corpus}")
  assert list(rows) == list(first) + ["A_h1_seed1", "C_N8_seed1"]   # the first pass's trials unchanged
  assert {n: rows[n] for n in first} == first
  for name in ("A_h1", "C_N8"):
    assert rows[f"{name}_seed1"] == {**rows[name], "seed": 1}


def _results_csv(path, ppl, bleu=None):
  """A results.csv as jobs.sweep writes it: trial, status, dev_ppl, dev_bleu, paper_ppl, paper_bleu."""
  names = [name for name, _ in T3.full_size_rows()] + ["base_seed1", "A_h4_seed1"]
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=["trial", "status", "dev_ppl", "dev_bleu", "dev_bleu_step",
                                           "paper_ppl", "paper_bleu"])
    writer.writeheader()
    for name in names:
      paper = T3.PAPER.get(name, {})
      writer.writerow({"trial": name, "status": "done" if ppl.get(name) else "pending",
                       "dev_ppl": ppl.get(name), "dev_bleu": (bleu or {}).get(name),
                       "dev_bleu_step": 1800, "paper_ppl": paper.get("ppl"), "paper_bleu": paper.get("bleu")})
  return path


def _second_seed_rows(results_csv, metric="ppl"):
  """Table 3's first pass as jobs.sweep_directions judges it: its rows in the sweep's order, its BASELINE."""
  return sweep_directions.second_seed_rows(results_csv, [name for name, _ in T3.full_size_rows()],
                                           T3.BASELINE, metric)


def test_second_seeds_go_to_the_rows_whose_first_verdict_ties_or_disagrees(tmp_path):
  # Base seeds 38 and 39: mean 38.5, spread 1. Every other row first agrees with the paper's direction.
  base = T3.PAPER["base"]
  ppl = {"base": 38.0, "base_seed1": 39.0}
  for name, paper in T3.PAPER.items():
    if name != "base":
      delta = paper["ppl"] - base["ppl"]
      ppl[name] = 38.5 if abs(delta) <= 0.05 else (41.0 if delta > 0 else 36.0)
  ppl["A_h4_seed1"] = 50.0                 # a second seed already trained: not a first verdict
  ppl.update({"A_h1": 38.8,                # the paper: worse; ours within the spread: tie
              "C_N8": 36.0,                # the paper: no effect (4.88 against 4.92); ours better: disagree
              "D_ls0.0": 41.0})            # the paper: better; ours worse: disagree
  assert _second_seed_rows(_results_csv(tmp_path / "r.csv", ppl)) == ("A_h1", "C_N8", "D_ls0.0")

  # By BLEU: every row at the base mean is within the seeds' spread: a tie wherever the paper sees an
  # effect, an agreement where it sees none (its BLEU within 0.25 of base's 25.8).
  bleu = {name: 11.0 for name in ppl} | {"base": 10.0, "base_seed1": 12.0}
  by_bleu = _second_seed_rows(_results_csv(tmp_path / "b.csv", ppl, bleu), metric="bleu")
  rows = [name for name, _ in T3.full_size_rows() if name != "base"]
  assert by_bleu == tuple(n for n in rows if n not in ("A_h16", "C_d1024", "D_ls0.2", "E_learned"))

  del ppl["big"]                           # the first pass is not finished: no choice yet
  with pytest.raises(ValueError, match=r"no dev_ppl for \['big'\]"):
    _second_seed_rows(_results_csv(tmp_path / "p.csv", ppl))
