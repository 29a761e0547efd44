"""Mistakes caught before the queue (jobs/preflight.py), the CPUs and the save window the sbatch script asks
for (jobs/slurm.py), the same mistakes caught again on the node (run/devices.py), and a time limit's
signal that arrives during a dev evaluation (train/train.py, train/evaluation.py).

A fake `sbatch` first on PATH records every call and answers as SLURM does, so a refusal is seen to
submit nothing, and an accepted submission leaves the script submitit wrote for sbatch to read.
"""
import json
import logging
import os
import pathlib
import signal

import pytest

from decode import slurm as decode_slurm
from jobs import preflight, search, slurm, sweep
from run import checkpoint as ckpt
from run import config as config_io
from run import devices
from run import metrics as metrics_io
from train import evaluation
from train import step as step_lib
from train.train import TIMING_KEYS, train_and_evaluate
import experiments

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMOKE = f"{ROOT}/experiments/default.py:smoke"
WMT_SMOKE = f"{ROOT}/experiments/wmt14_ende.py:smoke"   # TFDS where config.data.tfds_data_dir is set
FAKE_SBATCH = """#!/bin/sh
echo "$@" >> "{log}"
echo "Submitted batch job 4242"
"""


@pytest.fixture
def sbatch(tmp_path, monkeypatch):
  """The file a fake sbatch, first on PATH, appends its arguments to (one call a line)."""
  bin_dir, log = tmp_path / "bin", tmp_path / "sbatch_calls.txt"
  bin_dir.mkdir()
  (bin_dir / "sbatch").write_text(FAKE_SBATCH.format(log=log))
  (bin_dir / "sbatch").chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  return log


def submit(*argv) -> int:
  return slurm.main(["--partition=debug", "--time=10", *argv])


def refused(capsys, call) -> str:
  """Runs call(), which must end with status 2; -> its one `error:` line."""
  with pytest.raises(SystemExit) as info:
    call()
  assert info.value.code == 2
  lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), lines
  return lines[0]


@pytest.mark.parametrize("flags, platforms, named", [
    (["--config.train.num_step=5"], None, "'num_steps'"),                      # a typo'd key
    (["--config=experiments/no_such_experiment.py"], None, "no_such_experiment.py"),
    ([f"--config={WMT_SMOKE}", "--config.data.tfds_data_dir=/nonexistent/tfds"], None,
     "config.data.tfds_data_dir='/nonexistent/tfds' is not a directory"),
    (["--config.data.source=files", "--config.data.train_path=/nonexistent/train.tsv"], None,
     "config.data.train_path: file '/nonexistent/train.tsv' does not exist"),
    (["--config.train.init_checkpoint=/nonexistent/run"], None, "no checkpoints in /nonexistent/run/checkpoints"),
    ([], "cpu", "JAX_PLATFORMS=cpu"),                                        # GPUs asked for, the CPU chosen
])
def test_submit_refuses_mistakes_before_sbatch(tmp_path, sbatch, capsys, monkeypatch, flags, platforms, named):
  if platforms:
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
  workdir = tmp_path / "run"
  line = refused(capsys, lambda: submit("--gpus_per_node=8", "--", f"--config={SMOKE}", f"--workdir={workdir}",
                                        *flags))
  assert named in line, line
  assert not sbatch.exists() and not (workdir / slurm.JOB_FILE).exists()


def test_submit_asks_srun_for_the_cpus_and_slurm_for_the_save_window(tmp_path, sbatch, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  workdir = tmp_path / "run"
  assert submit("--cpus_per_task=3", "--save_window=200", "--",
                f"--config={SMOKE}", f"--workdir={workdir}", "--config.train.num_steps=5") == 0
  (call,) = sbatch.read_text().splitlines()   # the control: a sound submission reaches sbatch, once
  assert (workdir / slurm.JOB_FILE).read_text().strip() == "4242"
  script = pathlib.Path(call.split()[-1])
  script = script if script.exists() else workdir / slurm.FOLDER / "4242_submission.sh"
  text = script.read_text()
  assert "#SBATCH --cpus-per-task=3" in text and "#SBATCH --signal=USR2@200" in text, text
  assert "export SRUN_CPUS_PER_TASK=3" in text, text   # srun of Slurm 22.05-23.02 reads this, not the job's
  (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
  assert "--cpus-per-task=3" in srun.split(), srun


def test_the_save_window_must_fit_the_time_limit(sbatch, capsys):
  with pytest.raises(SystemExit):
    submit("--time=2", "--save_window=120", "--", f"--config={SMOKE}", "--workdir=/tmp/never")
  assert "--save_window 120 s leaves nothing of --time 2 minutes" in capsys.readouterr().err
  assert not sbatch.exists()


def test_a_run_directory_trained_with_other_settings_is_refused(tmp_path, sbatch, capsys):
  workdir = tmp_path / "run"
  old = experiments.load_experiment(SMOKE)
  experiments.apply_overrides(old, {"model.d_model": 64})
  workdir.mkdir()
  config_io.save_config(old, workdir)
  (workdir / "checkpoints" / "2").mkdir(parents=True)   # it has trained: the model cannot change
  line = refused(capsys, lambda: submit("--", f"--config={SMOKE}", f"--workdir={workdir}"))
  assert "model.d_model: 64 -> 32" in line and "config.json" in line, line
  assert not sbatch.exists()
  # Without checkpoints the run directory takes any settings (the trainer starts it afresh).
  (workdir / "checkpoints" / "2").rmdir()
  assert preflight.check_train_flags([f"--config={SMOKE}", f"--workdir={workdir}"],
                                     slurm.SlurmOptions()) == workdir


def test_flags_that_are_not_the_trainers_are_refused(tmp_path):
  with pytest.raises(preflight.UserError, match=r"\['--workdri=x'\] are not python -m train's"):
    preflight.train_config([f"--config={SMOKE}", "--workdri=x"], "cpu")
  config, workdir = preflight.train_config([f"--config={SMOKE}", "--distributed", "on", "--check_devices",
                                            "--config.train.num_steps=7"], "cpu")
  assert config.train.num_steps == 7 and workdir == pathlib.Path(config.workdir)


def test_sweep_and_search_refuse_before_any_job(tmp_path, sbatch, capsys, monkeypatch):
  missing = ["--config.data.source=files", "--config.data.train_path=/nonexistent/train.tsv"]
  line = refused(capsys, lambda: sweep.main([f"--config={ROOT}/experiments/table3.py:smoke",
                                             f"--workdir={tmp_path / 'sweep'}", "--launcher=slurm", *missing]))
  assert "config.data.train_path: file '/nonexistent/train.tsv' does not exist" in line, line
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  line = refused(capsys, lambda: search.main([f"--config={SMOKE}", f"--workdir={tmp_path / 'study'}",
                                              "--trials=2", "--launcher=slurm", "--gpus_per_node=1"]))
  assert "--gpus_per_node 1 asks for GPUs, but JAX_PLATFORMS=cpu" in line, line
  assert not sbatch.exists()


# --- on the node (run/devices.py) -------------------------------------------------------------------------

def slurm_task(**more) -> dict:
  env = dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="gpu01", SLURM_NTASKS="1", SLURM_PROCID="0",
             SLURM_LOCALID="0", SLURM_NTASKS_PER_NODE="1")
  return {**env, **more}


def test_gpus_given_by_slurm_but_left_out_by_jax_platforms_stop_the_run():
  layout = devices.plan(slurm_task(SLURM_GPUS_ON_NODE="8", JAX_PLATFORMS="cpu"), driver_dir="/nonexistent")
  assert "SLURM gave this job 8 GPUs on the node (SLURM_GPUS_ON_NODE=8)" in layout.problem
  assert "JAX_PLATFORMS=cpu leaves GPUs out" in layout.problem
  (problem,) = devices.mismatches([devices.record(layout, 0, 1, "cpu")])   # what stops the trainer
  assert "JAX_PLATFORMS=cpu" in problem
  only_cuda = devices.plan(slurm_task(CUDA_VISIBLE_DEVICES="0,1", JAX_PLATFORMS="cpu"), driver_dir="/nonexistent")
  assert "(CUDA_VISIBLE_DEVICES=0,1)" in only_cuda.problem
  # A CPU job (no GPUs allocated), or a platform list that keeps the GPUs: no problem.
  assert devices.plan(slurm_task(JAX_PLATFORMS="cpu"), driver_dir="/nonexistent").problem is None
  assert devices.plan(slurm_task(SLURM_GPUS_ON_NODE="8", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7",
                                 JAX_PLATFORMS="cuda,cpu"), driver_dir="/nonexistent").problem is None


def test_cpus_other_than_the_job_asked_for_are_named_in_one_line(monkeypatch):
  line = devices.cpu_problem({"SLURM_CPUS_PER_TASK": "4"}, usable=1)
  assert "may use 1 CPU (its affinity), but the job asked for 4 per task (SLURM_CPUS_PER_TASK=4)" in line
  assert "\n" not in line and "srun" in line
  assert devices.cpu_problem({"SLURM_CPUS_PER_TASK": "4"}, usable=4) is None
  assert devices.cpu_problem({}, usable=1) is None   # not a SLURM job: nothing asked
  # At start (record: once per process), from the process's own affinity.
  monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
  records, handler = [], logging.Handler(logging.WARNING)
  handler.emit = records.append
  logging.getLogger("run.devices").addHandler(handler)
  try:
    devices.record(devices.Layout("slurm"), 0, 1, "cpu")
  finally:
    logging.getLogger("run.devices").removeHandler(handler)
  (warning,) = [r.getMessage() for r in records]
  assert "may use 1 CPU" in warning and "SLURM_CPUS_PER_TASK=4" in warning


# --- time limits: a signal during a dev evaluation (train/evaluation.py) ------------------------------------

@pytest.mark.slow   # four short smoke runs: ~20 s
def test_a_signal_during_a_dev_evaluation_cuts_it_short_and_the_resumed_run_does_it(tmp_path, monkeypatch):
  """SIGTERM (SLURM's time limit, passed on by task 0) during the dev loss, then during the dev BLEU: each
  cuts its evaluation short, the step is saved owing it, and the rerun (what the requeued job runs) does
  that evaluation first; the dev metrics and early stopping then equal an uninterrupted run's."""
  real_eval, real_translate, calls, translated, signal_at = step_lib.jit_eval_step, evaluation.translate, [], [], []

  def signalling_eval_step(*args, **kwargs):
    compiled = real_eval(*args, **kwargs)

    def eval_step(params, batch):
      calls.append(1)
      if len(calls) in signal_at:
        os.kill(os.getpid(), signal.SIGTERM)
      return compiled(params, batch)
    return eval_step

  def signalling_translate(*args, **kwargs):
    translated.append(1)
    if -len(translated) in signal_at:
      os.kill(os.getpid(), signal.SIGTERM)
    return real_translate(*args, **kwargs)

  monkeypatch.setattr(step_lib, "jit_eval_step", signalling_eval_step)
  monkeypatch.setattr(evaluation, "translate", signalling_translate)
  monkeypatch.setattr(evaluation, "BLEU_CHUNK", 16)   # the 64 dev sentences in 4 chunks
  config = experiments.apply_overrides(experiments.load_experiment(SMOKE), {
      "train.num_steps": 6, "train.eval_every": 2, "train.bleu_every": 4, "train.log_every": 1,
      "train.early_stop_evals": 3, "train.checkpoint_every_steps": 0, "train.checkpoint_every_minutes": 0.0,
      "train.test_bleu": False, "train.progress": False, "train.tensorboard": False})
  whole, workdir = tmp_path / "whole", tmp_path / "run"
  dev_lines = lambda run: [{k: v for k, v in line.items() if k not in TIMING_KEYS}
                           for line in metrics_io.read_metrics(run) if "eval/loss" in line]
  evals = lambda: [line["step"] for line in dev_lines(workdir)]
  saved = lambda: sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  uninterrupted = train_and_evaluate(config, whole)
  assert [line["step"] for line in dev_lines(whole)] == [2, 4, 6] and "eval/bleu" in dev_lines(whole)[1]
  # During the dev loss at step 2, after its 2nd batch.
  signal_at[:], calls[:], translated[:] = [2], [], []
  outcome = train_and_evaluate(config, workdir)
  assert (outcome.interrupted, outcome.step, len(calls), saved(), evals()) == ("SIGTERM", 2, 2, [2], [])
  assert ckpt.read_meta(workdir, 2)["eval_owed"] is True
  # Resumed: step 2's evaluation first, whole; then during step 4's dev BLEU, in its first of 4 chunks.
  signal_at[:], calls[:] = [-1], []
  outcome = train_and_evaluate(config, workdir)
  assert (outcome.interrupted, outcome.step, len(translated), saved(), evals()) == ("SIGTERM", 4, 1, [2, 4], [2])
  assert len(calls) > 2, "step 2's dev loss, redone, has more batches than the 2 the cut evaluation ran"
  assert ckpt.read_meta(workdir, 2)["eval_owed"] is False and ckpt.read_meta(workdir, 4)["eval_owed"] is True
  # Resumed again: step 4's evaluation (loss and BLEU) first, then the rest as an uninterrupted run.
  signal_at[:] = []
  outcome = train_and_evaluate(config, workdir)
  assert (outcome.interrupted, outcome.step, evals()) == (None, 6, [2, 4, 6])
  assert dev_lines(workdir) == dev_lines(whole)
  early = lambda run: ckpt.read_meta(run, 6)["early_stop"]
  assert early(workdir) == early(whole) and early(whole)["best_step"] is not None
  assert (outcome.best_step, ckpt.best_step(workdir)) == (uninterrupted.best_step, ckpt.best_step(whole))


def test_bulk_decoding_jobs_ask_srun_for_the_cpus_too(tmp_path, sbatch, monkeypatch):
  """python -m decode --launcher slurm writes its own job (decode/slurm.py): its srun asks for the CPUs too."""
  monkeypatch.chdir(tmp_path)
  job = decode_slurm.submit(["true"], tmp_path / "job", tasks_per_node=2, partition="debug", time_minutes=5,
                            cpus_per_task=5, gpus_per_task=0, sbatch=["account=abc"])
  assert job.job_id == "4242" and len(sbatch.read_text().splitlines()) == 1
  text = (tmp_path / "job" / decode_slurm.FOLDER / "4242_submission.sh").read_text()
  assert "#SBATCH --cpus-per-task=5" in text and "#SBATCH --account=abc" in text, text
  assert "export SRUN_CPUS_PER_TASK=5" in text, text
  (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
  assert "--cpus-per-task=5" in srun.split(), srun
