"""Runs and sweeps through a real SLURM (scripts/slurm_local.sh starts a one-node cluster; CI runs it).

- a 2-trial smoke sweep with --launcher slurm: each trial a job, results table as with the local runner;
- a 2-task job (2 processes x 2 CPU devices) that is "preempted" with SIGUSR2 after its checkpoint at
  step 4 (what SLURM sends before a time limit): it saves, submitit requeues it, it resumes, and ends
  bitwise equal to the same training run by jobs.launch on this machine.
Skipped, with the reason, where no SLURM controller answers.
"""
import csv
import functools
import os
import pathlib
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from run import checkpoint as ckpt
from run import metrics as metrics_io
from jobs import slurm
from train.train import TIMING_KEYS
from files_config import xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMOKE = str(ROOT / "experiments" / "default.py") + ":smoke"


@functools.cache   # sinfo can take seconds to give up where no controller answers: ask once
def slurm_problem() -> str | None:
  if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
    return "SLURM is not installed (run: sudo bash scripts/slurm_local.sh)"
  try:
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.TimeoutExpired) as error:
    return f"sinfo failed: {error}"
  states = out.stdout.split()
  if out.returncode != 0 or not any(s.startswith(("idle", "mixed", "allocated")) for s in states):
    return f"no SLURM node is up (sinfo: {(out.stdout + out.stderr).strip()[:200]}); run scripts/slurm_local.sh"
  return None


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def slurm_up():
  """Skips, naming why, where no SLURM controller answers; asked when a test runs, not at collection, so that
  the default suite (which deselects these) never waits for sinfo."""
  problem = slurm_problem()
  if problem:
    pytest.skip(problem)


def _env(devices=2) -> dict:
  """The environment of the submitting command, which sbatch passes on to the jobs."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
  env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
  if xla_flags():   # the suite's instruction-set cap, if it has one
    env["XLA_FLAGS"] = xla_flags()
  return env


def _run(command, timeout=600):
  done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
  return done.returncode, done.stdout + done.stderr


def test_sweep_on_slurm(tmp_path):
  out = tmp_path / "table3"
  code, text = _run([sys.executable, "-m", "jobs.sweep", f"--config={ROOT}/experiments/table3.py:smoke",
                     f"--workdir={out}", "--launcher=slurm", "--partition=debug", "--time=15",
                     "--config.train.bleu_every=0", "--config.train.test_bleu=False"])
  assert code == 0, text
  rows = {r["trial"]: r for r in csv.DictReader(open(out / "results.csv"))}
  assert {name: r["status"] for name, r in rows.items()} == {"base": "done", "C_N2": "done"}, text
  for name, r in rows.items():
    assert int(r["steps"]) == 8 and 1.0 < float(r["dev_ppl"]) < 1000, r
    job = (out / name / slurm.JOB_FILE).read_text().strip()
    assert "submitted SLURM job" in (out / name / "sweep.log").read_text()
    assert slurm.task_log(out / name, job).is_file()
  # Rerunning the sweep submits nothing: both trials are done.
  code, text = _run([sys.executable, "-m", "jobs.sweep", f"--config={ROOT}/experiments/table3.py:smoke",
                     f"--workdir={out}", "--launcher=slurm", "--config.train.bleu_every=0",
                     "--config.train.test_bleu=False"])
  assert code == 0 and "skip base (done)" in text and "skip C_N2 (done)" in text, text


def test_two_task_job_preempted_requeued_and_resumed_exactly(tmp_path):
  steps = 30
  flags = [f"--config={SMOKE}", "--config.train.progress=False", "--config.train.tensorboard=False",
           "--config.train.test_bleu=False", "--config.train.bleu_every=0", "--config.train.eval_every=0",
           "--config.train.dev_sentences=32", f"--config.train.num_steps={steps}", "--config.train.log_every=2",
           "--config.train.checkpoint_every_steps=2", "--config.train.checkpoint_every_minutes=0"]
  local = subprocess.Popen([sys.executable, "-m", "jobs.launch", "--processes=2", "--devices_per_process=2",
                            "--", *flags, f"--workdir={tmp_path / 'local'}"], cwd=ROOT, env=_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  workdir = tmp_path / "slurm"
  code, text = _run([sys.executable, "-m", "jobs.submit", "--partition=debug", "--tasks_per_node=2",
                     "--time=15", "--", *flags, f"--workdir={workdir}"])
  assert code == 0, text
  job = (workdir / slurm.JOB_FILE).read_text().strip()
  deadline = time.time() + 400
  while not (workdir / "checkpoints" / "4").is_dir():
    assert slurm.alive(job) and time.time() < deadline, slurm.task_log(workdir, job).read_text()[-3000:]
    time.sleep(0.1)
  subprocess.run(["scancel", "--signal=USR2", job], check=True)   # what --signal=USR2@90 sends
  state = slurm.wait(job, poll_seconds=1, timeout=500)
  log = slurm.task_log(workdir, job).read_text()
  assert state == "COMPLETED", log[-3000:]
  assert "Requeued job" in log and "resumed" in log, log[-3000:]
  local_out, _ = local.communicate(timeout=300)
  assert local.returncode == 0, local_out[-3000:]

  lines = [l for l in metrics_io.read_metrics(workdir)]
  assert max(l["step"] for l in lines) == steps
  strip = lambda ls: [{k: v for k, v in l.items() if k not in TIMING_KEYS} for l in ls]
  assert strip(lines) == strip(metrics_io.read_metrics(tmp_path / "local"))
  a = ckpt.flat_leaves(jax.device_get(ckpt.load_params(workdir)[0]))
  b = ckpt.flat_leaves(jax.device_get(ckpt.load_params(tmp_path / "local")[0]))
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
