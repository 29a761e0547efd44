"""`python -m decode --launcher slurm`: the workers of a bulk decoding job as the tasks of one SLURM job,
submitted with submitit.

The job has --processes tasks spread over --nodes nodes; with --gpus_per_task G each task gets G GPUs of
its own (SLURM binds them; where a cluster shows a task every GPU of its node, the task keeps its own G
by SLURM_LOCALID: decode/devices.py's pin_slurm_task), so one task per GPU is `--gpus_per_task 1
--processes NODES*GPUS_PER_NODE --nodes NODES`.

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
CPUS_PER_TASK = 4   # --cpus_per_task's default for a CPU task: 4 CPU devices


def default_cpus_per_task(gpus_per_task: int) -> int:
  """--cpus_per_task's default: training's for a task with GPUs (run/devices.py), else CPUS_PER_TASK."""
  return devices.default_cpus_per_task(gpus_per_task) if gpus_per_task else CPUS_PER_TASK


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


def submit(command: list[str], job_directory, *, nodes: int = 1, tasks_per_node: int, partition: str | None,
           time_minutes: int, cpus_per_task: int | None = None, gpus_per_task: int,
           sbatch: list[str]) -> submitit.Job:
  """Submits one SLURM job of `tasks_per_node` tasks on each of `nodes` nodes, each task running
  `command` with `cpus_per_task` CPUs and `gpus_per_task` GPUs of its own; returns submitit's handle."""
  folder = pathlib.Path(job_directory) / FOLDER
  folder.mkdir(parents=True, exist_ok=True)
  executor = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=0)
  parameters = dict(job_name="decode", nodes=nodes, ntasks_per_node=tasks_per_node, time=time_minutes,
                    **devices.slurm_parameters(cpus_per_task or default_cpus_per_task(gpus_per_task), sbatch))
  if partition:
    parameters["partition"] = partition
  if gpus_per_task:
    parameters["gpus_per_task"] = gpus_per_task
  executor.update_parameters(**parameters)
  return executor.submit(DecodeTask(tuple(command), str(pathlib.Path.cwd())))
