"""The training driver end to end on the embedded corpus with the smoke model: loss falls, exact resume
after SIGKILL, SIGTERM saves and exits, the non-finite guard, the run-directory lock, config overrides.
"""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import experiments
import run
from data import load_pairs
from decode.bleu import sacrebleu_score
from decode.translate import translate
from run import config as config_io, metrics as metrics_io, workdir as run_dir
from run import checkpoint as ckpt
from train.train import TIMING_KEYS, NonFiniteError, train_and_evaluate
from files_config import xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMOKE = str(ROOT / "experiments" / "default.py") + ":smoke"
# No BLEU, no progress bar, no TensorBoard, no periodic dev eval (the smoke config evaluates every 2 steps),
# and evals on 64 dev pairs.
QUIET = {"train.test_bleu": False, "train.bleu_every": 0, "train.progress": False,
         "train.tensorboard": False, "train.eval_every": 0, "train.dev_sentences": 64}


def smoke_config(**overrides):
  config = experiments.load_experiment(SMOKE)
  return experiments.apply_overrides(config, {**QUIET, **overrides})


def trainer(workdir, *overrides, devices=8):
  """Starts `python -m train` on the smoke experiment as a subprocess (its own 8 fake devices)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = xla_flags(f"--xla_force_host_platform_device_count={devices}")
  env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
  flags = [f"--config.{k}={v}" for k, v in QUIET.items()] + [f"--config.{o}" for o in overrides]
  command = [sys.executable, "-m", "train", f"--config={SMOKE}", f"--workdir={workdir}", *flags]
  return subprocess.Popen(command, cwd=workdir.parent, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def finish(process, timeout=600):   # a guard against a hang, not a speed limit
  try:
    out, _ = process.communicate(timeout=timeout)
  finally:
    if process.poll() is None:
      process.kill()
  return process.returncode, out


def comparable(lines):
  return [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in lines]


# ------------------------------------------------------------------------------------------------------
def test_loss_falls_on_the_embedded_corpus(tmp_path):
  config = smoke_config(**{"train.num_steps": 24, "train.log_every": 6, "train.eval_every": 12,
                           "train.checkpoint_every_steps": 12, "train.schedule": "inverse_sqrt",
                           "train.learning_rate": 1e-2, "train.tensorboard": True})
  outcome = train_and_evaluate(config, tmp_path)
  assert outcome.step == 24 and outcome.interrupted is None
  lines = metrics_io.read_metrics(tmp_path)
  train = [line for line in lines if "train/loss" in line]
  assert [line["step"] for line in train] == [6, 12, 18, 24]
  assert train[-1]["train/loss"] < 0.85 * train[0]["train/loss"], train
  evals = [line for line in lines if "eval/loss" in line]
  assert [line["step"] for line in evals] == [12, 24] and evals[1]["eval/loss"] < evals[0]["eval/loss"]
  for key in ("train/nll", "train/ppl", "train/accuracy", "train/learning_rate", "train/grad_norm",
              "train/param_norm", "train/tokens", "train/tokens_per_sec"):
    assert np.isfinite(train[-1][key]), key
  assert train[-1]["train/model_flops_per_step"] > 0 and 0 < train[-1]["train/mfu"] < 1   # train/flops.py
  # The run directory holds everything needed to decode and to resume.
  for name in ("config.json", "vocab.model", "versions.json", "LOCK", "metrics.jsonl"):
    assert (tmp_path / name).is_file(), name
  assert any((tmp_path / "tb").iterdir())
  assert config_io.load_run_config(tmp_path).train.num_steps == 24
  assert json.loads((tmp_path / "versions.json").read_text())["jax"]
  params, step = ckpt.load_params(tmp_path)
  assert step == 24
  # Rerunning the finished command resumes at the end and only evaluates.
  again = train_and_evaluate(config, tmp_path)
  assert again.step == 24 and again.eval["eval/loss"] == pytest.approx(outcome.eval["eval/loss"], rel=1e-6)
  # ... and rewrites its final report rather than adding a second copy of it.
  relines = metrics_io.read_metrics(tmp_path)
  assert [line["step"] for line in relines if "eval/loss" in line] == [12, 24]
  assert [line for line in relines if "train/loss" in line] == train


@pytest.mark.slow
def test_sigkill_then_rerun_equals_an_uninterrupted_run(tmp_path):
  settings = ["train.num_steps=30", "train.log_every=3", "train.eval_every=15",
              "train.checkpoint_every_steps=6", "train.checkpoint_every_minutes=0"]
  whole, killed = tmp_path / "whole", tmp_path / "killed"
  whole.mkdir()
  killed.mkdir()
  uninterrupted = trainer(whole, *settings)    # runs alongside the one we kill
  process = trainer(killed, *settings)
  deadline = time.time() + 600   # a guard against a hang, not a speed limit
  while not (killed / "checkpoints" / "12").is_dir() and process.poll() is None and time.time() < deadline:
    time.sleep(0.02)
  process.send_signal(signal.SIGKILL)
  code, out = finish(process)
  assert code == -signal.SIGKILL, f"the trainer finished before it could be killed:\n{out}"
  steps = sorted(int(p.name) for p in (killed / "checkpoints").iterdir() if p.name.isdigit())
  assert 12 in steps and max(steps) < 30
  code, out = finish(trainer(killed, *settings))
  assert code == 0, out
  assert "resumed" in out
  code, out = finish(uninterrupted)
  assert code == 0, out

  assert comparable(metrics_io.read_metrics(killed)) == comparable(metrics_io.read_metrics(whole))
  a, step_a = ckpt.load_params(whole)
  b, step_b = ckpt.load_params(killed)
  assert step_a == step_b == 30
  import jax
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  process = trainer(workdir, "train.num_steps=100000", "train.log_every=1",
                    "train.checkpoint_every_steps=0", "train.checkpoint_every_minutes=0")
  deadline = time.time() + 600   # a guard against a hang, not a speed limit
  metrics = workdir / "metrics.jsonl"
  while (not metrics.exists() or not metrics.read_text()) and process.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  process.send_signal(signal.SIGTERM)
  code, out = finish(process)
  assert code == 0, out
  assert "SIGTERM" in out
  params, step = ckpt.load_params(workdir)
  assert 1 <= step < 100000


def test_nonfinite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
  # A learning rate of 1e30 makes Adam's first update ~1e30 per weight: the next forward pass overflows.
  config = smoke_config(**{"train.num_steps": 10, "train.schedule": "inverse_sqrt", "train.warmup_steps": 1,
                           "train.learning_rate": 1e30, "train.checkpoint_every_steps": 1,
                           "train.log_every": 5})
  with pytest.raises(NonFiniteError, match=r"non-finite loss or gradient at step (\d+)") as info:
    train_and_evaluate(config, tmp_path)
  bad = int(re.search(r"at step (\d+)", str(info.value)).group(1))
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert saved and max(saved) <= bad, (saved, bad)   # checkpoint k holds the state after k good steps
  assert f"Last good checkpoint: {tmp_path / 'checkpoints' / str(max(saved))}" in str(info.value)


def test_a_second_trainer_is_refused(tmp_path):
  with run_dir.RunLock(tmp_path):
    with pytest.raises(run_dir.RunDirLocked, match="in use by another trainer"):
      train_and_evaluate(smoke_config(), tmp_path)


def test_overrides_and_misspelled_keys(tmp_path):
  config = smoke_config(**{"train.num_steps": "7", "model.d_model": 48})
  assert config.train.num_steps == 7 and config.model.d_model == 48
  with pytest.raises(KeyError, match="num_stepz"):
    smoke_config(**{"train.num_stepz": 3})
  config_io.save_config(config, tmp_path)
  assert config_io.load_run_config(tmp_path).to_dict() == config.to_dict()
  code, out = finish(trainer(tmp_path / "x", "train.num_stepz=3"), timeout=300)
  assert code != 0 and "num_stepz" in out


def test_dev_and_test_bleu_come_from_real_decoding(tmp_path):
  config = smoke_config(**{"train.num_steps": 3, "train.eval_every": 2, "train.bleu_every": 2,
                           "train.dev_sentences": 16, "train.test_bleu": True, "train.test_sentences": 16,
                           "train.num_samples": 2, "decode.max_extra_len": 4})
  outcome = train_and_evaluate(config, tmp_path / "run")
  lines = metrics_io.read_metrics(tmp_path / "run")
  bleu_lines = [line for line in lines if "eval/bleu" in line]
  assert [line["step"] for line in bleu_lines] == [2]
  test_lines = [line for line in lines if "test/bleu" in line]
  assert len(test_lines) == 1 and test_lines[0]["test/signature"].startswith("nrefs:1|case:mixed")
  assert test_lines[0]["test/bleu"] == outcome.test_bleu
  # The reported test BLEU is what `translate` gives on the run's final checkpoint, opened as a user would.
  opened = run.load_run(tmp_path / "run")
  assert opened.step == outcome.step == 3
  test_pairs = load_pairs(config.data, "test")[:16]
  hyps = translate(opened.model, opened.params, opened.vocab, [src for src, _ in test_pairs],
                   **opened.config.decode.to_dict())
  assert sacrebleu_score(hyps, [tgt for _, tgt in test_pairs])[0] == pytest.approx(outcome.test_bleu, abs=1e-9)
  assert len(outcome.samples) == 2 and all(isinstance(hyp, str) for _, _, hyp in outcome.samples)
  # Rerunning the finished run reports the same test BLEU again, in place of the old line.
  again = train_and_evaluate(config, tmp_path / "run")
  relines = metrics_io.read_metrics(tmp_path / "run")
  assert again.test_bleu == outcome.test_bleu
  assert [line for line in relines if "test/bleu" in line] == test_lines
  assert [line["step"] for line in relines if "eval/loss" in line] == [2, 3]
  assert [line for line in relines if "eval/bleu" in line] == bleu_lines
