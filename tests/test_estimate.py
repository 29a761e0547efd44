"""train/estimate.py and `--estimate` on python -m train, jobs.submit and jobs.sweep: a run's steps, tokens
and projected hours from the measured step times, printed before anything starts."""
import os
import pathlib

import pytest

import experiments
# Imported at collection: a first import of submitit (jobs/slurm.py) reconfigures logging, which closes
# absl's handler's stream, inside a test whose stderr is captured pytest's own.
from jobs import slurm as jobs_slurm
from jobs import sweep as jobs_sweep
from train import estimate, flops

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMOKE = "experiments/default.py:smoke"


def _config(spec="experiments/wmt14_ende.py:base", **overrides):
  config = experiments.load_experiment(str(ROOT / spec.split(":")[0]) + ":" + spec.split(":")[1], platform="gpu")
  experiments.apply_overrides(config, [f"{k}={v}" for k, v in overrides.items()])
  return config


@pytest.mark.parametrize("spec", ["experiments/wmt14_ende.py:base", "experiments/wmt14_ende.py:big"])
def test_on_the_measured_device_a_step_takes_what_the_measured_line_gives(spec):
  """Scaled to the measured model's FLOPs per token, the projection is the line through the measured
  step times at the same tokens per device (1 and 8 devices)."""
  config = _config(spec)
  per_token = estimate.flops_per_token(config)
  name, line = estimate.reference(per_token)
  assert name == spec.rsplit(":", 1)[1]
  for devices in (1, 8):
    row = estimate.project(config, devices, estimate.MEASURED_ON[0])
    tokens = int(config.data.batch_tokens) / devices
    assert row.step_s * line.flops_per_token / per_token == pytest.approx(line.fixed_s + line.per_1k_s * tokens / 1000)
    assert row.hours == pytest.approx(row.step_s * int(config.train.num_steps) / 3600)
    assert row.device_hours == pytest.approx(row.hours * devices)


def test_other_devices_scale_by_their_peak_in_the_runs_precision():
  config = _config()
  h200, v100, a100 = (estimate.project(config, 8, kind) for kind in
                      ("NVIDIA H200", "Tesla V100-SXM2-32GB", "NVIDIA A100-SXM4-80GB"))
  assert flops.compute_dtype(estimate._model(config)) == "bfloat16"
  assert v100.step_s / h200.step_s == pytest.approx(989e12 / 15.7e12)   # a V100 computes bfloat16 in float32
  assert a100.step_s / h200.step_s == pytest.approx(989e12 / 312e12)
  assert estimate.project(config, 8, "Some Future Chip") is None


def test_accumulation_splits_a_step_into_smaller_micro_steps():
  one, two = _config(), _config(**{"train.grad_accum_steps": 2})
  a, b = (estimate.project(c, 1, "NVIDIA H200") for c in (one, two))
  # The same tokens in two micro-steps of half the size: each pays the fixed cost, so slower, under 2x.
  assert a.step_s < b.step_s < 2 * a.step_s


def test_python_m_train_estimate_prints_the_run_and_starts_nothing(tmp_path, capsys):
  from train.__main__ import main
  workdir = tmp_path / "run"
  main([f"--config={SMOKE}", f"--workdir={workdir}", "--config.train.num_steps=1234", "--estimate"])
  out = capsys.readouterr().out
  config = experiments.load_experiment(SMOKE)
  tokens = 1234 * int(config.data.batch_tokens)
  assert f"1,234 steps x {int(config.data.batch_tokens):,} tokens a step" in out and f"= {tokens:,} tokens" in out
  assert "NVIDIA H200" in out and "device-hours" in out and "Tesla V100-SXM2-32GB" in out
  assert not workdir.exists()


def _fake_sbatch(tmp_path, monkeypatch) -> pathlib.Path:
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/sbatch.log\necho "Submitted batch job 1"\n')
  (bin_dir / "sbatch").chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  return tmp_path / "sbatch.log"


def test_jobs_submit_estimate_projects_the_jobs_gpus_and_submits_nothing(tmp_path, monkeypatch, capsys):
  sbatch = _fake_sbatch(tmp_path, monkeypatch)
  workdir = tmp_path / "run"
  assert jobs_slurm.main(["--nodes", "2", "--gpus_per_node", "8", "--estimate", "--", f"--config={SMOKE}",
               f"--workdir={workdir}"]) == 0
  out = capsys.readouterr().out
  assert "on 16 devices" in out and "NVIDIA A100-SXM4-80GB" in out and "TPU v4" not in out
  assert not sbatch.exists() and not workdir.exists()


def test_jobs_sweep_estimate_lists_each_trial_and_starts_none(tmp_path, capsys):
  spec = str(ROOT / "experiments/table3.py") + ":smoke"
  trials = [t.name for t in jobs_sweep.declared_trials(spec)[0]]
  assert jobs_sweep.main([f"--config={spec}", f"--workdir={tmp_path / 'sweep'}", "--only", ",".join(trials[:2]),
               "--estimate"]) == 0
  out = capsys.readouterr().out
  assert [line.split()[2].rstrip(":") for line in out.splitlines() if line.startswith("[estimate] trial")] == trials[:2]
  assert "2 trials on 1 device each" in out and "hours, in turn" in out
  assert not (tmp_path / "sweep").exists()
