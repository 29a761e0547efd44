"""experiments/table3.py:cpu: every row is the full-size row shrunk by one rule, the corpus is checked
before anything runs, and the first trial (base) trains a few steps on a tiny files corpus and reports.
"""
import itertools
import math
import pathlib

import pytest

import experiments
from run import metrics as metrics_io
from jobs import sweep
from jobs.sweep_report import trial_row
from train.train import train_and_evaluate

ROOT = pathlib.Path(__file__).resolve().parent.parent
TABLE3 = ROOT / "experiments" / "table3.py"
T3 = experiments.load_module(TABLE3)


def _tiny_corpus(directory: pathlib.Path) -> pathlib.Path:
  """train/dev/test.tsv of made-up English->German interface messages (train 480, dev 40, test 40)."""
  nouns = [("file", "Datei"), ("folder", "Ordner"), ("image", "Bild"), ("layer", "Ebene"),
           ("page", "Seite"), ("window", "Fenster"), ("account", "Konto"), ("album", "Album")]
  verbs = [("Open", "öffnen"), ("Close", "schließen"), ("Delete", "löschen"), ("Move", "verschieben"),
           ("Copy", "kopieren"), ("Rename", "umbenennen"), ("Save", "speichern"), ("Print", "drucken")]
  extras = [("", ""), (" now", " jetzt"), (" again", " erneut"), (" later", " später"),
            (" here", " hier"), (" first", " zuerst"), (" twice", " zweimal"), (" anyway", " trotzdem"),
            (" quickly", " schnell")]
  pairs = [(f"{v} the {n}{x}", f"{nd}{xd} {vd}") for (n, nd), (v, vd), (x, xd)
           in itertools.product(nouns, verbs, extras)]
  directory.mkdir(parents=True, exist_ok=True)
  for name, chunk in (("train", pairs[:480]), ("dev", pairs[480:520]), ("test", pairs[520:560])):
    (directory / f"{name}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in chunk))
  return directory


def _trials(arg):
  out = []
  T3.sweep(lambda name, **overrides: out.append((name, overrides)), arg)
  return out


def _config(spec, overrides):
  return experiments.apply_overrides(experiments.load_experiment(spec), overrides)


def test_every_cpu_row_is_its_full_size_row_shrunk_by_one_rule(tmp_path):
  corpus = _tiny_corpus(tmp_path / "corpus")
  full = dict(_trials(None))
  cpu = dict(_trials(f"cpu,corpus={corpus}"))
  assert list(cpu) == list(full) + ["base_seed1"] and cpu["base_seed1"] == {"seed": 1}
  for name, overrides in full.items():
    big = _config(str(TABLE3), overrides).model
    small_config = _config(f"{TABLE3}:cpu,corpus={corpus}", cpu[name])
    small = small_config.model
    for key in ("d_model", "d_ff"):
      assert small[key] * T3.CPU_SCALE == big[key], (name, key)
    for key in ("d_k", "d_v"):   # None: d_model / num_heads on both sides
      assert (small[key] is None and big[key] is None) or small[key] * T3.CPU_SCALE == big[key], (name, key)
    for key in ("num_encoder_layers", "num_decoder_layers"):
      assert small[key] * T3.CPU_LAYER_SCALE == big[key], (name, key)
    for key in ("num_heads", "dropout_rate", "positions", "pre_norm", "share_embeddings"):
      assert small[key] == big[key], (name, key)
    assert small_config.train.label_smoothing == _config(str(TABLE3), overrides).train.label_smoothing
    # The paper's peak learning rate goes as d_model^-0.5; so does ours.
    assert small_config.train.learning_rate == pytest.approx(T3.cpu_peak_lr(small.d_model))
    assert small_config.data.source == "files" and small_config.data.train_path == f"{corpus}/train.tsv"
  steps = {name: _config(f"{TABLE3}:cpu,corpus={corpus}", o).train.num_steps for name, o in cpu.items()}
  assert steps["big"] == 3 * steps["base"] == 3 * T3.CPU_STEPS   # the paper: 300K vs 100K
  assert {s for n, s in steps.items() if n != "big"} == {T3.CPU_STEPS}
  assert T3.cpu_peak_lr(128) == pytest.approx(1.3975e-3, rel=1e-3)
  with pytest.raises(ValueError, match="not divisible"):
    T3.scale_to_cpu({"model.d_ff": 1022})
  with pytest.raises(ValueError, match="num_encoder_layers=3 is not divisible"):
    T3.scale_to_cpu({"model.num_encoder_layers": 3})


def test_cpu_variant_names_the_missing_corpus_and_bad_options(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"train.tsv' does not exist.*build_po_corpus.py --lang de"):
    _trials(f"cpu,corpus={tmp_path / 'nowhere'}")
  with pytest.raises(FileNotFoundError, match="does not exist"):   # the runner stops before any trial
    sweep.declared_trials(f"{TABLE3}:cpu,corpus={tmp_path / 'nowhere'}")
  with pytest.raises(ValueError, match="unknown option 'corpse=x'"):
    T3.get_config("cpu,corpse=x")
  with pytest.raises(ValueError, match="only cpu and cpu_overfit take options"):
    T3.get_config("base,corpus=x")
  assert T3.get_config("cpu").data.train_path.endswith("corpus/po_ende/train.tsv")   # the default place


@pytest.mark.slow
def test_cpu_first_trial_trains_a_few_steps_and_reports(tmp_path):
  """The base row of the cpu variant as the sweep declares it, 3 steps, with a vocabulary the tiny
  corpus can fill and a short end-of-run BLEU."""
  corpus = _tiny_corpus(tmp_path / "corpus")
  spec = f"{TABLE3}:cpu,corpus={corpus}"
  trials, paper = sweep.declared_trials(spec)
  first = trials[0]
  assert first.name == "base" and first.overrides == {}
  shared = {"data.vocab_size": 120, "data.vocab_sample_sentences": 1000, "train.num_steps": 3,
            "train.eval_every": 3, "train.log_every": 1, "train.checkpoint_every_steps": 3,
            "train.test_sentences": 4, "train.progress": False, "decode.max_extra_len": 5}
  config = _config(spec, {**shared, **first.overrides})
  assert (config.model.d_model, config.model.num_heads, config.model.num_encoder_layers) == (64, 8, 3)
  workdir = tmp_path / "runs" / first.name
  outcome = train_and_evaluate(config, workdir)
  assert outcome.step == 3 and outcome.interrupted is None
  assert math.isfinite(outcome.eval["eval/loss"]) and outcome.test_bleu is not None
  losses = [l["train/loss"] for l in metrics_io.read_metrics(workdir) if "train/loss" in l]
  assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
  row = trial_row(first, workdir, {"status": "done"}, spec, [f"{k}={v}" for k, v in shared.items()], paper)
  assert row["dev_ppl"] == pytest.approx(outcome.eval["eval/ppl"]) and row["test_bleu"] == outcome.test_bleu
  assert (row["paper_ppl"], row["paper_bleu"]) == (4.92, 25.8) and row["steps"] == 3
