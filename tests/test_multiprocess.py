"""Training with real processes (jobs.launch on 127.0.0.1, gloo between them), not mocks.

Three smoke runs go at once (module fixture): 2 processes x 4 CPU devices, 1 process x 8 devices, and a
second 2 x 4 run whose whole process group is SIGKILLed after its checkpoint at step 4. Then:
- 2 x 4 trains like 1 x 8: the same batches and metrics, parameters equal up to float rounding, except the
  attention key biases (see test_two_processes_train_like_one);
- the killed run, rerun, ends bitwise equal to the uninterrupted 2 x 4 run;
- a 2-process checkpoint restores in 1 process (training reports, decoding, averaging, export) and a
  1-process checkpoint in 2 processes, with the same test BLEU for the same parameters.
"""
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from run import checkpoint as ckpt
from run import metrics as metrics_io
from train.train import TIMING_KEYS
from files_config import clean_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMOKE = str(ROOT / "experiments" / "default.py") + ":smoke"
STEPS = 12
SETTINGS = {"train.num_steps": STEPS, "train.log_every": 2, "train.eval_every": 6, "train.bleu_every": 0,
            "train.checkpoint_every_steps": 2, "train.checkpoint_every_minutes": 0, "train.progress": False,
            "train.tensorboard": False, "train.dev_sentences": 32, "train.test_bleu": True,
            "train.test_sentences": 16, "decode.max_extra_len": 4}

pytestmark = pytest.mark.slow


def _env(devices: int | None = None) -> dict:
  """A clean environment: no XLA_FLAGS of the pytest process (which forces 8 devices)."""
  env = clean_env(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  if devices:
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
  return env


def start(workdir: pathlib.Path, processes: int, devices: int, **overrides) -> subprocess.Popen:
  """`python -m train` on the smoke experiment as `processes` x `devices`, in its own process group."""
  settings = {**SETTINGS, **overrides}
  flags = [f"--config={SMOKE}", f"--workdir={workdir}", *[f"--config.{k}={v}" for k, v in settings.items()]]
  if processes == 1:
    command, env = [sys.executable, "-m", "train", *flags], _env(devices)
  else:
    command = [sys.executable, "-m", "jobs.launch", "--processes", str(processes), "--devices_per_process",
               str(devices), "--", *flags]
    env = _env()
  return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)


def finish(process: subprocess.Popen, timeout: float = 600) -> str:
  try:
    out, _ = process.communicate(timeout=timeout)
  finally:
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
  assert process.returncode == 0, out[-3000:]
  return out


def comparable(workdir, test=True) -> list[dict]:
  return [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in metrics_io.read_metrics(workdir)
          if test or "test/bleu" not in line]


def params_of(workdir, step=None) -> dict:
  return ckpt.flat_leaves(jax.device_get(ckpt.load_params(workdir, step)[0]))


def test_bleu(workdir) -> float:
  return [line for line in metrics_io.read_metrics(workdir) if "test/bleu" in line][-1]["test/bleu"]


test_bleu.__test__ = False   # a helper, not a test


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  base = tmp_path_factory.mktemp("multiprocess")
  dirs = {name: base / name for name in ("two", "one", "killed")}
  no_bleu = {"train.test_bleu": False}   # the killed run: training and resuming only
  two, one, killed = start(dirs["two"], 2, 4), start(dirs["one"], 1, 8), start(dirs["killed"], 2, 4, **no_bleu)
  deadline = time.time() + 600
  while not (dirs["killed"] / "checkpoints" / "4").is_dir() and killed.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  if killed.poll() is None:
    os.killpg(killed.pid, signal.SIGKILL)   # the launcher and both trainers, mid-run
  out, _ = killed.communicate()
  assert killed.returncode == -signal.SIGKILL, f"the run ended before it could be killed:\n{out[-3000:]}"
  finish(two)
  finish(one)
  return dirs


def test_two_processes_train_like_one(runs):
  # The same batches, losses and norms (metrics are averaged on the host from float32 device values).
  two, one = comparable(runs["two"]), comparable(runs["one"])
  assert [line["step"] for line in two] == [line["step"] for line in one]
  for a, b in zip(two, one):
    assert a.keys() == b.keys()
    for key in a:
      if key == "test/signature":
        assert a[key] == b[key]
      elif key != "test/bleu":
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
  # Parameters: equal up to float rounding (gloo sums the gradients of the two processes in another
  # order than one process sums its 8 devices'), except the attention key biases: softmax ignores them,
  # so their true gradient is 0 and what is left is rounding noise of either sign, which Adam (eps 1e-9)
  # scales up to a full learning-rate step. They may differ by up to 2 x the summed learning rates.
  a, b = params_of(runs["two"]), params_of(runs["one"])
  assert a.keys() == b.keys()
  for key in a:
    if key.endswith("key/bias"):
      assert np.max(np.abs(a[key] - b[key])) <= 2 * STEPS * 2e-3
    else:
      np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_sigkill_then_rerun_equals_an_uninterrupted_run(runs):
  steps = sorted(int(p.name) for p in (runs["killed"] / "checkpoints").iterdir() if p.name.isdigit())
  assert 4 in steps and max(steps) < STEPS
  out = finish(start(runs["killed"], 2, 4, **{"train.test_bleu": False}))
  assert "resumed" in out
  assert comparable(runs["killed"]) == comparable(runs["two"], test=False)
  a, b = params_of(runs["killed"]), params_of(runs["two"])
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_checkpoints_move_between_one_and_two_processes(runs, tmp_path):
  # Finished runs rerun report again from their last checkpoint: the 2-process run in 1 process and the
  # 1-process run in 2 processes give the test BLEU their writers gave (the same parameters).
  two_in_one, one_in_two = tmp_path / "two_in_one", tmp_path / "one_in_two"
  shutil.copytree(runs["two"], two_in_one)
  shutil.copytree(runs["one"], one_in_two)
  first, second = start(two_in_one, 1, 8), start(one_in_two, 2, 4)
  assert "resumed" in finish(first) and "resumed" in finish(second)
  assert test_bleu(two_in_one) == test_bleu(runs["two"])
  assert test_bleu(one_in_two) == test_bleu(runs["one"])

  # A 2-process run's checkpoints in this (1) process: decode, average, export.
  import export
  import run
  from decode.translate import translate
  from train import average
  path, steps = average.average_checkpoints(two_in_one, last=3)
  assert steps == [STEPS - 4, STEPS - 2, STEPS]
  averaged = run.load_run(two_in_one, "averaged")
  hyps = translate(averaged.model, averaged.params, averaged.vocab, ["a small test .", "the cat"],
                   beam_size=2, max_extra_len=4)
  assert len(hyps) == 2 and all(isinstance(h, str) for h in hyps)
  assert ckpt.flat_leaves(jax.device_get(averaged.params)).keys() == params_of(two_in_one).keys()
  pytest.importorskip("ctranslate2")
  out = export.export_run(two_in_one, "ctranslate2", tmp_path / "ct2")
  assert (out / "model.bin").is_file()
