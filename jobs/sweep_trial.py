"""`python -m jobs.sweep_trial TRIAL_DIR -- COMMAND...`: one trial of a local sweep (jobs/sweep.py), as
the sweep command starts it. Runs the trainer's command; when it exits 0 having reached its num_steps,
records the trial's result and its DONE marker itself (jobs.sweep.TrialResult, as a trial's SLURM job
does), so that a trial that ends after its sweep command was killed is still marked done. Exits with the
trainer's status.

For as long as it runs it holds an exclusive flock on TRIAL_DIR/sweep_trial.lock (released when the
process dies, even by SIGKILL): a sweep command rerun meanwhile finds the trial still running and watches
it instead of starting a second trainer on the same run directory. SIGTERM is passed on to the trainer
(which saves a checkpoint and exits); SIGINT is left to the trainer, which gets its own from the terminal.
"""
from __future__ import annotations

import fcntl
import os
import pathlib
import signal
import subprocess
import sys
import time

LOCK = "sweep_trial.lock"


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
  signal.signal(signal.SIGINT, signal.SIG_IGN)   # the trainer gets the terminal's SIGINT and stops itself
  start = time.time()
  child = subprocess.Popen(command, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
  code = child.wait()
  if code == 0:
    from jobs.sweep import TrialResult   # only now: the trainer starts without waiting for these imports
    TrialResult(str(trial_dir))(seconds=time.time() - start, by=f"local process {os.getpid()}")
  return code


if __name__ == "__main__":
  sys.exit(main())
