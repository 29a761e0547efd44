"""Whether SLURM still holds a job, from `squeue`: what the bulk decoding launcher watches besides
submitit's `done()`, which reads `sacct` and so never ends on a cluster without accounting.

    queue = Queue(job_id)
    while not queue.ended():   # True only once squeue has answered twice that the job is gone
      ...

A failed or timed-out `squeue` is retried, then reported ("SLURM not answering since HH:MM", once a
minute), and never read as the job's end. Nothing here imports JAX or submitit.
"""
from __future__ import annotations

import subprocess
import sys
import time

EVERY = 15.0          # seconds between two looks at the queue
RETRIES = (1.0, 3.0)  # seconds before each retry of a failed squeue
TIMEOUT = 30.0        # seconds one squeue call may take
REPORT_EVERY = 60.0   # seconds between two "not answering" lines


def listed(job_id: str, *, timeout: float = TIMEOUT) -> bool | None:
  """Whether `squeue` lists job `job_id` (pending, running or completing); None when it does not answer
  (exit status, timeout, not installed). squeue's "Invalid job id" (a job the controller has forgotten)
  is an answer: not listed."""
  try:
    done = subprocess.run(["squeue", "--noheader", "--format=%i", "--jobs", str(job_id)],
                          capture_output=True, text=True, timeout=timeout, check=False)
  except (OSError, subprocess.TimeoutExpired):
    return None
  if done.returncode != 0:
    return False if "invalid job id" in done.stderr.lower() else None
  ids = {line.strip().split("_")[0] for line in done.stdout.splitlines() if line.strip()}
  return str(job_id) in ids


def ask(job_id: str) -> bool | None:
  """listed(), retried after RETRIES pauses while squeue does not answer; None if it never did."""
  answer = listed(job_id)
  for pause in RETRIES:
    if answer is not None:
      break
    time.sleep(pause)
    answer = listed(job_id)
  return answer


class Queue:
  """Looks at most every EVERY seconds whether the queue still holds one job."""

  def __init__(self, job_id: str, *, every: float | None = None):
    self.job_id = str(job_id)
    self.every = EVERY if every is None else every
    self.last_look = 0.0
    self.gone_answers = 0            # consecutive answers that the job is not listed
    self.silent_since: float | None = None
    self.last_report = 0.0

  def ended(self) -> bool:
    """True once squeue has answered twice in a row that the job is no longer listed."""
    now = time.time()
    if now - self.last_look < self.every:
      return False
    self.last_look = now
    answer = ask(self.job_id)
    if answer is None:
      self._report_silence()
      return False
    self.silent_since = None
    self.gone_answers = 0 if answer else self.gone_answers + 1
    return self.gone_answers >= 2

  def _report_silence(self) -> None:
    now = time.time()
    if self.silent_since is None:
      self.silent_since = now
    if now - self.last_report >= REPORT_EVERY:
      self.last_report = now
      since = time.strftime("%H:%M", time.localtime(self.silent_since))
      sys.stderr.write(f"[decode] SLURM not answering since {since} (squeue --jobs {self.job_id} fails): "
                       f"job {self.job_id} is not taken as ended; still watching\n")
      sys.stderr.flush()
