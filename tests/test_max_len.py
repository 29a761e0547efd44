"""data/max_len.py: max_len from the corpus keeps at least the share asked for, is the shortest such
multiple of 8, never passes the cap, agrees with the length filter, and says what it drops; and
config.data.max_len=0 in training: derived from the tokenized training split, printed, recorded in
config.json, kept on resume, checked against the model's positions."""
import json

import numpy as np
import pytest

import experiments
from data import DataError, synthetic
from data.batching import fitting
from data.max_len import derive_max_len, needed
from run.config import load_run_config
from run.user_errors import UserError
from train import train as train_lib


def test_keeps_the_share_asked_for_with_the_shortest_multiple_of_8():
  rng = np.random.default_rng(0)
  src = rng.integers(1, 60, 2000)
  tgt = rng.integers(1, 60, 2000)
  src[:7] = 300                                      # 7 very long pairs: 0.35% of the corpus
  choice = derive_max_len(src, tgt)
  need = needed(src, tgt)
  assert choice.max_len % 8 == 0 and choice.max_len < 300
  assert (need <= choice.max_len).mean() >= 0.995
  assert (need <= choice.max_len - 8).mean() < 0.995   # 8 shorter would keep too few
  assert choice.dropped == (need > choice.max_len).sum() >= 7 and choice.longest == 300
  # The length filter (data.batching.fitting) keeps exactly the pairs counted as kept, and reports them.
  with pytest.warns(UserWarning, match=f"skipped {choice.dropped} pairs"):
    assert len(fitting(src, tgt, choice.max_len)) == choice.pairs - choice.dropped


def test_the_target_needs_room_for_bos_and_eos():
  assert derive_max_len([8], [8]).max_len == 16      # target 8 pieces + 1 does not fit 8
  assert derive_max_len([8], [7]).max_len == 8
  assert derive_max_len([1, 1], [0, 0]).max_len == 8  # never below one multiple


def test_the_cap_wins_and_says_so():
  src = np.full(100, 400)
  choice = derive_max_len(src, np.zeros(100, int), cap=256)
  assert (choice.max_len, choice.dropped, choice.kept_share) == (256, 100, 0.0)
  assert "capped" in choice.describe() and "drops 100 longer pairs" in choice.describe()
  ok = derive_max_len([10] * 1000, [10] * 1000)
  assert ok.dropped == 0 and "capped" not in ok.describe() and "keeps 1,000 of 1,000 pairs" in ok.describe()


def test_coverage_one_keeps_every_pair_and_bad_inputs_are_errors():
  src = np.arange(1, 201)
  assert derive_max_len(src, src, coverage=1.0).max_len == 208 and derive_max_len(src, src, coverage=1.0).dropped == 0
  with pytest.raises(ValueError, match="non-empty"):
    derive_max_len([], [])
  with pytest.raises(ValueError, match="coverage"):
    derive_max_len([1], [1], coverage=0.0)


# ------------------------------------------------------------------------------------------------------
# config.data.max_len=0 in a training run.
# ------------------------------------------------------------------------------------------------------
LONG = 3   # pairs of 60 words: 0.3% of the corpus, so the derived max_len drops them
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """train.tsv of 1,000 pairs of 3-8 words (the target reversed), LONG of them 60 words; dev.tsv of 40."""
  folder = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(0)
  sentence = lambda n: " ".join(rng.choice(WORDS, n))
  lines = [sentence(int(n)) for n in rng.integers(3, 9, 1040)]
  lines[5:5 + 100 * LONG:100] = [sentence(60) for _ in range(LONG)]
  tsv = lambda part: "".join(f"{line}\t{line[::-1]}\n" for line in part)
  (folder / "train.tsv").write_text(tsv(lines[:1000]))
  (folder / "dev.tsv").write_text(tsv(lines[1000:]))
  return folder


def _config(corpus, **overrides):
  config = experiments.load_experiment("experiments/default.py:smoke")
  return experiments.apply_overrides(config, {
      "data.source": "files", "data.train_path": str(corpus / "train.tsv"),
      "data.dev_path": str(corpus / "dev.tsv"), "data.test_path": str(corpus / "dev.tsv"),
      "data.vocab_size": 200, "data.max_len": 0,
      "train.test_bleu": False, "train.bleu_every": 0, "train.progress": False, "train.tensorboard": False,
      "train.eval_every": 0, "train.dev_sentences": 16, **overrides})


def test_max_len_0_is_derived_printed_recorded_and_kept_on_resume(corpus, tmp_path, capsys, monkeypatch):
  workdir = tmp_path / "run"
  with pytest.warns(UserWarning, match=f"skipped {LONG} pairs"):
    train_lib.train_and_evaluate(_config(corpus), workdir)
  line = next(l for l in capsys.readouterr().out.splitlines() if "from the corpus" in l)
  derived = load_run_config(workdir).data.max_len
  assert line.startswith(f"[data] data.max_len={derived} from the corpus: keeps {1000 - LONG:,} of 1,000 pairs")
  assert f"drops {LONG} longer pairs" in line and derived % 8 == 0
  assert json.loads((workdir / "config.json").read_text())["data"]["max_len"] == derived

  # Resuming with max_len=0 takes the recorded value and derives nothing (the corpus could have changed).
  def never(*_):
    raise AssertionError("a resumed run derived max_len again")
  monkeypatch.setattr(train_lib, "derive_train_max_len", never)
  with pytest.warns(UserWarning, match=f"skipped {LONG} pairs"):
    outcome = train_lib.train_and_evaluate(_config(corpus, **{"train.num_steps": 4}), workdir)
  out = capsys.readouterr().out
  assert outcome.step == 4 and "resumed" in out and "data.max_len:" not in out   # no change reported
  assert f"data.max_len={derived}: derived from the corpus when this run began" in out
  assert load_run_config(workdir).data.max_len == derived


def test_a_derived_max_len_past_the_positions_and_a_negative_one_are_errors(corpus, tmp_path):
  with pytest.raises(UserError, match=r"exceeds the model's positions, config.model.max_len=8; raise "
                                      r"config.model.max_len to at least \d+"):
    train_lib.train_and_evaluate(_config(corpus, **{"model.max_len": 8}), tmp_path / "short")
  with pytest.raises(DataError, match=r"config.data.max_len=-8: use a positive number .* or 0 to derive"):
    train_lib.train_and_evaluate(_config(corpus, **{"data.max_len": -8}), tmp_path / "negative")
