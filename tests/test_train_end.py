"""The end of training as the paper reports it: the average of the last N checkpoints scored beside the
final parameters (config.train.average_last), early stopping on dev loss, the real tokens per batch in
metrics.jsonl; the start from another run's parameters (config.train.init_checkpoint); and a run of the
config layout before the compute section, which decodes and resumes.
"""
import copy
import json
import logging
import pathlib
import shutil

import jax
import numpy as np
import pytest

import experiments
import run
from data import make_train_iterator
from decode.translate import translate
from run import checkpoint as ckpt
from run import get_vocab
from run import metrics as metrics_io
from train.average import average_params
from train.train import train_and_evaluate
from test_run_config import OLD_CONFIG, as_old_layout

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMOKE = str(ROOT / "experiments" / "default.py") + ":smoke"
QUIET = {"train.bleu_every": 0, "train.progress": False, "train.tensorboard": False,
         "train.eval_every": 0, "train.dev_sentences": 32, "train.test_sentences": 16}


def smoke_config(**overrides):
  return experiments.apply_overrides(experiments.load_experiment(SMOKE), {**QUIET, **overrides})


@pytest.fixture(scope="module")
def averaged_run(tmp_path_factory):
  """(workdir, config, outcome, the log records at WARNING and above) of one 4-step smoke run that
  checkpoints every step (keeping 3: steps 2, 3, 4), writes step checkpoints for averaging every 2 steps
  (steps 2 and 4), averages those, logs every step and scores the test BLEU of both: the run every test
  below that only reads a finished run shares."""
  workdir = tmp_path_factory.mktemp("averaged")
  config = smoke_config(**{"train.num_steps": 4, "train.checkpoint_every_steps": 1, "train.log_every": 1,
                           "train.keep_checkpoints": 3, "train.average_last": 2,
                           "train.average_every_steps": 2, "data.pack": False})
  records = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = records.append
  logging.getLogger().addHandler(handler)
  try:
    outcome = train_and_evaluate(config, workdir)
  finally:
    logging.getLogger().removeHandler(handler)
  return workdir, config, outcome, records


def test_average_last_writes_the_average_and_scores_both(averaged_run):
  workdir, _, outcome, records = averaged_run
  # Reading the average back (read-only, for its test BLEU) is not worth a library warning.
  assert not [r.getMessage() for r in records if "read only" in r.getMessage() or "read_only" in r.getMessage()]
  # Exactly the step checkpoints 2 apart, never step 3 of the other set (standing for a wall-clock or
  # preemption save), which is there too.
  assert outcome.averaged_steps == [2, 4]
  assert _steps(workdir, ckpt.CHECKPOINTS) == [2, 3, 4] and _steps(workdir, ckpt.TO_AVERAGE) == [2, 4]
  assert ckpt.read_meta(workdir, 4, directory=ckpt.TO_AVERAGE)["to_average"] == 2   # marked
  assert outcome.test_bleu is not None and outcome.test_bleu_averaged is not None
  averaged, step = ckpt.load_params(workdir, "averaged")
  expected = average_params([ckpt.load_params(workdir, s, directory=ckpt.TO_AVERAGE)[0] for s in (2, 4)])
  for a, b in zip(jax.tree_util.tree_leaves(ckpt.load_params(workdir, 4)[0]),
                  jax.tree_util.tree_leaves(ckpt.load_params(workdir, 4, directory=ckpt.TO_AVERAGE)[0])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))   # the same step's parameters in both sets
  for a, b in zip(jax.tree_util.tree_leaves(averaged), jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  test_lines = [line for line in metrics_io.read_metrics(workdir) if "test/bleu_averaged" in line]
  assert len(test_lines) == 1 and test_lines[0]["step"] == 4


def _steps(workdir, directory):
  return sorted(int(p.name) for p in (workdir / directory).iterdir() if p.name.isdigit())


def test_averaging_more_step_checkpoints_than_exist_is_refused_naming_them(averaged_run, capsys):
  from run.user_errors import UserError
  from train import average
  workdir = averaged_run[0]
  with pytest.raises(SystemExit) as exit_info:
    average.main(["--workdir", str(workdir), "--last", "3"])
  err = capsys.readouterr().err.strip()
  assert exit_info.value.code == 2 and len(err.splitlines()) == 1
  assert "last 3" in err and "holds only 2 step checkpoints" in err and "steps [2, 4]" in err
  assert "--allow_fewer" in err
  # The end of training refuses alike, naming the config key that allows it.
  with pytest.raises(UserError, match=r"steps \[2, 4\].*config.train.average_allow_fewer=True"):
    average.average_and_test(run.RunDir(workdir), 3, None, metrics_io.NoMetrics(), 4)
  # Asked for: the two there are (a copy of the run: the shared one's average stays as it was).
  copy_dir = workdir.parent / "allow_fewer"
  shutil.copytree(workdir, copy_dir)
  assert average.average_checkpoints(copy_dir, 3, allow_fewer=True)[1] == [2, 4]


def test_a_resumed_run_keeps_only_the_step_checkpoints_of_its_spacing_before_its_step(tmp_path):
  """Past the resumed step: written again from the resumed state; off the spacing counted back from
  num_steps (num_steps changed): dropped, so that no average mixes two spacings."""
  from train.train import _StepCheckpoints, _written_sets
  params = {"w": np.ones(3, np.float32)}

  def reopen(num_steps, start_step):
    manager = ckpt.make_manager(tmp_path, directory=ckpt.TO_AVERAGE, async_save=False)
    for step in (2, 4, 6):
      if step not in manager.all_steps():
        ckpt.save(manager, step, params, None, {"step": step})
    manager.close()
    tc = smoke_config(**{"train.num_steps": num_steps, "train.average_every_steps": 2,
                         "train.average_last": 3}).train
    with run.RunDir(tmp_path, write=_written_sets(tc)) as opened:
      _StepCheckpoints.open(opened, tc, start_step)
    return _steps(tmp_path, ckpt.TO_AVERAGE)

  assert reopen(num_steps=8, start_step=5) == [2, 4]    # 6 is past the resumed step 5
  assert reopen(num_steps=9, start_step=6) == []        # 9, 7, 5, ... is the spacing now: 2, 4, 6 are off it
  assert reopen(num_steps=10, start_step=6) == [2, 4, 6]


def test_a_run_that_cannot_write_enough_step_checkpoints_is_refused_before_training(tmp_path):
  config = smoke_config(**{"train.num_steps": 7, "train.average_every_steps": 2, "train.average_last": 5})
  with pytest.raises(ValueError, match=r"average_last=5 checkpoints 2 steps apart need more than 8 steps; "
                                       r"config.train.num_steps=7 writes 4"):
    train_and_evaluate(config, tmp_path)
  assert not (tmp_path / ckpt.CHECKPOINTS).exists() or not _steps(tmp_path, ckpt.CHECKPOINTS)


def test_average_last_needs_that_many_checkpoints_kept(tmp_path):
  config = smoke_config(**{"train.keep_checkpoints": 2, "train.average_last": 5})
  with pytest.raises(ValueError, match="average_last=5.*keep_checkpoints=2"):
    train_and_evaluate(config, tmp_path)


def test_early_stopping_stops_when_dev_loss_stalls_and_stays_stopped(tmp_path, capsys):
  # A zero learning rate: the dev loss never improves after the first eval.
  config = smoke_config(**{"train.num_steps": 8, "train.eval_every": 1, "train.early_stop_evals": 2,
                           "train.learning_rate": 0.0, "train.test_bleu": False,
                           "train.checkpoint_every_steps": 0})
  outcome = train_and_evaluate(config, tmp_path)
  assert outcome.stopped_early and outcome.step == 3
  assert "[train] early stopping: stopped at step 3; the best dev loss" in capsys.readouterr().out
  again = train_and_evaluate(config, tmp_path)     # rerunning a stopped run reports, does not train on
  assert again.stopped_early and again.step == 3


def test_a_run_that_trained_all_its_steps_does_not_speak_of_early_stopping():
  from train.evaluation import best_step_line
  from train.train import Outcome
  path = pathlib.Path("RUN/checkpoints/1190")
  finished = best_step_line(Outcome("RUN", 1500, best_step=1190), 2.5, path)
  assert "early stopping" not in finished and finished.startswith("[train] trained all 1500 steps")
  assert "step 1190" in finished and str(path) in finished
  stopped = best_step_line(Outcome("RUN", 1300, stopped_early=True, best_step=1190), 2.5, path)
  assert stopped.startswith("[train] early stopping: stopped at step 1300") and "step 1190" in stopped


def test_metrics_report_real_source_and_target_tokens_per_batch(averaged_run):
  workdir, config, _, _ = averaged_run   # unpacked batches: padding that must not be counted
  lines = [line for line in metrics_io.read_metrics(workdir) if "train/loss" in line]
  assert len(lines) == 4
  vocab = get_vocab(config.data, workdir)
  it = make_train_iterator(config.data, vocab, seed=config.seed, row_multiple=8)
  for line in lines:
    batch = next(it)
    assert line["train/src_tokens_per_batch"] == (batch["src_segments"] != 0).sum()
    assert line["train/tgt_tokens_per_batch"] == (batch["tgt_segments"] != 0).sum()
    assert line["train/tgt_slots_per_batch"] == batch["tgt_segments"].size   # the nominal, padding in
    assert (batch["tgt_segments"] != 0).sum() < batch["tgt_segments"].size   # padding is not counted


def test_init_checkpoint_starts_from_another_runs_parameters_and_refuses_another_architecture(
    averaged_run, tmp_path, monkeypatch):
  """config.train.init_checkpoint="RUN:STEP": the parameters are that run's (with a learning rate of 0 they
  stay so), the step and optimizer start afresh; parameters of another shape are refused by name. Each
  run's checkpoints are opened once (the run fine-tuned from and the run fine-tuned)."""
  from run.user_errors import UserError
  from test_run_dir import count_managers
  source = averaged_run[0]
  frozen = smoke_config(**{"train.num_steps": 1, "train.test_bleu": False, "train.learning_rate": 0.0,
                           "train.init_checkpoint": f"{source}:3"})   # not the newest (4)
  opened = count_managers(monkeypatch)
  assert train_and_evaluate(frozen, tmp_path / "b").step == 1
  assert opened == {source / ckpt.CHECKPOINTS: 1, tmp_path / "b" / ckpt.CHECKPOINTS: 1}
  for a, b in zip(jax.tree_util.tree_leaves(ckpt.load_params(source, 3)[0]),
                  jax.tree_util.tree_leaves(ckpt.load_params(tmp_path / "b")[0])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  other = smoke_config(**{"train.num_steps": 1, "train.test_bleu": False, "model.d_ff": 48,
                          "train.init_checkpoint": str(source)})
  with pytest.raises(UserError, match="do not match config.model"):
    train_and_evaluate(other, tmp_path / "c")


def test_a_run_directory_of_the_old_config_layout_decodes_and_resumes(averaged_run, tmp_path):
  """A run written before config.json had a compute section (tests/data/config_before_compute.json is one):
  run.load_run opens it for decoding, and training resumes from its newest checkpoint and rewrites its
  config.json in today's layout."""
  old_run = tmp_path / "old"
  shutil.copytree(averaged_run[0], old_run)
  config_path = old_run / "config.json"
  old = as_old_layout(json.loads(config_path.read_text()))
  committed = set(json.loads(OLD_CONFIG.read_text())["model"])   # the committed one's keys and layout
  assert committed <= set(old["model"])
  old["model"] = {key: value for key, value in old["model"].items() if key in committed}
  config_path.write_text(json.dumps(old, indent=2))

  opened = run.load_run(old_run)
  assert opened.step == 4 and opened.config.compute.kernels == "auto"
  assert translate(opened.model, opened.params, opened.vocab, ["the cat ."], beam_size=2, max_extra_len=3)
  _, config, _, _ = averaged_run
  resumed = experiments.apply_overrides(copy.deepcopy(config), {"train.num_steps": 5, "train.average_last": 0,
                                                                "train.test_bleu": False})
  assert train_and_evaluate(resumed, old_run).step == 5
  assert ckpt.read_meta(old_run, 5)["data"]["index"] == ckpt.read_meta(old_run, 4)["data"]["index"] + 1
  assert json.loads(config_path.read_text())["compute"] == config.compute.to_dict()
