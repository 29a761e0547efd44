"""The sweep runner: trials as run directories, N at once, failures recorded, reruns skip finished trials
and finish the rest, results table and plot. Scheduling is tested with a fast fake trainer; one test
runs the Table 3 smoke sweep end to end with the real trainer and interrupts it.
"""
import ast
import csv
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jobs import sweep
from files_config import xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A stand-in for `python -m train`: writes config.json and metrics.jsonl like the trainer once a second trial
# has started. model.num_heads=3 fails (exit 1); every run appends its start/end times to workdir/runs.json.
FAKE_TRAINER = textwrap.dedent(f"""
    import json, pathlib, sys, time
    sys.path.insert(0, {str(ROOT)!r})
    import experiments
    from run import config as config_io
    start = time.time()
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    spec, workdir = args.pop("config"), pathlib.Path(args.pop("workdir"))
    config = experiments.load_experiment(spec)
    experiments.apply_overrides(config, {{k.removeprefix("config."): v for k, v in args.items()}})
    workdir.mkdir(parents=True, exist_ok=True)
    runs = json.loads((workdir / "runs.json").read_text()) if (workdir / "runs.json").exists() else []
    if config.model.num_heads == 3:
      print("fake trainer: three heads do not divide d_model", file=sys.stderr)
      sys.exit(1)
    config_io.save_config(config, workdir)
    # Wait (up to 30 s) until another trial has started too: with --parallel 2 the first two overlap however
    # slowly each one starts, and a runner that ran them one at a time would show here as no overlap.
    (workdir.parent / ("started-" + workdir.name)).touch()
    deadline = time.time() + 30
    while len(list(workdir.parent.glob("started-*"))) < 2 and time.time() < deadline:
      time.sleep(0.05)
    h, n = config.model.num_heads, config.train.num_steps
    with open(workdir / "metrics.jsonl", "w") as f:
      f.write(json.dumps({{"step": n, "train/loss": 3.0 / h}}) + "\\n")
      f.write(json.dumps({{"step": n, "eval/loss": 2.0 / h, "eval/ppl": 4.0 + 1.0 / h,
                           "eval/bleu": 20.0 + h}}) + "\\n")
    (workdir / "runs.json").write_text(json.dumps(runs + [[start, time.time()]]))
""")

EXPERIMENT = textwrap.dedent("""
    from experiments import default
    ARGS = ("smoke",)
    PAPER = {"h2": dict(ppl=4.5, bleu=25.0, params_m=None), "h4": dict(ppl=4.3, bleu=26.0, params_m=None)}

    def get_config(arg=None):
      return default.get_config("smoke")

    def sweep(add):
      add(name="h2", **{"model.num_heads": 2})
      add(name="h4", **{"model.num_heads": 4})
      add(name="h3", **{"model.num_heads": 3})
""")


# A stand-in for `python -m train` that saves its config, then waits for DIR/release-NAME before it writes
# the metrics of a finished run: the test decides when each trial ends.
HELD_TRAINER = textwrap.dedent(f"""
    import json, os, pathlib, sys, time
    sys.path.insert(0, {str(ROOT)!r})
    import experiments
    from run import config as config_io
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    spec, workdir = args.pop("config"), pathlib.Path(args.pop("workdir"))
    config = experiments.load_experiment(spec)
    experiments.apply_overrides(config, {{k.removeprefix("config."): v for k, v in args.items()}})
    config_io.save_config(config, workdir)
    with open(workdir / "starts.txt", "a") as f:
      f.write(f"{{os.getpid()}}\\n")
    while not (workdir.parent / ("release-" + workdir.name)).exists():
      time.sleep(0.2)
    n, h = config.train.num_steps, config.model.num_heads
    with open(workdir / "metrics.jsonl", "w") as f:
      f.write(json.dumps({{"step": n, "eval/loss": 2.0 / h, "eval/ppl": 4.0 + 1.0 / h}}) + "\\n")
""")

THREE_TRIALS = textwrap.dedent("""
    from experiments import default

    def get_config(arg=None):
      return default.get_config("smoke")

    def sweep(add):
      add(name="first", **{"model.num_heads": 2})
      add(name="held", **{"model.num_heads": 4})
      add(name="lost", **{"model.num_heads": 1})
""")

def until(condition, what: str, timeout: float = 300) -> None:
  deadline = time.time() + timeout
  while not condition():
    assert time.time() < deadline, f"timed out waiting for {what}"
    time.sleep(0.1)


def trainers_started(trial_dir) -> list[str]:
  """The pids of the trainers started for a trial (HELD_TRAINER's starts.txt)."""
  path = trial_dir / "starts.txt"
  return path.read_text().split() if path.exists() else []


@pytest.fixture
def fake(tmp_path):
  (tmp_path / "fake_train.py").write_text(FAKE_TRAINER)
  (tmp_path / "exp.py").write_text(EXPERIMENT)
  return dict(config_spec=str(tmp_path / "exp.py"), trainer=(sys.executable, str(tmp_path / "fake_train.py")),
              poll_seconds=0.05)


def _runs(trial_dir):
  path = trial_dir / "runs.json"
  return json.loads(path.read_text()) if path.exists() else []


def test_parallel_trials_failures_recorded_and_rerun_skips_finished(tmp_path, fake, capsys):
  out = tmp_path / "sweep"
  statuses = sweep.run_sweep(workdir=out, parallel=2, **fake)
  assert statuses == {"h2": "done", "h4": "done", "h3": "failed"}
  (a0, a1), = _runs(out / "h2")
  (b0, b1), = _runs(out / "h4")
  assert a0 < b1 and b0 < a1, "with --parallel 2 the first two trials overlap"
  assert (out / "h2" / sweep.DONE).exists() and not (out / "h3" / sweep.DONE).exists()
  assert "three heads" in (out / "h3" / sweep.LOG).read_text()
  printed = capsys.readouterr().out
  assert "FAILED h3" in printed and "done h2" in printed and "results.png" in printed

  # The table: one row per trial, ours beside the paper's.
  rows = {r["trial"]: r for r in csv.DictReader(open(out / "results.csv"))}
  assert rows["h4"]["status"] == "done" and float(rows["h4"]["dev_ppl"]) == 4.25
  assert float(rows["h4"]["dev_bleu"]) == 24.0 and float(rows["h4"]["paper_bleu"]) == 26.0
  assert rows["h3"]["status"] == "failed" and rows["h3"]["dev_ppl"] == ""
  assert int(rows["h2"]["params"]) > 0 and rows["h2"]["overrides"] == "model.num_heads=2"
  table = (out / "results.md").read_text()
  assert "| h4 | done |" in table and "paper PPL" in table and "| h3 | failed |" in table
  assert (out / "results.png").stat().st_size > 10_000

  # Rerun: finished trials are skipped, the failed one is tried again.
  statuses = sweep.run_sweep(workdir=out, parallel=2, **fake)
  assert statuses["h3"] == "failed"
  assert len(_runs(out / "h2")) == 1 and len(_runs(out / "h4")) == 1
  assert "skip h2 (done)" in capsys.readouterr().out
  assert (out / "h3" / sweep.LOG).read_text().count("three heads") == 2


def test_bad_sweeps_fail_before_running_anything(tmp_path, fake):
  bad = tmp_path / "bad.py"
  bad.write_text(EXPERIMENT.replace('"model.num_heads": 3', '"model.num_headz": 3'))
  with pytest.raises(ValueError, match="trial 'h3'.*num_headz"):
    sweep.run_sweep(str(bad), tmp_path / "out", trainer=fake["trainer"])
  assert not (tmp_path / "out" / "h2").exists()
  bad.write_text(EXPERIMENT.replace('name="h4"', 'name="h2"'))
  with pytest.raises(ValueError, match="two trials are named 'h2'"):
    sweep.declared_trials(str(bad))
  with pytest.raises(ValueError, match="no sweep"):
    sweep.declared_trials(str(ROOT / "experiments" / "default.py"))
  with pytest.raises(ValueError, match="no trials named"):
    sweep.run_sweep(fake["config_spec"], tmp_path / "out", only=["h7"], trainer=fake["trainer"])
  with pytest.raises(SystemExit):
    sweep.main(["--config", fake["config_spec"], "--workdir", str(tmp_path), "--bogus"])


def _sweep_cli(workdir, *extra):
  env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
  # No dev BLEU (beam-search compiles would double the time; decode/ has its own tests): a shared override.
  command = [sys.executable, "-m", "jobs.sweep", f"--config={ROOT}/experiments/table3.py:smoke",
             f"--workdir={workdir}", "--config.train.bleu_every=0", *extra]
  return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


def test_table3_smoke_sweep_interrupted_then_finished(tmp_path):
  """The real trainer: stop the runner (SIGTERM) once the first trial is done and the second started;
  the rerun skips the first and finishes the second; the table and the plot cover both."""
  out = tmp_path / "table3"
  runner = _sweep_cli(out, "--parallel=1")
  deadline = time.time() + 600   # a guard against a hang, not a speed limit
  while not ((out / "base" / sweep.DONE).exists() and (out / "C_N2" / sweep.STATUS).exists()):
    assert runner.poll() is None and time.time() < deadline, runner.communicate()[0]
    time.sleep(0.1)
  runner.send_signal(signal.SIGTERM)
  first, _ = runner.communicate(timeout=600)
  assert runner.returncode == 1, first
  assert "interrupted C_N2" in first and "stopped by SIGTERM" in first, first
  assert not (out / "C_N2" / sweep.DONE).exists()
  base_log = (out / "base" / sweep.LOG).read_text()

  runner = _sweep_cli(out, "--parallel=2")
  second, _ = runner.communicate(timeout=600)
  assert runner.returncode == 0, second
  assert "skip base (done)" in second and "start C_N2" in second and "start base" not in second
  assert (out / "base" / sweep.LOG).read_text() == base_log, "the finished trial was not rerun"
  rows = {r["trial"]: r for r in csv.DictReader(open(out / "results.csv"))}
  assert {name: r["status"] for name, r in rows.items()} == {"base": "done", "C_N2": "done"}
  for r in rows.values():
    assert int(r["steps"]) == 8 and 1.0 < float(r["dev_ppl"]) < 1000, r
  assert float(rows["C_N2"]["params"]) > float(rows["base"]["params"])   # two layers instead of one
  assert float(rows["base"]["paper_ppl"]) == 4.92
  assert json.loads((out / "C_N2" / "config.json").read_text())["train"]["bleu_every"] == 0
  assert "| C_N2 | done |" in (out / "results.md").read_text()
  assert "train: 100%" in (out / "C_N2" / sweep.LOG).read_text()   # the trainer's progress lines, in its log
  assert (out / "results.png").stat().st_size > 10_000


def test_a_slurm_trials_clock_starts_when_its_job_runs(tmp_path, monkeypatch):
  """Time in SLURM's queue is not the trial's wall-clock: SlurmTrial notes when the job is first seen
  running, and the sweep measures from there."""
  from jobs import slurm
  states = iter(["PENDING", "PENDING", "RUNNING", "RUNNING", "COMPLETED"])
  clock = iter([100.0, 130.0, 175.0])
  monkeypatch.setattr(slurm, "query", lambda ids: {i: slurm.JobInfo(next(states)) for i in ids})
  with open(tmp_path / "log", "w") as log:
    trial = slurm.SlurmTrial("7", tmp_path, log)
    monkeypatch.setattr(slurm.time, "time", lambda: next(clock))
    assert trial.poll() is None and trial.poll() is None and trial.started is None   # queued
    assert trial.poll() is None and trial.started == 100.0                          # running from here
    assert trial.poll() is None and trial.started == 100.0
    assert trial.poll() == 0 and trial.started == 100.0


def test_a_slurm_job_stopped_while_queued_adds_no_wall_clock(tmp_path, monkeypatch):
  """A sweep stopped while a trial's job still waits in SLURM's queue records 0 s for it, not the time
  since submission; a job seen running counts from then, a local process from its start."""
  from jobs import slurm
  monkeypatch.setattr(sweep.time, "time", lambda: 1000.0)
  with open(tmp_path / "log", "w") as log:
    queued = slurm.SlurmTrial("7", tmp_path, log)
    running = slurm.SlurmTrial("8", tmp_path, log)
    running.started = 940.0
    trial = sweep.Trial("base", {})
    watched = [sweep._Running(trial, process, log, tmp_path) for process in (queued, running, object())]
    for r in watched:
      r.start = 900.0                     # the runner submitted or started each 100 s ago
    assert [r.seconds() for r in watched] == [0.0, 60.0, 100.0]


LOCAL_WATCHER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from jobs import sweep
    statuses = sweep.run_sweep({spec!r}, {workdir!r}, parallel=3, poll_seconds=0.1,
                               trainer=(sys.executable, {trainer!r}))
    sys.exit(0 if all(s == "done" for s in statuses.values()) else 1)
""")


def _held_sweep(tmp_path):
  """THREE_TRIALS with HELD_TRAINER under LOCAL_WATCHER: (its command, environment, sweep directory, and
  the trials' directories by name)."""
  (tmp_path / "train.py").write_text(HELD_TRAINER)
  (tmp_path / "exp.py").write_text(THREE_TRIALS)
  out = tmp_path / "sweep"
  command = [sys.executable, "-c", LOCAL_WATCHER.format(root=str(ROOT), spec=str(tmp_path / "exp.py"),
                                                        workdir=str(out), trainer=str(tmp_path / "train.py"))]
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  trials = {name: out / name for name in ("first", "held", "lost")}
  return command, env, out, trials


@pytest.mark.slow
def test_a_killed_local_sweep_rerun_starts_only_the_unfinished_trials(tmp_path):
  """Trial 'first' finishes, then the sweep command is SIGKILLed; 'held''s trainer goes on and 'lost''s
  dies too. The same command again: skips 'first' (its trial process wrote DONE), watches 'held''s
  process instead of starting a second trainer on its run directory, and starts 'lost' again."""
  command, env, out, trials = _held_sweep(tmp_path)
  watcher = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
  until(lambda: all(trainers_started(d) for d in trials.values()), "the three trainers")
  (out / "release-first").touch()
  until(lambda: (trials["first"] / "DONE").exists(), "trial first's DONE")
  watcher.kill()
  watcher.wait()
  from jobs import sweep_trial
  status = json.loads((trials["first"] / sweep.STATUS).read_text())
  assert status["status"] == "done" and status["finished_by"].startswith("local process "), status
  for pid in (sweep_trial.holder(trials["lost"]), int(trainers_started(trials["lost"])[0])):
    os.kill(pid, signal.SIGKILL)        # 'lost''s trial process and its trainer die too
  until(lambda: sweep_trial.holder(trials["lost"]) is None, "lost's trial process to end")
  assert sweep_trial.holder(trials["held"]) is not None

  rerun = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
  until(lambda: len(trainers_started(trials["lost"])) == 2 or rerun.poll() is not None, "lost's restart")
  (out / "release-held").touch()
  (out / "release-lost").touch()
  text, _ = rerun.communicate(timeout=300)
  assert rerun.returncode == 0, text
  assert "skip first (done)" in text, text
  assert {name: len(trainers_started(d)) for name, d in trials.items()} == {"first": 1, "held": 1, "lost": 2}
  assert "watching the trial's process" in (trials["held"] / sweep.LOG).read_text()
  rows = {r["trial"]: r["status"] for r in csv.DictReader(open(out / "results.csv"))}
  assert rows == {"first": "done", "held": "done", "lost": "done"}, text


@pytest.mark.slow
def test_a_local_sweep_outlives_the_hangup_of_its_terminal(tmp_path):
  """The sweep command's process group (what a closed terminal signals) gets SIGHUP while its three
  trials train: the command dies, the trials (each in a session of its own) go on; one that finishes
  meanwhile records its own result. The same command again watches the two still running, starts
  nothing twice, and records them."""
  command, env, out, trials = _held_sweep(tmp_path)
  # A session of its own stands for the terminal's: its process group is the one the hangup reaches.
  watcher = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                             start_new_session=True)
  until(lambda: all(trainers_started(d) for d in trials.values()), "the three trainers")
  os.killpg(watcher.pid, signal.SIGHUP)
  assert watcher.wait(timeout=60) == -signal.SIGHUP
  from jobs import sweep_trial
  assert all(sweep_trial.holder(d) is not None for d in trials.values()), "a trial died with the terminal"
  (out / "release-first").touch()
  until(lambda: (trials["first"] / sweep.DONE).exists(), "trial first's DONE, with no sweep command watching")
  assert sweep.read_status(trials["first"])["status"] == "done"
  assert sweep.read_status(trials["held"])["status"] == "running"   # and it is

  rerun = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  until(lambda: all("watching the trial's process" in (trials[n] / sweep.LOG).read_text() for n in ("held", "lost")),
        "the rerun to watch the two trials still running")
  (out / "release-held").touch()
  (out / "release-lost").touch()
  text, _ = rerun.communicate(timeout=300)
  assert rerun.returncode == 0, text
  assert "skip first (done)" in text, text
  assert {name: len(trainers_started(d)) for name, d in trials.items()} == {"first": 1, "held": 1, "lost": 1}
  rows = {r["trial"]: r["status"] for r in csv.DictReader(open(out / "results.csv"))}
  assert rows == {"first": "done", "held": "done", "lost": "done"}, text


def test_a_trial_process_does_not_import_the_sweep():
  """jobs.sweep imports jobs.sweep_trial (a trial's state on disk, its process), never the other way, at
  any level of the module."""
  tree = ast.parse((ROOT / "jobs" / "sweep_trial.py").read_text())
  imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
  imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
  assert not [m for m in imported if m == "jobs" or m.startswith("jobs.")], imported
  assert "sweep_trial" in (ROOT / "jobs" / "sweep.py").read_text()
