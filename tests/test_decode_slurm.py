"""`python -m decode --launcher slurm`: a job of 2 tasks on a real SLURM (scripts/slurm_local.sh starts a
one-node cluster) writes the output one local worker writes. Skipped, with the reason, where no SLURM
controller answers."""
import os
import pathlib
import subprocess

import pytest

from decode import job as job_lib
from test_bulk_decode import _command, _env, long_source, uninterrupted  # noqa: F401 - module fixtures
from test_slurm import slurm_up  # noqa: F401 - skips where no SLURM controller answers
from test_translate import corpus, model_and_params, run, vocab  # noqa: F401 - module fixtures

ROOT = pathlib.Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.slow


def test_a_two_task_slurm_job_writes_the_output_of_one_local_worker(run, long_source, tmp_path,  # noqa: F811
                                                                   uninterrupted):
  out = tmp_path / "hyp.txt"
  done = subprocess.run(_command(run, long_source, out, "--shard_lines", "4", "--launcher", "slurm",
                                 "--processes", "2", "--partition", "debug", "--time", "10"),
                        env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr
  assert "submitted SLURM job" in done.stderr and "60 lines translated" in done.stderr
  assert out.read_bytes() == uninterrupted
  logs = list((job_lib.job_dir(out) / "slurm").glob("*_log.err"))
  assert len(logs) == 2, sorted(os.listdir(job_lib.job_dir(out) / "slurm"))
