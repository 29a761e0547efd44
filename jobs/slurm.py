"""Training on SLURM through submitit: one run (`python -m jobs.submit`) or each trial of a sweep
(`python -m jobs.sweep --launcher slurm`) becomes a SLURM job.

    python -m jobs.submit --partition gpu --nodes 2 --tasks_per_node 1 --gpus_per_node 8 --time 1440 \\
        -- --config experiments/wmt14_ende.py:base --workdir runs/base

Every task of a job runs `python -m train FLAGS` (submitit starts one task per --tasks_per_node on each
node with srun); with more than one task, JAX recognises the SLURM job and the tasks train together
(train/multihost.py). SLURM does the queueing. Time limit and preemption: submitit asks SLURM for SIGUSR2
90 s before the end; task 0 then sends SIGTERM to its trainer, every process of the run saves the same
step, and submitit requeues the job, which resumes from that checkpoint exactly. A job that SLURM itself
stops with SIGTERM (preemption in REQUEUE mode) saves the same way and resumes when SLURM restarts it.
submitit's own logs and every task's output: WORKDIR/slurm/<job id>_<task>_log.{out,err}.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time

import submitit

from run import devices

FOLDER = "slurm"              # in the run directory: submitit's files and the tasks' logs
JOB_FILE = "slurm_job.txt"    # in the run directory: the id of the last job submitted for it
JOBS_FILE = "slurm_jobs.txt"  # in the run directory: every job submitted for it, one id a line
_ALIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
          "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "PREEMPTED")


@dataclasses.dataclass
class SlurmOptions:
  """What every job asks SLURM for."""
  partition: str | None = None
  nodes: int = 1
  tasks_per_node: int = 1
  gpus_per_node: int = 0
  cpus_per_task: int | None = None   # None: run.devices.default_cpus_per_task of the GPUs per task
  time_minutes: int = 60
  sbatch: tuple = ()            # extra #SBATCH options: "account=abc", "qos=high", "exclusive"
  max_requeues: int = 3         # time-limit requeues before giving up (preemptions are not counted)


def add_flags(parser: argparse.ArgumentParser) -> None:
  """The SLURM flags shared by jobs.submit and jobs.sweep."""
  group = parser.add_argument_group("SLURM (with submitit)")
  group.add_argument("--partition", default=None, help="SLURM partition (default: the cluster's default)")
  group.add_argument("--nodes", type=int, default=1, help="nodes per job (default 1)")
  group.add_argument("--tasks_per_node", type=int, default=1,
                     help="processes per node: 1, or one per GPU if each process drives one (default 1)")
  group.add_argument("--gpus_per_node", type=int, default=0, help="GPUs per node (default 0)")
  group.add_argument("--cpus_per_task", type=int, default=None,
                     help=f"CPUs per task; the threads of tokenization and of the input pipeline are sized "
                          f"from them (default: {devices.CPUS_PER_GPU} per GPU the task drives, at least "
                          f"{devices.CPUS_WITHOUT_GPU})")
  group.add_argument("--time", type=int, default=60, help="time limit per job in minutes (default 60)")
  group.add_argument("--sbatch", action="append", default=[], metavar="KEY[=VALUE]",
                     help="an extra #SBATCH option, e.g. --sbatch account=abc --sbatch exclusive (repeatable)")
  group.add_argument("--max_requeues", type=int, default=3, help="requeues after hitting the time limit")


def options_from(args: argparse.Namespace) -> SlurmOptions:
  for name in ("nodes", "tasks_per_node", "time", "cpus_per_task"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
  for option in args.sbatch:
    if not option or option.startswith("-"):
      raise ValueError(f"--sbatch {option!r}: give KEY=VALUE or KEY without dashes, e.g. account=abc")
  return SlurmOptions(partition=args.partition, nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                      gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
                      time_minutes=args.time, sbatch=tuple(args.sbatch), max_requeues=args.max_requeues)


def cpus_per_task(options: SlurmOptions) -> int:
  """The CPUs each task asks for: --cpus_per_task, else a default from the GPUs it drives."""
  return options.cpus_per_task or devices.default_cpus_per_task(options.gpus_per_node / options.tasks_per_node)


def _executor(folder: pathlib.Path, options: SlurmOptions, name: str) -> submitit.SlurmExecutor:
  executor = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=options.max_requeues)
  extra = {}
  for option in options.sbatch:
    key, sep, value = option.partition("=")
    extra[key.replace("-", "_")] = value if sep else True
  parameters = dict(job_name=name, nodes=options.nodes, ntasks_per_node=options.tasks_per_node,
                    time=options.time_minutes, additional_parameters=extra)
  if options.partition:
    parameters["partition"] = options.partition
  if options.gpus_per_node:
    parameters["gpus_per_node"] = options.gpus_per_node
  parameters["cpus_per_task"] = cpus_per_task(options)
  executor.update_parameters(**parameters)
  return executor


class TrainTask(submitit.helpers.Checkpointable):
  """What each task of a job runs: a command (`python -m train FLAGS`) in a directory, as a child process.

  The child ignores SIGUSR2 (submitit's "time is up" signal): on it, task 0's `checkpoint` sends the
  child SIGTERM, waits until it saved and exited, and hands submitit the same task to requeue.
  """

  def __init__(self, command: list[str], cwd: str, on_success=None):
    self.command, self.cwd, self.on_success = list(command), cwd, on_success
    self._child = None

  def __call__(self) -> int:
    start = time.time()
    self._child = subprocess.Popen(
        self.command, cwd=self.cwd,
        preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN))
    while self._child.poll() is None:   # poll, not wait: `checkpoint` may run in a signal handler
      time.sleep(0.5)
    if self._child.returncode != 0:
      raise RuntimeError(f"{' '.join(self.command)} exited with {self._child.returncode}")
    if self.on_success is not None and _global_rank() == 0:
      # The job records its own result (a sweep trial's DONE marker), so that it never depends on a
      # watcher that may have been stopped or killed meanwhile.
      self.on_success(seconds=time.time() - start, by=f"SLURM job {os.environ.get('SLURM_JOB_ID', '?')}")
    return 0

  def checkpoint(self, *args, **kwargs):
    child = self._child
    if child is not None and child.returncode is None:
      os.kill(child.pid, signal.SIGTERM)
      try:
        os.waitpid(child.pid, 0)
      except ChildProcessError:
        pass
    return submitit.helpers.DelayedSubmission(TrainTask(self.command, self.cwd, self.on_success))

  def __getstate__(self):
    return {"command": self.command, "cwd": self.cwd, "on_success": self.on_success}

  def __setstate__(self, state):
    self.__init__(state["command"], state["cwd"], state.get("on_success"))


def _global_rank() -> int:
  """This task's rank in its job (0 outside SLURM)."""
  return int(os.environ.get("SLURM_PROCID", "0") or 0)


def submit(command: list[str], workdir, options: SlurmOptions, name: str, on_success=None) -> submitit.Job:
  """Submits `command` (run in every task, from the current directory) as a job for run directory
  `workdir`; records the job id in workdir/slurm_job.txt and appends it to workdir/slurm_jobs.txt (every
  job ever submitted for it, one a line). on_success(seconds=, by=): called by task 0 of the job once
  the command exited 0 (picklable: it travels with the job). Returns the submitit job."""
  workdir = pathlib.Path(workdir).absolute()
  (workdir / FOLDER).mkdir(parents=True, exist_ok=True)
  job = _executor(workdir / FOLDER, options, name).submit(TrainTask(command, os.getcwd(), on_success))
  (workdir / JOB_FILE).write_text(f"{job.job_id}\n")
  with open(workdir / JOBS_FILE, "a") as history:
    history.write(f"{job.job_id}\n")
  return job


def job_state(job_id: str) -> str:
  """SLURM's state of a job ('RUNNING', 'COMPLETED', 'FAILED', ...; 'UNKNOWN' once SLURM forgot it).

  Asks squeue, which knows finished jobs for MinJobAge seconds (so this works without accounting), then
  sacct, which knows them for as long as the cluster keeps its accounting.
  """
  for command in (["squeue", "-h", "-j", str(job_id), "-o", "%T", "--states=all"],
                  ["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State"]):
    try:
      done = subprocess.run(command, text=True, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
      continue
    out = done.stdout.split() if done.returncode == 0 else []
    if out:
      return out[0]   # sacct: 'CANCELLED by 0' -> 'CANCELLED'
  return "UNKNOWN"


def alive(job_id: str) -> bool:
  return job_state(job_id) in _ALIVE


def recorded_job(workdir) -> str | None:
  """The id in workdir/slurm_job.txt if that job is still queued or running, else None."""
  path = pathlib.Path(workdir) / JOB_FILE
  job_id = path.read_text().strip() if path.exists() else ""
  return job_id if job_id and alive(job_id) else None


def task_log(workdir, job_id: str, task: int = 0) -> pathlib.Path:
  return pathlib.Path(workdir) / FOLDER / f"{job_id}_{task}_log.out"


def wait(job_id: str, poll_seconds: float = 2.0, timeout: float | None = None) -> str:
  """Blocks until the job left the queue; returns its final state."""
  deadline = None if timeout is None else time.time() + timeout
  while True:
    state = job_state(job_id)
    if state not in _ALIVE:
      return state
    if deadline is not None and time.time() > deadline:
      raise TimeoutError(f"SLURM job {job_id} still {state} after {timeout} s")
    time.sleep(poll_seconds)


class SlurmTrial:
  """A sweep trial's SLURM job, looking like the subprocess.Popen the local runner watches."""

  def __init__(self, job_id: str, trial_dir: pathlib.Path, log):
    self.job_id, self.dir, self.log = job_id, trial_dir, log
    self.pid = f"slurm:{job_id}"
    self.returncode = None
    self.started = None     # time.time() when the job was first seen running: its wall-clock starts there

  def poll(self):
    if self.returncode is None:
      state = job_state(self.job_id)
      if state == "RUNNING" and self.started is None:
        self.started = time.time()
      if state not in _ALIVE:
        out = task_log(self.dir, self.job_id)
        if out.exists():
          self.log.write(out.read_text(errors="replace"))
          self.log.flush()
        self.returncode = 0 if state == "COMPLETED" else 1
    return self.returncode

  def send_signal(self, sig) -> None:
    """The sweep stops watching (the trial counts as interrupted); the job stays with SLURM, and
    rerunning the sweep watches it again."""
    if self.returncode is None:
      self.returncode = 1
      self.log.write(f"[sweep] stopped watching SLURM job {self.job_id}; it goes on\n")
      self.log.flush()

  def wait(self):
    return self.returncode


def trial_starter(options: SlurmOptions, on_success=None):
  """For jobs.sweep.run_sweep: start(command, trial_dir, log) -> SlurmTrial. A trial whose job is still
  queued or running (from an earlier sweep command) is watched again instead of submitted twice.
  on_success(trial_dir): what the trial's own job calls when its command succeeded (jobs.sweep passes
  a recorder of the trial's result and DONE marker), or None."""
  def start(command, trial_dir, log):
    job_id = recorded_job(trial_dir)
    if job_id:
      log.write(f"[sweep] watching SLURM job {job_id} again\n")
    else:
      job_id = submit(command, trial_dir, options, name=f"aiayn-{pathlib.Path(trial_dir).name}",
                      on_success=None if on_success is None else on_success(trial_dir)).job_id
      log.write(f"[sweep] submitted SLURM job {job_id}; task logs in {trial_dir / FOLDER}\n")
    log.flush()
    return SlurmTrial(job_id, pathlib.Path(trial_dir), log)
  return start


def main(argv=None) -> int:
  """`python -m jobs.submit`: one training run as a SLURM job (see the module docstring)."""
  parser = argparse.ArgumentParser(prog="python -m jobs.submit", description=__doc__.split("\n\n")[0],
                                   usage="python -m jobs.submit [SLURM flags] [--wait] -- TRAIN_FLAGS")
  add_flags(parser)
  parser.add_argument("--wait", action="store_true", help="wait for the job to end; exit 0 if it completed")
  argv = sys.argv[1:] if argv is None else list(argv)
  ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
  args = parser.parse_args(ours)
  try:
    options = options_from(args)
  except ValueError as error:
    parser.error(str(error))
  workdirs = [a.split("=", 1)[1] for a in rest if a.startswith("--workdir=")]
  workdirs += [rest[i + 1] for i, a in enumerate(rest[:-1]) if a == "--workdir"]
  if not workdirs:
    parser.error("give the run's --workdir after -- (the job's logs and its id go there)")
  workdir = pathlib.Path(workdirs[-1]).absolute()
  running = recorded_job(workdir)
  if running:
    print(f"[submit] SLURM job {running} is already queued or running for {workdir}; not submitting again")
    return 1
  job = submit([sys.executable, "-m", "train", *rest], workdir, options, name=f"aiayn-{workdir.name}")
  print(f"[submit] SLURM job {job.job_id} for {workdir}; task 0's output: {task_log(workdir, job.job_id)}")
  if not args.wait:
    return 0
  state = wait(job.job_id)
  print(f"[submit] job {job.job_id}: {state}")
  return 0 if state == "COMPLETED" else 1
