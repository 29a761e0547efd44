"""One trial of a sweep or a search on disk, and `python -m jobs.sweep_trial TRIAL_DIR -- COMMAND...`, the
process that runs a local trial.

A trial's directory is a normal run directory (the trainer's config.json, metrics.jsonl, checkpoints/, tb/)
plus what the sweep keeps there: sweep.log (the trainer's output), sweep_status.json (status, return code,
wall-clock, overrides) and the DONE marker. Whoever runs the trainer records its end: TrialResult, called
by this process for a local trial and by the trial's own job on SLURM (jobs.slurm.TrainTask), writes the
result, the DONE marker and the trial's hyperparameters for TensorBoard's HParams view; a trial that ends
after its sweep command was killed is still marked.

`python -m jobs.sweep_trial` runs the trainer's command and exits with its status. The sweep starts it in
a session of its own, so that a SIGHUP (the terminal closed) or a SIGKILL of the sweep command leaves it
running. For as long as it runs it holds an exclusive flock on TRIAL_DIR/sweep_trial.lock (released when
the process dies, even by SIGKILL): a sweep command rerun meanwhile finds the trial running and watches it
instead of starting a second trainer on the same run directory. SIGTERM and SIGINT are passed on to the
trainer, which saves a checkpoint and exits.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from run import config as config_io
from run import metrics as metrics_io
from run.workdir import write_atomically

LOCK = "sweep_trial.lock"
DONE = "DONE"                  # marker: the trial's trainer exited 0 having reached num_steps
STATUS = "sweep_status.json"   # per trial: status, return code, wall-clock, overrides
LOG = "sweep.log"              # per trial: the trainer's stdout and stderr
HPARAMS = "hparams"            # under the trial's tb/: its hyperparameters and final metrics
PROGRESS_SECONDS = "30"        # a trial's progress line in its log at most this often (TQDM_MININTERVAL)


# ------------------------------------------------------------------------------------------------------
# The trial's state on disk.
# ------------------------------------------------------------------------------------------------------
def read_status(trial_dir: pathlib.Path) -> dict:
  """DIR/NAME/sweep_status.json as a dict (status 'pending' if the trial never started)."""
  path = pathlib.Path(trial_dir) / STATUS
  if not path.exists():
    return {"status": "pending", "seconds": 0.0}
  return json.loads(path.read_text())


def write_status(trial_dir: pathlib.Path, **fields) -> None:
  status = read_status(trial_dir)
  status.update(fields)
  write_atomically(pathlib.Path(trial_dir) / STATUS, json.dumps(status, indent=2, sort_keys=True) + "\n")


def num_steps(trial_dir: pathlib.Path) -> int | None:
  """config.train.num_steps of the trial's run, or None before the trainer wrote its config."""
  try:
    return int(config_io.load_run_config(trial_dir).train.num_steps)
  except (FileNotFoundError, ValueError, KeyError):
    return None


def reached_end(trial_dir: pathlib.Path) -> bool:
  """True if the run's metrics reach its config's num_steps (an exit 0 after SIGTERM does not)."""
  target = num_steps(trial_dir)
  try:
    steps = [line["step"] for line in metrics_io.read_metrics(trial_dir)]
  except (FileNotFoundError, ValueError, KeyError):
    return False
  return target is not None and bool(steps) and max(steps) >= target


def mark_done(trial_dir: pathlib.Path) -> None:
  (pathlib.Path(trial_dir) / DONE).write_text(f"finished {time.strftime('%Y-%m-%d %H:%M:%S')}\n")


def last_error(log: pathlib.Path) -> str:
  """The line of a log that says why a trial failed: the last one naming an error, else the last line."""
  text = pathlib.Path(log).read_text(errors="replace") if pathlib.Path(log).exists() else ""
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  errors = [l for l in lines if "Error" in l or "error:" in l or "FAILED" in l]
  return (errors or lines or ["(empty log)"])[-1][:300]


def final_metrics(trial_dir: pathlib.Path) -> dict:
  """The last train loss and the last dev loss, perplexity and BLEU in the run's metrics.jsonl."""
  try:
    lines = metrics_io.read_metrics(trial_dir)
  except (FileNotFoundError, ValueError):
    return {}
  found = {}
  for name, key in (("train_loss", "train/loss"), ("dev_loss", "eval/loss"), ("dev_ppl", "eval/ppl"),
                    ("dev_bleu", "eval/bleu"), ("test_bleu", "test/bleu")):
    values = [l[key] for l in lines if isinstance(l.get(key), (int, float))]
    if values:
      found[name] = float(values[-1])
  return found


def write_hparams(trial_dir: pathlib.Path, overrides: dict) -> None:
  """The trial's overrides beside its final metrics in TRIAL_DIR/tb/hparams, for TensorBoard's HParams
  view: `tensorboard --logdir SWEEP_DIR` shows every trial of the sweep side by side."""
  params = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in overrides.items()}
  metrics = {f"hparams/{k}": v for k, v in final_metrics(trial_dir).items()}
  tensorboard = metrics_io.tensorboardx()
  with tensorboard.SummaryWriter(str(pathlib.Path(trial_dir) / metrics_io.TB / HPARAMS)) as writer:
    for summary in tensorboard.summary.hparams(params or {"trial": pathlib.Path(trial_dir).name}, metrics):
      writer.file_writer.add_summary(summary)
    for key, value in metrics.items():   # the values the HParams view shows beside the trial's settings
      writer.add_scalar(key, value)


@dataclasses.dataclass(frozen=True)
class TrialResult:
  """What runs a trial calls once its trainer exited 0 (this module's main; jobs.slurm.TrainTask's
  on_success on SLURM): if the run reached its num_steps, it records the trial as done (sweep_status.json:
  status, seconds, finished_by), writes its hyperparameters for TensorBoard and its DONE marker, so that
  a finished trial is marked even when no sweep command watches it any more (one that was killed, or a
  node that went away). Picklable: it travels with the job."""
  trial_dir: str

  def __call__(self, *, seconds: float, by: str) -> None:
    trial_dir = pathlib.Path(self.trial_dir)
    if not reached_end(trial_dir):   # exited 0 after SIGTERM: interrupted, not done
      return
    status = read_status(trial_dir)
    write_status(trial_dir, status="done", returncode=0, seconds=status.get("seconds", 0.0) + seconds,
                 finished_by=by)
    write_hparams(trial_dir, status.get("overrides", {}))
    mark_done(trial_dir)


# ------------------------------------------------------------------------------------------------------
# The process that runs a local trial.
# ------------------------------------------------------------------------------------------------------
def holder(trial_dir) -> int | None:
  """The pid of the live jobs.sweep_trial process running this trial, or None."""
  path = pathlib.Path(trial_dir) / LOCK
  if not path.exists():
    return None
  with open(path, "a+") as handle:
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      handle.seek(0)
      text = handle.read().strip()
      return int(text) if text.isdigit() else -1
    fcntl.flock(handle, fcntl.LOCK_UN)
  return None


STOPPING = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stopping_blocked():
  """SIGTERM and SIGINT blocked in this thread while it starts a `python -m jobs.sweep_trial`: the child
  inherits the block, so that a signal sent while it still imports waits until main can pass it on to
  the trainer (main lifts the block). A signal to this thread meanwhile comes when the block ends."""
  previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING)
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def trainer_env() -> dict:
  """The environment of a trial's trainer: its progress bar writes a line to the log every
  PROGRESS_SECONDS (unless TQDM_MININTERVAL says otherwise), not ten a second."""
  return {**os.environ, "TQDM_MININTERVAL": os.environ.get("TQDM_MININTERVAL", PROGRESS_SECONDS)}


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if len(argv) < 3 or argv[1] != "--":
    print("usage: python -m jobs.sweep_trial TRIAL_DIR -- COMMAND...", file=sys.stderr)
    return 2
  trial_dir, command = pathlib.Path(argv[0]), argv[2:]
  trial_dir.mkdir(parents=True, exist_ok=True)
  lock = open(trial_dir / LOCK, "a+")
  try:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    print(f"[sweep] {trial_dir} is already being trained by another jobs.sweep_trial process", file=sys.stderr)
    return 1
  lock.seek(0)
  lock.truncate()
  lock.write(f"{os.getpid()}\n")
  lock.flush()
  # The sweep starts this process with SIGTERM and SIGINT blocked (stopping_blocked), so that one sent
  # while it was still importing waits until it can be passed on to the trainer.
  start, received, children = time.time(), [], []

  def forward(signum, frame):
    received.append(signum)
    for child in children:
      child.send_signal(signal.SIGTERM)

  for sig in STOPPING:
    signal.signal(sig, forward)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPPING)
  children.append(subprocess.Popen(command, env=trainer_env()))
  if received:
    children[0].send_signal(signal.SIGTERM)
  code = children[0].wait()
  by = f"local process {os.getpid()}"
  if code == 0:
    TrialResult(str(trial_dir))(seconds=time.time() - start, by=by)
  if not (trial_dir / DONE).exists():   # the status says what happened, watched or not
    write_status(trial_dir, status="failed" if code else "interrupted", returncode=code, ended_by=by)
  return code


if __name__ == "__main__":
  sys.exit(main())
