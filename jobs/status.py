"""`python -m jobs.status DIR [--watch [SECONDS]] [--count N]`: every trial of a sweep, a search or a single
run, at a glance, from the trials' own files.

    python -m jobs.status runs/table3 --watch 60

DIR is a sweep's or a search's directory (one row per trial) or one run directory (one row). A row says the
trial's state (queued, running with its SLURM job and node or its local process, done, failed with the
last error line of its log, preempted and requeued, stopped), its step of num_steps, the last train loss,
dev loss and dev BLEU, tokens/s and MFU of the last logged interval, the time left at the last interval's
speed, and the age of its newest checkpoint. The figures come from each run's metrics.jsonl, config.json,
checkpoints/ and the sweep's files (sweep_status.json, DONE, sweep.log); the state of a trial on SLURM
from one squeue call for all of them (sacct for jobs squeue forgot). Nothing is written.
--watch redraws every SECONDS (default 30) until Ctrl-C, or --count times.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import sys
import time

from run import metrics as metrics_io
from run.checkpoint import CHECKPOINTS
from jobs import slurm, sweep_trial

_QUEUED = ("PENDING", "CONFIGURING")
_REQUEUED = ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PREEMPTED")
COLUMNS = ("trial", "state", "step", "train loss", "dev loss", "dev BLEU", "tok/s", "MFU", "ETA", "ckpt age")


def is_run(path: pathlib.Path) -> bool:
  """True for a trial's or a run's directory (what a trainer or a sweep wrote there)."""
  return any((path / name).exists() for name in ("config.json", metrics_io.METRICS, sweep_trial.STATUS,
                                                 sweep_trial.LOG, slurm.JOBS_FILE, slurm.JOB_FILE))


def trials_of(directory: pathlib.Path) -> list[tuple[str, pathlib.Path]]:
  """(name, directory) of each trial: DIR itself for a single run; else the trials in the order of the
  results table (a sweep's lists those not started yet too; a search's names each trial's run_dir), then
  any other run directory inside."""
  if is_run(directory):
    return [(directory.name, directory)]
  names = []
  results = directory / "results.csv"
  if results.exists():
    rows = csv.DictReader(open(results, newline=""))
    names = list(dict.fromkeys(r["run_dir"] if "run_dir" in r else r["trial"] for r in rows))
    names = [name for name in names if name]
  names += sorted(p.name for p in directory.iterdir() if p.is_dir() and is_run(p) and p.name not in names)
  return [(name, directory / name) for name in names]


def _lines(run_dir: pathlib.Path) -> list[dict]:
  path = run_dir / metrics_io.METRICS
  records = []
  for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
    try:   # a line being written, or damaged: left out of a look
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(record, dict) and isinstance(record.get("step"), int):
      records.append(record)
  return records


def _last(lines: list[dict], key: str):
  values = [l[key] for l in lines if isinstance(l.get(key), (int, float)) and math.isfinite(l[key])]
  return values[-1] if values else None


def _duration(seconds: float | None) -> str:
  if seconds is None:
    return "-"
  seconds = max(0.0, seconds)
  if seconds < 90:
    return f"{seconds:.0f}s"
  if seconds < 90 * 60:
    return f"{seconds / 60:.0f}m"
  if seconds < 48 * 3600:
    return f"{seconds / 3600:.1f}h"
  return f"{seconds / 86400:.1f}d"


def _fmt(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def checkpoint_age(run_dir: pathlib.Path, now: float) -> float | None:
  """Seconds since the newest checkpoint of the run was written; None if it has none."""
  steps = [p for p in (run_dir / CHECKPOINTS).glob("*") if p.name.isdigit()] if (run_dir / CHECKPOINTS).is_dir() else []
  if not steps:
    return None
  return now - max(steps, key=lambda p: int(p.name)).stat().st_mtime


def slurm_answer(dirs) -> dict | str:
  """{job id: slurm.JobInfo} for every job recorded in any of dirs, from one squeue call (and one sacct);
  a sentence saying so when SLURM does not answer."""
  ids = [job for d in dirs for job in slurm.recorded_jobs(d)]
  if not ids:
    return {}
  try:
    return slurm.query(ids, backoff=(1.0,))
  except slurm.NotAnswering as error:
    return f"SLURM not answering ({error})"


def state_of(run_dir: pathlib.Path, status: dict, answer: dict | str) -> tuple[str, bool]:
  """(what the trial is doing, in words; whether it is running now)."""
  jobs = slurm.recorded_jobs(run_dir)
  if (run_dir / sweep_trial.DONE).exists():
    return "done", False
  if jobs and isinstance(answer, str):
    return f"{status['status']} ({answer})", status["status"] == "running"
  if jobs:
    living = [j for j in jobs if answer[j].alive]
    job = living[-1] if living else jobs[-1]
    info = answer[job]
    again = ", requeued" if "Requeued job" in _read(slurm.task_log(run_dir, job)) else ""
    if info.state in _QUEUED:
      return f"queued (job {job}{again})", False
    if info.state in _REQUEUED:
      return f"preempted, requeued (job {job})", False
    if info.alive:
      return f"running (job {job} on {info.nodes or '?'}{again})", True
    if status["status"] in ("failed", "running") or info.state != "COMPLETED":
      log = slurm.task_log(run_dir, job).with_suffix(".err")
      why = sweep_trial.last_error(log if log.exists() else run_dir / sweep_trial.LOG)
      return f"failed (job {job} {info.state}): {why}", False
    return f"{status['status']} (job {job} {info.state})", False
  pid = sweep_trial.holder(run_dir)
  if pid is not None:
    return f"running (pid {pid})", True
  if status["status"] == "failed":
    return f"failed: {sweep_trial.last_error(run_dir / sweep_trial.LOG)}", False
  if status["status"] == "running":   # nobody runs it: its process ended without saying how
    return "stopped (rerun the sweep to resume it)", False
  return status["status"], False


def _read(path: pathlib.Path) -> str:
  return path.read_text(errors="replace") if path.exists() else ""


def row(name: str, run_dir: pathlib.Path, answer, now: float) -> dict:
  """One trial's cells (COLUMNS), from its own files."""
  status = sweep_trial.read_status(run_dir) if run_dir.exists() else {"status": "pending"}
  if run_dir.exists() and not (run_dir / sweep_trial.STATUS).exists() and (run_dir / metrics_io.METRICS).exists():
    status = {"status": "trained"}   # a run not started by a sweep
  state, running = state_of(run_dir, status, answer) if run_dir.exists() else ("pending", False)
  lines = _lines(run_dir)
  step = max((l["step"] for l in lines), default=None)
  steps = sweep_trial.num_steps(run_dir) if run_dir.exists() else None
  per_second = _last(lines, "train/steps_per_sec")
  eta = (steps - step) / per_second if running and steps and step is not None and per_second else None
  mfu = _last(lines, "train/mfu")
  return {"trial": name, "state": state,
          "step": f"{'-' if step is None else step}/{'?' if steps is None else steps}",
          "train loss": _fmt(_last(lines, "train/loss"), ".3f"), "dev loss": _fmt(_last(lines, "eval/loss"), ".3f"),
          "dev BLEU": _fmt(_last(lines, "eval/bleu"), ".2f"), "tok/s": _fmt(_last(lines, "train/tokens_per_sec"), ".0f"),
          "MFU": "-" if mfu is None else f"{mfu:.1%}", "ETA": _duration(eta),
          "ckpt age": _duration(checkpoint_age(run_dir, now)) if run_dir.exists() else "-"}


def render(directory: pathlib.Path, now: float | None = None) -> str:
  """The table of every trial under directory, with a title line."""
  now = time.time() if now is None else now
  trials = trials_of(directory)
  answer = slurm_answer([d for _, d in trials if d.exists()])
  rows = [row(name, d, answer, now) for name, d in trials]
  widths = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in COLUMNS}
  states = [r["state"].split(" ")[0].rstrip(":,") for r in rows]
  counts = ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states))
  out = [f"{directory} at {time.strftime('%H:%M:%S', time.localtime(now))}: {len(rows)} "
         f"trial{'s' if len(rows) != 1 else ''}" + (f" ({counts})" if rows else "")]
  if isinstance(answer, str):
    out.append(answer)
  out.append("  ".join(c.ljust(widths[c]) for c in COLUMNS).rstrip())
  out += ["  ".join(r[c].ljust(widths[c]) for c in COLUMNS).rstrip() for r in rows]
  return "\n".join(out) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jobs.status", description=__doc__.split("\n\n")[0])
  parser.add_argument("directory", help="a sweep's or a search's directory, or one run directory")
  parser.add_argument("--watch", type=float, nargs="?", const=30.0, default=None, metavar="SECONDS",
                      help="redraw every SECONDS (default 30) until Ctrl-C")
  parser.add_argument("--count", type=int, default=None, help="with --watch: stop after this many draws")
  args = parser.parse_args(argv)
  directory = pathlib.Path(args.directory)
  if not directory.is_dir():
    parser.error(f"{directory} is not a directory; give a sweep's, a search's or a run's --workdir")
  if args.watch is not None and args.watch <= 0:
    parser.error(f"--watch must be > 0 seconds, got {args.watch}")
  draws = 0
  try:
    while True:
      table = render(directory)
      if args.watch is not None and sys.stdout.isatty():
        table = "\033[H\033[J" + table   # redraw in place
      print(table, flush=True)
      draws += 1
      if args.watch is None or (args.count is not None and draws >= args.count):
        return 0
      time.sleep(args.watch)
  except KeyboardInterrupt:
    return 0


if __name__ == "__main__":
  sys.exit(main())
