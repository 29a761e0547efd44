"""Training on SLURM through submitit: one run (`python -m jobs.submit`) or each trial of a sweep
(`python -m jobs.sweep --launcher slurm`) becomes a SLURM job.

    python -m jobs.submit --partition gpu --nodes 2 --tasks_per_node 1 --gpus_per_node 8 --time 1440 \\
        -- --config experiments/wmt14_ende.py:base --workdir runs/base

Every task of a job runs `python -m train FLAGS` (submitit starts one task per --tasks_per_node on each
node with srun); with more than one task, JAX recognises the SLURM job and the tasks train together
(train/multihost.py). SLURM does the queueing. Before anything is queued, jobs/preflight.py checks the
trainer's flags, config, data, init checkpoint, run directory and JAX_PLATFORMS; a mistake is refused in
one line. Time limit and preemption: submitit asks SLURM for SIGUSR2 --save_window seconds (default 120)
before the end; task 0 then sends SIGTERM to its trainer, every process of the run saves the same step
(a dev evaluation in progress is cut short), and submitit requeues the job, which resumes from that
checkpoint. A job that SLURM itself stops with SIGTERM (preemption in REQUEUE mode) saves the same way and
resumes when SLURM restarts it. The job's srun gives each task --cpus_per_task CPUs on every Slurm version.
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

from jobs import preflight
from run import devices, user_errors
from train import estimate

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
  save_window: int = 120        # seconds between SLURM's warning signal and its kill (SAVE_WINDOW)


# The default --save_window: what a job has, from SLURM's warning to its kill, to finish the step or the
# dev-evaluation batch in flight, save and exit. The slowest save measured, the paper's big model (params
# and Adam's moments, 2.57 GB in float32) on a 2-core machine's local disk, took 26 s, and a save may
# first wait for a periodic one still being written (seen: 11 s): 120 s covers both on a file system at
# half that speed.
SAVE_WINDOW = 120


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
  group.add_argument("--save_window", type=int, default=SAVE_WINDOW, metavar="SECONDS",
                     help=f"seconds before the time limit at which SLURM warns the job, which then saves "
                          f"and is requeued (default {SAVE_WINDOW}: the slowest save measured, the big "
                          f"model's 2.57 GB in 26 s, with room for a periodic save still in flight; raise it "
                          f"for a slow file system)")


def options_from(args: argparse.Namespace) -> SlurmOptions:
  for name in ("nodes", "tasks_per_node", "time", "cpus_per_task", "save_window"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
  if args.save_window >= 60 * args.time:
    raise ValueError(f"--save_window {args.save_window} s leaves nothing of --time {args.time} minutes: give a "
                     f"longer --time or a shorter --save_window")
  for option in args.sbatch:
    if not option or option.startswith("-"):
      raise ValueError(f"--sbatch {option!r}: give KEY=VALUE or KEY without dashes, e.g. account=abc")
  return SlurmOptions(partition=args.partition, nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                      gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
                      time_minutes=args.time, sbatch=tuple(args.sbatch), max_requeues=args.max_requeues,
                      save_window=args.save_window)


def cpus_per_task(options: SlurmOptions) -> int:
  """The CPUs each task asks for: --cpus_per_task, else a default from the GPUs it drives."""
  return options.cpus_per_task or devices.default_cpus_per_task(options.gpus_per_node / options.tasks_per_node)


def _executor(folder: pathlib.Path, options: SlurmOptions, name: str) -> submitit.SlurmExecutor:
  executor = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=options.max_requeues)
  parameters = dict(job_name=name, nodes=options.nodes, ntasks_per_node=options.tasks_per_node,
                    time=options.time_minutes, signal_delay_s=options.save_window,
                    **devices.slurm_parameters(cpus_per_task(options), options.sbatch))
  if options.partition:
    parameters["partition"] = options.partition
  if options.gpus_per_node:
    parameters["gpus_per_node"] = options.gpus_per_node
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
    # Its output goes to a log file: a progress line every 30 s, not ten a second (TQDM_MININTERVAL).
    env = {**os.environ, "TQDM_MININTERVAL": os.environ.get("TQDM_MININTERVAL", "30")}
    self._child = subprocess.Popen(
        self.command, cwd=self.cwd, env=env,
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


# ------------------------------------------------------------------------------------------------------
# SLURM's state of jobs: asked, never guessed. A squeue or sacct call that fails or times out is tried
# again with backoff, then raises NotAnswering; callers wait and say so (once a minute), and never read
# a silence as a job's end.
# ------------------------------------------------------------------------------------------------------
ENDED = "ENDED"            # SLURM answered: not in its queue, and no accounting record says more
QUERY_TIMEOUT = 60.0       # seconds one squeue or sacct call may take
BACKOFF = (2.0, 8.0, 30.0)  # seconds before each retry of a failed call
REPORT_EVERY = 60.0        # "SLURM not answering since ..." at most this often
TICK = 15.0                # seconds between a sweep's looks at its jobs: one squeue call for all of them
# What squeue and sacct print when they did answer, with a non-zero exit: the one id asked for is not (or
# no longer) known (squeue asked for several lists those it knows, and exits 0); no accounting is kept.
_UNKNOWN_JOB = "Invalid job id specified"
_NO_ACCOUNTING = "accounting storage is disabled"


class NotAnswering(RuntimeError):
  """squeue or sacct failed or timed out on every try: what SLURM knows of the jobs is not known."""


@dataclasses.dataclass(frozen=True)
class JobInfo:
  """What SLURM said of one job: its state ('RUNNING', 'COMPLETED', ..., ENDED) and node list."""
  state: str
  nodes: str = ""

  @property
  def alive(self) -> bool:
    return self.state in _ALIVE


def _ask(command: list[str], backoff=None, answers=()) -> str:
  """The output of a squeue or sacct call, tried again after each pause of backoff (default BACKOFF);
  NotAnswering if the last try failed too. A failed call whose error says one of `answers` did answer:
  with nothing."""
  problem = ""
  for pause in (0.0, *(BACKOFF if backoff is None else backoff)):
    time.sleep(pause)
    try:
      done = subprocess.run(command, text=True, capture_output=True, timeout=QUERY_TIMEOUT)
    except subprocess.TimeoutExpired:
      problem = f"timed out after {QUERY_TIMEOUT:.0f} s"
      continue
    except OSError as error:
      problem = str(error)
      continue
    if done.returncode == 0:
      return done.stdout
    if any(answer in done.stderr for answer in answers):
      return ""
    problem = f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}"
  raise NotAnswering(f"`{command[0]}` {problem}")


def query(job_ids, backoff=None) -> dict[str, JobInfo]:
  """{job id: JobInfo} for every id: one squeue call for all of them (it knows finished jobs for
  MinJobAge seconds, so this works without accounting), then one sacct call for those squeue no longer
  lists; ENDED for a job neither knows. Raises NotAnswering when SLURM does not answer (backoff: the
  pauses before retries, default BACKOFF)."""
  ids = sorted({str(i) for i in job_ids})
  if not ids:
    return {}
  found = {}
  squeue = ["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T %N", "--states=all"]
  for line in _ask(squeue, backoff, answers=(_UNKNOWN_JOB,) if len(ids) == 1 else ()).splitlines():
    fields = line.split()
    if len(fields) >= 2 and fields[0] in ids:
      found[fields[0]] = JobInfo(fields[1], " ".join(fields[2:]))
  forgotten = [i for i in ids if i not in found]
  if forgotten:
    sacct = ["sacct", "-n", "-X", "-P", "-j", ",".join(forgotten), "-o", "JobID,State,NodeList"]
    out = _ask(sacct, backoff, answers=(_NO_ACCOUNTING,))
    for line in out.splitlines():   # a requeued job has a line per start: the last one counts
      job_id, _, rest = line.partition("|")
      state, _, nodes = rest.partition("|")
      if job_id in forgotten and state.split():
        found[job_id] = JobInfo(state.split()[0], "" if nodes == "None assigned" else nodes)  # 'CANCELLED by 0'
  return {i: found.get(i, JobInfo(ENDED)) for i in ids}


class Silence:
  """Since when SLURM has not answered; says so through `say` at most once every REPORT_EVERY seconds."""

  def __init__(self, say=None):
    self.say = say or (lambda text: print(f"[slurm] {text}", file=sys.stderr, flush=True))
    self.since, self.said = None, None

  def failed(self, error: NotAnswering) -> None:
    now = time.time()
    self.since = self.since or now
    if self.said is None or now - self.said >= REPORT_EVERY:
      self.say(f"SLURM not answering since {time.strftime('%H:%M', time.localtime(self.since))} ({error}); "
               f"its jobs are taken to be as they were, nothing is submitted again until it answers")
      self.said = now

  def answered(self) -> None:
    if self.since is not None:
      self.say(f"SLURM answers again (silent since {time.strftime('%H:%M', time.localtime(self.since))})")
    self.since, self.said = None, None


def patiently(ask, silence: Silence | None = None):
  """ask() until SLURM answers it, saying meanwhile (once a minute) since when it has not."""
  silence = silence or Silence()
  while True:
    try:
      answer = ask()
    except NotAnswering as error:
      silence.failed(error)
      time.sleep(BACKOFF[-1])
      continue
    silence.answered()
    return answer


def job_state(job_id: str) -> str:
  """SLURM's state of a job ('RUNNING', 'COMPLETED', ...; ENDED once SLURM forgot it). Raises
  NotAnswering when SLURM does not answer."""
  return query([job_id])[str(job_id)].state


def alive(job_id: str) -> bool:
  """True while SLURM says the job is queued or running; raises NotAnswering when SLURM does not answer."""
  return JobInfo(job_state(job_id)).alive


def recorded_jobs(workdir) -> list[str]:
  """Every job ever submitted for workdir (slurm_jobs.txt, and slurm_job.txt), oldest first."""
  ids = []
  for name in (JOBS_FILE, JOB_FILE):
    path = pathlib.Path(workdir) / name
    ids += [i for i in (path.read_text().split() if path.exists() else []) if i not in ids]
  return ids


def recorded_job(workdir, silence: Silence | None = None) -> str | None:
  """The newest job recorded for workdir that SLURM says is still queued or running; None only once SLURM
  said that every job ever submitted for it has ended. Waits while SLURM does not answer."""
  ids = recorded_jobs(workdir)
  if not ids:
    return None
  answer = patiently(lambda: query(ids), silence)
  living = [i for i in ids if answer[i].alive]
  return living[-1] if living else None


def task_log(workdir, job_id: str, task: int = 0) -> pathlib.Path:
  return pathlib.Path(workdir) / FOLDER / f"{job_id}_{task}_log.out"


def wait(job_id: str, poll_seconds: float = 2.0, timeout: float | None = None) -> str:
  """Blocks until SLURM says the job left the queue; returns its final state."""
  deadline = None if timeout is None else time.time() + timeout
  silence = Silence()
  while True:
    state = patiently(lambda: job_state(job_id), silence)
    if not JobInfo(state).alive:
      return state
    if deadline is not None and time.time() > deadline:
      raise TimeoutError(f"SLURM job {job_id} still {state} after {timeout} s")
    time.sleep(poll_seconds)


class Poller:
  """SLURM's state of every job a sweep watches, from one squeue call per tick for all of them (and one
  sacct call for the jobs squeue forgot). A tick ends when a job's state is asked for a second time (the
  sweep polls each of its trials once a tick) and at least `every` seconds have passed. While SLURM does
  not answer, the last answer stands and the silence is reported (Silence)."""

  def __init__(self, every: float = 5.0, say=None):
    self.every, self.silence = every, Silence(say)
    self.watched, self.answer, self.read = set(), {}, set()
    self.asked = None

  def watch(self, job_id: str) -> None:
    self.watched.add(str(job_id))

  def forget(self, job_id: str) -> None:
    self.watched.discard(str(job_id))

  def state(self, job_id: str) -> JobInfo | None:
    """The job's state at the latest answer; None if SLURM has not yet answered for it."""
    job_id = str(job_id)
    due = self.asked is None or time.monotonic() - self.asked >= self.every
    if due and (job_id in self.read or job_id not in self.answer):
      self.refresh()
    self.read.add(job_id)
    return self.answer.get(job_id)

  def refresh(self) -> None:
    self.asked, self.read = time.monotonic(), set()
    try:
      self.answer = {**self.answer, **query(self.watched)}
    except NotAnswering as error:
      self.silence.failed(error)
      return
    self.silence.answered()


class SlurmTrial:
  """A sweep trial's SLURM job, looking like the subprocess.Popen the local runner watches. A poll that
  SLURM does not answer leaves it running: only SLURM's word ends it."""

  def __init__(self, job_id: str, trial_dir: pathlib.Path, log, poller: Poller | None = None):
    self.job_id, self.dir, self.log = str(job_id), trial_dir, log
    self.poller = poller or Poller(every=0.0)
    self.poller.watch(self.job_id)
    self.pid = f"slurm:{job_id}"
    self.returncode = None
    self.started = None     # time.time() when the job was first seen running: its wall-clock starts there
    self.nodes = ""

  def poll(self):
    if self.returncode is None:
      info = self.poller.state(self.job_id)
      if info is None:   # not answered yet
        return None
      self.nodes = info.nodes or self.nodes
      if info.state == "RUNNING" and self.started is None:
        self.started = time.time()
      if not info.alive:
        self.poller.forget(self.job_id)
        out = task_log(self.dir, self.job_id)
        if out.exists():
          self.log.write(out.read_text(errors="replace"))
        self.log.write(f"[sweep] SLURM job {self.job_id}: {info.state}\n")
        self.log.flush()
        self.returncode = 0 if info.state == "COMPLETED" else 1
    return self.returncode

  def send_signal(self, sig) -> None:
    """The sweep stops watching (the trial counts as interrupted); the job stays with SLURM, and
    rerunning the sweep watches it again."""
    if self.returncode is None:
      self.returncode = 1
      self.poller.forget(self.job_id)
      self.log.write(f"[sweep] stopped watching SLURM job {self.job_id}; it goes on\n")
      self.log.flush()

  def wait(self):
    return self.returncode


def trial_starter(options: SlurmOptions, on_success=None, poller: Poller | None = None):
  """For jobs.sweep.run_sweep: start(command, trial_dir, log) -> SlurmTrial. A trial for which SLURM says
  a job recorded earlier (any of them) is still queued or running is watched again instead of submitted
  twice; while SLURM does not answer, start waits. on_success(trial_dir): what the trial's own job calls
  when its command succeeded (jobs.sweep passes a recorder of the trial's result and DONE marker), or
  None. poller: shared by the trials (default: one squeue call per TICK / 3 at most)."""
  poller = poller or Poller(every=TICK / 3, say=lambda text: print(f"[slurm] {text}", flush=True))

  def start(command, trial_dir, log):
    job_id = recorded_job(trial_dir, poller.silence)
    if job_id:
      log.write(f"[sweep] watching SLURM job {job_id} again\n")
    else:
      job_id = submit(command, trial_dir, options, name=f"aiayn-{pathlib.Path(trial_dir).name}",
                      on_success=None if on_success is None else on_success(trial_dir)).job_id
      log.write(f"[sweep] submitted SLURM job {job_id}; task logs in {trial_dir / FOLDER}\n")
    log.flush()
    return SlurmTrial(job_id, pathlib.Path(trial_dir), log, poller)
  return start


def main(argv=None) -> int:
  """`python -m jobs.submit`: one training run as a SLURM job (see the module docstring)."""
  parser = argparse.ArgumentParser(prog="python -m jobs.submit", description=__doc__.split("\n\n")[0],
                                   usage="python -m jobs.submit [SLURM flags] [--wait] -- TRAIN_FLAGS")
  add_flags(parser)
  parser.add_argument("--wait", action="store_true", help="wait for the job to end; exit 0 if it completed")
  parser.add_argument("--estimate", action="store_true",
                      help="print the run's steps, tokens and projected hours and GPU-hours on --nodes x "
                           "--gpus_per_node GPUs (train/estimate.py), and exit: nothing is submitted")
  argv = sys.argv[1:] if argv is None else list(argv)
  ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
  args = parser.parse_args(ours)
  try:
    options = options_from(args)
  except ValueError as error:
    parser.error(str(error))
  if args.estimate:   # a dry run: nothing is checked on disk or submitted
    with user_errors.reported():
      config = preflight.train_config(rest, "gpu" if options.gpus_per_node else "cpu")[0]
    print(estimate.for_job(config, options.nodes, options.gpus_per_node))
    return 0
  if not any(a == "--workdir" or a.startswith("--workdir=") for a in rest):
    parser.error("give the run's --workdir after -- (the job's logs and its id go there)")
  with user_errors.reported():   # a mistake the node would find after the queue: one line, status 2
    workdir = preflight.check_train_flags(rest, options)
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
