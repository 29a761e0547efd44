"""`python -m decode --launcher slurm`: the workers of a bulk decoding job as the tasks of one SLURM job,
submitted with submitit.

Each task runs the same `python -m decode ... --worker` command that a local worker runs; the tasks
share nothing but the job directory beside the output (a filesystem every node sees), where they claim
parts (decode/job.py). A task that dies, or a node that goes away, leaves its part to the others once its
claim goes stale; resubmitting the same command finishes what is left. submitit's files and every
task's output: OUTPUT.parts/slurm/.

This is decode's own small launcher rather than training's (jobs/ sits above decode/ in the import
order): a decoding task needs no requeue on preemption, because a part is the unit of work and the
next job takes up the unfinished ones.
"""
from __future__ import annotations

import dataclasses
import pathlib
import subprocess

import submitit

from run import devices

FOLDER = "slurm"


@dataclasses.dataclass(frozen=True)
class DecodeTask:
  """What each task runs: the worker command, in a directory; fails if the command does."""
  command: tuple
  cwd: str

  def __call__(self) -> int:
    done = subprocess.run(list(self.command), cwd=self.cwd, check=False)
    if done.returncode != 0:
      raise RuntimeError(f"{' '.join(self.command)} exited with {done.returncode}")
    return 0


def submit(command: list[str], job_directory, *, tasks: int, partition: str | None, time_minutes: int,
           cpus_per_task: int | None, gpus_per_task: int, sbatch: list[str]) -> submitit.Job:
  """Submits one SLURM job of `tasks` tasks, each running `command`; returns submitit's handle."""
  folder = pathlib.Path(job_directory) / FOLDER
  folder.mkdir(parents=True, exist_ok=True)
  executor = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=0)
  extra = {}
  for option in sbatch:
    key, sep, value = option.partition("=")
    extra[key.replace("-", "_")] = value if sep else True
  parameters = dict(job_name="decode", ntasks_per_node=tasks, nodes=1, time=time_minutes,
                    additional_parameters=extra)
  if partition:
    parameters["partition"] = partition
  # None: the default of training's jobs (run/devices.py), from the GPUs each task drives
  parameters["cpus_per_task"] = cpus_per_task or devices.default_cpus_per_task(gpus_per_task)
  if gpus_per_task:
    parameters["gpus_per_task"] = gpus_per_task
  executor.update_parameters(**parameters)
  return executor.submit(DecodeTask(tuple(command), str(pathlib.Path.cwd())))
