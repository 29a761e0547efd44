"""Runs and sweeps through a real SLURM (scripts/slurm_local.sh starts a one-node cluster; CI runs it).

- a 2-trial smoke sweep with --launcher slurm: each trial a job, results table as with the local runner;
- a sweep, with squeue and sacct failing on a fifth of their calls, whose watcher is SIGKILLed after its
  first trial finished: the rerun submits only the trials that did not finish (each trial's own job
  writes its DONE marker), and after that rerun's SIGHUP a third run submits nothing;
- a 2-task job (2 processes x 2 CPU devices) that is "preempted" with SIGUSR2 after its checkpoint at
  step 4 (what SLURM sends before a time limit): it saves, submitit requeues it, it resumes, and ends
  bitwise equal to the same training run by jobs.launch on this machine;
- a 2-task `--check_devices` job: each task reports the devices it was given.
Skipped, with the reason, where no SLURM controller answers.
"""
import csv
import functools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from run import checkpoint as ckpt
from run import metrics as metrics_io
from jobs import slurm
from test_sweep import HELD_TRAINER, THREE_TRIALS, until
from train.train import TIMING_KEYS
from files_config import clean_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMOKE = str(ROOT / "experiments" / "default.py") + ":smoke"


@functools.cache   # sinfo can take seconds to give up where no controller answers: ask once
def slurm_problem() -> str | None:
  if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
    return "SLURM is not installed (run: sudo bash scripts/slurm_local.sh)"
  try:
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.TimeoutExpired) as error:
    return f"sinfo failed: {error}"
  states = out.stdout.split()
  if out.returncode != 0 or not any(s.startswith(("idle", "mixed", "allocated")) for s in states):
    return f"no SLURM node is up (sinfo: {(out.stdout + out.stderr).strip()[:200]}); run scripts/slurm_local.sh"
  return None


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def slurm_up():
  """Skips, naming why, where no SLURM controller answers; asked when a test runs, not at collection, so that
  the default suite (which deselects these) never waits for sinfo."""
  problem = slurm_problem()
  if problem:
    pytest.skip(problem)


def _env(devices=2) -> dict:
  """The environment of the submitting command, which sbatch passes on to the jobs."""
  return clean_env(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))


def _run(command, timeout=600):
  done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
  return done.returncode, done.stdout + done.stderr


def test_sweep_on_slurm(tmp_path):
  out = tmp_path / "table3"
  code, text = _run([sys.executable, "-m", "jobs.sweep", f"--config={ROOT}/experiments/table3.py:smoke",
                     f"--workdir={out}", "--launcher=slurm", "--partition=debug", "--time=15",
                     "--config.train.bleu_every=0", "--config.train.test_bleu=False"])
  assert code == 0, text
  rows = {r["trial"]: r for r in csv.DictReader(open(out / "results.csv"))}
  assert {name: r["status"] for name, r in rows.items()} == {"base": "done", "C_N2": "done"}, text
  for name, r in rows.items():
    assert int(r["steps"]) == 8 and 1.0 < float(r["dev_ppl"]) < 1000, r
    job = (out / name / slurm.JOB_FILE).read_text().strip()
    assert "submitted SLURM job" in (out / name / "sweep.log").read_text()
    assert slurm.task_log(out / name, job).is_file()
  # Rerunning the sweep submits nothing: both trials are done.
  code, text = _run([sys.executable, "-m", "jobs.sweep", f"--config={ROOT}/experiments/table3.py:smoke",
                     f"--workdir={out}", "--launcher=slurm", "--config.train.bleu_every=0",
                     "--config.train.test_bleu=False"])
  assert code == 0 and "skip base (done)" in text and "skip C_N2 (done)" in text, text


def test_two_task_job_preempted_requeued_and_resumed_exactly(tmp_path):
  steps = 16   # the signal is sent once step 4 is saved: 12 steps of room for it to land before the end
  flags = [f"--config={SMOKE}", "--config.train.progress=False", "--config.train.tensorboard=False",
           "--config.train.test_bleu=False", "--config.train.bleu_every=0", "--config.train.eval_every=0",
           "--config.train.dev_sentences=32", f"--config.train.num_steps={steps}", "--config.train.log_every=2",
           "--config.train.checkpoint_every_steps=2", "--config.train.checkpoint_every_minutes=0"]
  local = subprocess.Popen([sys.executable, "-m", "jobs.launch", "--processes=2", "--devices_per_process=2",
                            "--", *flags, f"--workdir={tmp_path / 'local'}"], cwd=ROOT, env=_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  workdir = tmp_path / "slurm"
  code, text = _run([sys.executable, "-m", "jobs.submit", "--partition=debug", "--tasks_per_node=2",
                     "--time=15", "--", *flags, f"--workdir={workdir}"])
  assert code == 0, text
  job = (workdir / slurm.JOB_FILE).read_text().strip()
  deadline = time.time() + 400
  while not (workdir / "checkpoints" / "4").is_dir():
    assert slurm.alive(job) and time.time() < deadline, slurm.task_log(workdir, job).read_text()[-3000:]
    time.sleep(0.1)
  subprocess.run(["scancel", "--signal=USR2", job], check=True)   # what --signal=USR2@90 sends
  state = slurm.wait(job, poll_seconds=1, timeout=500)
  log = slurm.task_log(workdir, job).read_text()
  assert state == "COMPLETED", log[-3000:]
  assert "Requeued job" in log and "resumed" in log, log[-3000:]
  local_out, _ = local.communicate(timeout=300)
  assert local.returncode == 0, local_out[-3000:]

  lines = [l for l in metrics_io.read_metrics(workdir)]
  assert max(l["step"] for l in lines) == steps
  strip = lambda ls: [{k: v for k, v in l.items() if k not in TIMING_KEYS} for l in ls]
  assert strip(lines) == strip(metrics_io.read_metrics(tmp_path / "local"))
  a = ckpt.flat_leaves(jax.device_get(ckpt.load_params(workdir)[0]))
  b = ckpt.flat_leaves(jax.device_get(ckpt.load_params(tmp_path / "local")[0]))
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_each_task_of_a_two_task_job_reports_the_devices_it_was_given(tmp_path):
  # `python -m train --check_devices` in both tasks of one job: they join, each logs its own devices, and
  # task 0 the whole layout; no config, data or compile beyond the exchange of the reports.
  code, text = _run([sys.executable, "-m", "jobs.submit", "--partition=debug", "--tasks_per_node=2", "--time=5",
                     "--wait", "--", "--check_devices", f"--workdir={tmp_path}"], timeout=300)
  assert code == 0, text
  job = (tmp_path / slurm.JOB_FILE).read_text().strip()
  ids = []
  for task in (0, 1):
    log = slurm.task_log(tmp_path, job, task).read_text()
    (line,) = [l for l in log.splitlines() if l.startswith(f"[devices] process {task} of 2 on ")]
    assert ": 2 cpu devices, ids [" in line, log
    ids.append(line.split("ids ")[1].split("]")[0])
  assert ids[0] != ids[1]   # each task its own devices
  first = slurm.task_log(tmp_path, job, 0).read_text()
  assert "[devices] 2 processes x 2 local devices = 4 global devices (cpu); per host: " in first, first
  assert " 2 processes x 2" in first.split("per host: ")[1]


# The sweep command of the test: jobs.sweep's main with the held trainer in place of `python -m train`.
WATCHER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from jobs import slurm, sweep
    options = slurm.SlurmOptions(partition="debug", time_minutes=10, cpus_per_task=1)
    statuses = sweep.run_sweep({spec!r}, {workdir!r}, parallel=1_000_000, poll_seconds=0.5,
                               trainer=(sys.executable, {trainer!r}),
                               start=slurm.trial_starter(options, on_success=sweep.TrialResult))
    sys.exit(0 if all(s == "done" for s in statuses.values()) else 1)
""")


def _jobs(trial_dir) -> list[str]:
  path = trial_dir / slurm.JOBS_FILE
  return path.read_text().split() if path.exists() else []


# squeue and sacct that fail on a fifth of their calls (every 10th exits 1 as a busy controller does,
# every 10th + 5 hangs past the watcher's timeout), and an sbatch that logs each submission.
FLAKY = textwrap.dedent("""\
    #!/bin/bash
    count_file="$FLAKY_DIR/$(basename "$0").count"
    n=$(( $(cat "$count_file" 2>/dev/null || echo 0) + 1 ))
    echo $n > "$count_file"
    if (( n % 10 == 0 )); then echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1; fi
    if (( n % 10 == 5 )); then sleep 20; fi
    exec {real} "$@"
""")
SBATCH_LOG = textwrap.dedent("""\
    #!/bin/bash
    echo "$@" >> "$FLAKY_DIR/sbatch.log"
    exec {real} "$@"
""")
FLAKY_WATCHER = WATCHER.replace("from jobs import slurm, sweep\n", textwrap.dedent("""\
    from jobs import slurm, sweep
    slurm.QUERY_TIMEOUT, slurm.BACKOFF = 3.0, (0.5, 1.0, 2.0)
""")).replace("start=slurm.trial_starter(options, on_success=sweep.TrialResult)",
              "start=slurm.trial_starter(options, on_success=sweep.TrialResult, poller=slurm.Poller(every=0.5))")


def test_a_sweep_killed_then_hung_up_while_squeue_and_sacct_fail_submits_only_the_unfinished_trials(tmp_path):
  """squeue and sacct fail or hang on a fifth of their calls while a 3-trial sweep runs. Trial 'first'
  finishes (its own job writes its DONE), then the watcher is SIGKILLed; trial 'held' is still running and
  'lost''s job is cancelled. The command rerun skips 'first', watches 'held''s job again and resubmits
  'lost' alone; then its terminal's process group gets SIGHUP, and the command run a third time submits
  nothing: sbatch's log holds one job for each trial and one more for 'lost', none is marked failed, all
  end done. (One sweep for both ends of a watcher, SIGKILL and SIGHUP, and the killed watcher's rerun.)"""
  flaky = tmp_path / "bin"
  flaky.mkdir()
  for name, body in (("squeue", FLAKY), ("sacct", FLAKY), ("sbatch", SBATCH_LOG)):
    (flaky / name).write_text(body.format(real=shutil.which(name)))
    (flaky / name).chmod(0o755)
  env = dict(_env(), PATH=f"{flaky}{os.pathsep}{os.environ['PATH']}", FLAKY_DIR=str(flaky))
  (tmp_path / "train.py").write_text(HELD_TRAINER)
  (tmp_path / "exp.py").write_text(THREE_TRIALS)
  out = tmp_path / "sweep"
  command = [sys.executable, "-c", FLAKY_WATCHER.format(root=str(ROOT), spec=str(tmp_path / "exp.py"),
                                                        workdir=str(out), trainer=str(tmp_path / "train.py"))]
  trials = {name: out / name for name in ("first", "held", "lost")}
  log_text = lambda name: (trials[name] / "sweep.log").read_text()

  def watcher(n: int) -> subprocess.Popen:
    with open(tmp_path / f"watcher{n}.log", "w") as log:   # a session of its own: the terminal it was typed in
      return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)

  first_watcher = watcher(1)
  until(lambda: all(_jobs(d) for d in trials.values()), "the three jobs' submission")
  jobs = {name: _jobs(d)[0] for name, d in trials.items()}
  (out / "release-first").touch()
  until(lambda: (trials["first"] / "DONE").exists(), "trial first's DONE")
  os.killpg(first_watcher.pid, signal.SIGKILL)
  assert first_watcher.wait() == -signal.SIGKILL
  status = json.loads((trials["first"] / "sweep_status.json").read_text())
  assert status["status"] == "done" and status["finished_by"] == f"SLURM job {jobs['first']}", status
  subprocess.run(["scancel", jobs["lost"]], check=True)
  assert slurm.wait(jobs["lost"], poll_seconds=0.5, timeout=120) != "COMPLETED"
  assert slurm.alive(jobs["held"]) and not (trials["held"] / "DONE").exists()

  second_watcher = watcher(2)
  resubmitted = lambda: len(_jobs(trials["lost"])) == 2 and \
      f"submitted SLURM job {_jobs(trials['lost'])[1]}" in log_text("lost")
  until(lambda: resubmitted() or second_watcher.poll() is not None, "lost's resubmission")
  assert second_watcher.poll() is None, (tmp_path / "watcher2.log").read_text()
  os.killpg(second_watcher.pid, signal.SIGHUP)
  assert second_watcher.wait() == -signal.SIGHUP, (tmp_path / "watcher2.log").read_text()
  assert "skip first (done)" in (tmp_path / "watcher2.log").read_text()
  assert f"watching SLURM job {jobs['held']} again" in log_text("held")
  lost_again = _jobs(trials["lost"])[1]

  third_watcher = watcher(3)
  until(lambda: (log_text("held").count(f"watching SLURM job {jobs['held']} again") == 2
                 and f"watching SLURM job {lost_again} again" in log_text("lost"))
        or third_watcher.poll() is not None, "the third run to watch the two jobs still running")
  (out / "release-held").touch()
  (out / "release-lost").touch()
  assert third_watcher.wait(timeout=300) == 0, (tmp_path / "watcher3.log").read_text()
  assert "skip first (done)" in (tmp_path / "watcher3.log").read_text()
  calls = {name: int((flaky / f"{name}.count").read_text()) for name in ("squeue", "sacct")
           if (flaky / f"{name}.count").exists()}
  assert calls.get("squeue", 0) >= 10, calls   # the failures did happen
  # Submitted over the three commands: one job for each finished or running trial, and one more for 'lost'.
  assert len((flaky / "sbatch.log").read_text().splitlines()) == 4
  assert {name: _jobs(d) for name, d in trials.items()} == \
      {"first": [jobs["first"]], "held": [jobs["held"]], "lost": [jobs["lost"], lost_again]}
  assert slurm.job_state(lost_again) == "COMPLETED"
  for name, d in trials.items():
    assert json.loads((d / "sweep_status.json").read_text())["status"] == "done", name
    assert "FAILED" not in log_text(name), name
  rows = {r["trial"]: r["status"] for r in csv.DictReader(open(out / "results.csv"))}
  assert rows == {"first": "done", "held": "done", "lost": "done"}
