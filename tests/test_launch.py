"""The multi-process plumbing that needs no second process: joining rules, the launcher's failure path,
the SLURM flags. (Real multi-process training: tests/test_multiprocess.py; real SLURM: tests/test_slurm.py.)"""
import argparse
import os
import pathlib
import subprocess
import sys

import pytest

from jobs import launch, slurm
from train import multihost

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_one_process_joins_nothing_and_a_half_manual_launch_is_refused(monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_STEP_NODELIST",
               "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(name, raising=False)
  assert multihost.initialize("auto") is False and multihost.initialize("off") is False
  with pytest.raises(ValueError, match=r"needs all three.*--num_processes"):
    multihost.initialize("auto", coordinator_address="127.0.0.1:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  with pytest.raises(ValueError, match=r"JAX_PROCESS_ID"):
    multihost.initialize("auto")
  with pytest.raises(ValueError, match=r"--distributed='sometimes'"):
    multihost.initialize("sometimes")
  assert multihost.map_split(lambda xs: [x * 2 for x in xs], [1, 2, 3]) == [2, 4, 6]


def test_launcher_environment_and_failure(tmp_path):
  env = launch.process_env(1, 2, 4321, 4, base={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:4321" and env["JAX_PROCESS_ID"] == "1"
  assert env["JAX_NUM_PROCESSES"] == "2" and env["JAX_NUM_CPU_DEVICES"] == "4" and "XLA_FLAGS" not in env
  # Both processes reject a misspelled key: the launcher prefixes their output and exits non-zero.
  clean = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
  done = subprocess.run([sys.executable, "-m", "jobs.launch", "--processes", "2", "--", "--config.train.num_stepz=3",
                         f"--workdir={tmp_path}"], cwd=ROOT, env={**clean, "PYTHONPATH": str(ROOT)},
                        capture_output=True, text=True, timeout=120)
  assert done.returncode != 0 and "[launch] failed" in done.stdout, done.stdout + done.stderr
  assert "[p0]" in done.stdout and "[p1]" in done.stdout and "num_stepz" in done.stdout


def test_slurm_flags():
  parser = argparse.ArgumentParser()
  slurm.add_flags(parser)
  args = parser.parse_args(["--partition", "gpu", "--nodes", "2", "--gpus_per_node", "8", "--time", "90",
                            "--sbatch", "account=abc", "--sbatch", "exclusive"])
  options = slurm.options_from(args)
  assert options.nodes == 2 and options.gpus_per_node == 8 and options.sbatch == ("account=abc", "exclusive")
  with pytest.raises(ValueError, match="--nodes must be >= 1"):
    slurm.options_from(parser.parse_args(["--nodes", "0"]))
  with pytest.raises(ValueError, match="--sbatch '--qos=high'"):
    slurm.options_from(parser.parse_args(["--sbatch=--qos=high"]))
