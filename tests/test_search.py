"""Optuna search (jobs/search.py): a study with pruning, resumed, shared by two workers, a worker killed
mid-trial, a failing trial recorded, the report. Scheduling is tested with a fast fake trainer that writes
metrics.jsonl like the real one and saves a "checkpoint" on SIGTERM; the slow tests run the real trainer
(a pruned trial's run directory resumes by hand) and SLURM.
"""
import csv
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import optuna
import pytest

from run import metrics as metrics_io
from files_config import clean_env
from jobs import search, search_trial, sweep

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A stand-in for `python -m train` without JAX (~0.1 s to start): num_steps evaluations 0.1 s apart, dev
# loss falling with the step, lowest at learning rate 1e-2; SIGTERM saves checkpoints/STEP and exits 0;
# a rerun resumes from the last one; model.num_heads=3 fails with exit 1.
FAKE_TRAINER = textwrap.dedent("""
    import fcntl, json, math, os, pathlib, signal, sys, time
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    workdir = pathlib.Path(args["workdir"])
    workdir.mkdir(parents=True, exist_ok=True)
    lock = open(workdir / "LOCK", "a+")   # held to the end, as python -m train holds its run directory
    fcntl.flock(lock, fcntl.LOCK_EX)      # (run/workdir.RunLock): a retry waits for a stopped trainer's save
    lr, heads = float(args.get("config.train.learning_rate", 1e-3)), int(args.get("config.model.num_heads", 2))
    steps = int(args.get("config.train.num_steps", 6))
    if heads == 3:
      sys.exit(print("ValueError: num_heads=3 does not divide d_model=32", file=sys.stderr) or 1)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").glob("*"))
    start = saved[-1] if saved else 0
    old = (workdir / "metrics.jsonl").read_text().splitlines() if (workdir / "metrics.jsonl").exists() else []
    with open(workdir / "metrics.jsonl", "w") as f:
      f.writelines(l + "\\n" for l in old if json.loads(l)["step"] <= start)
    print(f"resumed from step {start}" if start else "fresh run", flush=True)
    step = start   # a run that had finished resumes with nothing left to do
    with open(workdir / "metrics.jsonl", "a") as f:
      for step in range(start + 1, steps + 1):
        time.sleep(float(os.environ.get("FAKE_STEP_SECONDS", "0.1")))
        loss = 2.0 + abs(math.log10(lr) + 2.0) + 1.0 / step
        line = {"step": step, "eval/loss": loss + 0.1, "eval/nll": loss, "eval/bleu": 30.0 - loss}
        f.write(json.dumps(line) + "\\n")
        f.flush()
        if stop:
          break
    (workdir / "checkpoints" / str(step)).mkdir(parents=True, exist_ok=True)
    print(f"saved step {step}", flush=True)
""")

EXPERIMENT = textwrap.dedent("""
    from experiments import default

    def get_config(arg=None):
      config = default.get_config("smoke")
      config.train.update(num_steps=6, eval_every=1)
      return config

    def search_space(trial):
      return {"train.learning_rate": trial.suggest_float("train.learning_rate", 1e-4, 1.0, log=True),
              "model.num_heads": trial.suggest_categorical("model.num_heads", [1, 2, 4])}
""")


@pytest.fixture
def fake(tmp_path):
  """run_search's arguments for the fake trainer and the experiment above, written to tmp_path."""
  for name, text in {"fake_train.py": FAKE_TRAINER, "exp.py": EXPERIMENT}.items():
    (tmp_path / name).write_text(text)
  trainer = (sys.executable, str(tmp_path / "fake_train.py"))
  return {"config_spec": str(tmp_path / "exp.py"), "trainer": trainer, "poll_seconds": 0.05}


def _csv(workdir):
  return list(csv.DictReader(open(workdir / "results.csv")))


def _study(workdir):
  return optuna.load_study(study_name=workdir.name, storage=optuna.storages.JournalStorage(
      optuna.storages.journal.JournalFileBackend(str(workdir / search.JOURNAL))))


def test_study_prunes_reports_and_resumes(tmp_path, fake, capsys):
  out = tmp_path / "study"
  counts = search.run_search(workdir=out, trials=4, seed=0, baseline_first=True, **fake)
  assert sum(counts.values()) == 4 and counts.get("complete", 0) >= 1, counts
  assert _study(out).trials[0].params == {"train.learning_rate": 2e-3, "model.num_heads": 2}   # smoke's own
  # Rerunning with a larger total continues the same study: trials 0-3 are kept, 4-5 added.
  counts = search.run_search(workdir=out, trials=6, seed=0, **fake)
  assert sum(counts.values()) == 6 and counts.get("pruned", 0) >= 1, counts
  printed = capsys.readouterr().out
  assert "6/6 trials done" in printed and "best configuration" in printed
  study = _study(out)
  assert [t.number for t in study.trials] == list(range(6))
  rows = _csv(out)
  assert [r["status"] for r in rows][:counts["complete"]] == ["complete"] * counts["complete"]
  complete = [float(r["dev_nll"]) for r in rows if r["status"] == "complete"]
  assert complete == sorted(complete) and complete[0] == pytest.approx(study.best_value)
  for r in rows:
    trial_dir = out / r["run_dir"]
    if r["status"] == "pruned":   # stopped early, with a checkpoint, and resumable
      assert int(r["steps_trained"]) < 6 and (trial_dir / "checkpoints").is_dir()
      assert sweep.read_status(trial_dir)["status"] == "pruned"
    else:
      assert int(r["steps_trained"]) == 6 and (trial_dir / sweep.DONE).exists()
    assert float(r["wall_clock_s"]) > 0.1
  best = study.best_trial
  table = (out / "results.md").read_text()
  assert f"--config.train.learning_rate={best.params['train.learning_rate']}" in table
  assert "python -m train --config=" in table and "![history](history.png)" in table
  assert "Trial 0 ran the experiment's own settings" in table
  for png in ("history.png", "params.png", "dev_by_step.png"):
    assert (out / png).stat().st_size > 5_000, png


def test_fixed_key_and_failing_trial_recorded(tmp_path, fake):
  out = tmp_path / "fails"
  counts = search.run_search(workdir=out, trials=2, shared=["--config.model.num_heads=3"], **fake)
  assert counts == {"failed": 2}
  study = _study(out)
  for trial in study.trials:
    assert "model.num_heads" not in trial.params and "train.learning_rate" in trial.params
    assert trial.user_attrs["error"] == "ValueError: num_heads=3 does not divide d_model=32"
  assert _csv(out)[0]["error"].startswith("ValueError: num_heads=3")
  # The study remembers what it was started with.
  with pytest.raises(ValueError, match="was started with"):
    search.run_search(workdir=out, trials=3, **fake)


def test_bad_input_is_one_line(tmp_path, fake):
  with pytest.raises(ValueError, match="has no search_space"):
    search.run_search(str(ROOT / "experiments" / "table3.py"), tmp_path / "a", trials=1)
  bad = tmp_path / "bad.py"
  bad.write_text(EXPERIMENT.replace('"model.num_heads": trial', '"model.num_headz": trial'))
  with pytest.raises(ValueError, match="search_space.*num_headz"):
    search.run_search(str(bad), tmp_path / "b", trials=2, trainer=fake["trainer"])
  with pytest.raises(ValueError, match="bleu_every"):
    search.run_search(fake["config_spec"], tmp_path / "c", trials=1, metric="dev_bleu",
                      shared=["config.train.bleu_every=0"])
  with pytest.raises(SystemExit):
    search.main(["--config", fake["config_spec"], "--workdir", str(tmp_path), "--trials", "0"])


def test_interrupted_study_requeues_its_trial_and_the_rerun_resumes_it(tmp_path, fake):
  out = tmp_path / "stopped"
  def interrupt():
    while not list(out.glob("trial_0000/checkpoints")) and not (out / "trial_0000" / "metrics.jsonl").exists():
      time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGINT)   # Ctrl-C: run_search's flag, not a KeyboardInterrupt
  threading.Thread(target=interrupt, daemon=True).start()
  counts = search.run_search(workdir=out, trials=2, **fake)
  assert counts == {"requeued": 1, "queued": 1}, counts
  assert sweep.read_status(out / "trial_0000")["status"] == "interrupted"
  assert list((out / "trial_0000" / "checkpoints").glob("*"))
  counts = search.run_search(workdir=out, trials=2, **fake)
  assert counts.get("requeued") == 1 and sum(counts.values()) == 3 and "queued" not in counts, counts
  assert "resumed from step" in (out / "trial_0000" / sweep.LOG).read_text()
  assert sorted(r["run_dir"] for r in _csv(out)) == ["trial_0000", "trial_0000", "trial_0002"]


def _worker(fake, out, trials, stale_after=60.0):
  code = textwrap.dedent(f"""
      import sys; sys.path.insert(0, {str(ROOT)!r})
      from jobs import search
      search.run_search({fake['config_spec']!r}, {str(out)!r}, trials={trials}, trainer={fake['trainer']!r},
                        poll_seconds=0.05, stale_after={stale_after})
  """)
  return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env={**os.environ, "FAKE_STEP_SECONDS": "0.2"})


def test_two_workers_share_a_study_and_a_killed_worker_trial_is_resumed(tmp_path, fake):
  out = tmp_path / "shared"
  a, b = _worker(fake, out, 3), _worker(fake, out, 3)
  # Kill worker a outright in the middle of its first trial: its trainer goes on in a session of its own;
  # the trial is found stale and queued again, and the retry watches that trainer, or, if it has ended
  # meanwhile, resumes its run from the checkpoint it saved. The trainer never starts afresh twice.
  deadline = time.time() + 600   # a guard against a hang, not a speed limit: a loaded 2-core machine is slow
  while not any(str(sweep.read_status(d).get("worker")).endswith(f":{a.pid}") and "fresh run" in
                (d / sweep.LOG).read_text() for d in out.glob("trial_*") if (d / sweep.LOG).is_file()):
    assert time.time() < deadline and a.poll() is None and b.poll() is None
    time.sleep(0.05)
  a.kill()
  a.wait()
  text_b, _ = b.communicate(timeout=600)
  assert b.returncode == 0, text_b
  study = _study(out)
  numbers = [t.number for t in study.trials]
  assert len(set(numbers)) == len(numbers)
  requeued = [t for t in study.trials if t.user_attrs.get("requeued")]
  assert len(requeued) == 1 and "stopped mid-trial" in requeued[0].user_attrs["error"], text_b
  retry = next(t for t in study.trials if t.user_attrs.get("retry_of") == requeued[0].number)
  assert retry.state == optuna.trial.TrialState.COMPLETE or retry.state == optuna.trial.TrialState.PRUNED
  assert retry.user_attrs["run_dir"] == requeued[0].user_attrs["run_dir"]
  log = (out / retry.user_attrs["run_dir"] / sweep.LOG).read_text()
  assert "resumed from step" in log or "watching the trial's process" in log, log
  assert log.count("fresh run") == 1, log
  assert retry.params == requeued[0].params
  # Every other trial ran once, in its own directory: two workers never ran the same trial.
  dirs = [t.user_attrs["run_dir"] for t in study.trials if not t.user_attrs.get("requeued")]
  assert len(dirs) == len(set(dirs)) == 3
  for d in dirs:
    assert (out / d / sweep.LOG).read_text().count("$ ") == (2 if d == retry.user_attrs["run_dir"] else 1)


@pytest.mark.slow
def test_pruned_real_trial_resumes_by_hand(tmp_path):
  """A real `python -m train` trial pruned at its first evaluation (a pruner that always prunes): it
  saved a checkpoint, and its command, rerun by hand, resumes the run and finishes it."""
  out = tmp_path / "real"
  spec = str(ROOT / "experiments" / "default.py") + ":smoke"
  shared = ["config.train.num_steps=120", "config.train.eval_every=30", "config.train.log_every=30",
            "config.train.bleu_every=0", "config.train.test_bleu=False", "config.train.tensorboard=False",
            "config.train.checkpoint_every_steps=1000"]
  original = search.make_pruner
  search.make_pruner = lambda *args: optuna.pruners.ThresholdPruner(upper=0.0)
  try:
    counts = search.run_search(spec, out, trials=1, shared=shared, poll_seconds=0.2)
  finally:
    search.make_pruner = original
  assert counts == {"pruned": 1}
  trial_dir = out / "trial_0000"
  saved = [int(p.name) for p in (trial_dir / "checkpoints").iterdir() if p.name.isdigit()]
  assert len(saved) == 1 and 30 <= saved[0] < 120, saved   # the step SIGTERM stopped it at
  command = sweep.read_status(trial_dir)["command"]
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  steps = [l["step"] for l in metrics_io.read_metrics(trial_dir) if "eval/loss" in l]
  assert steps == [30, 60, 90, 120], steps
  assert sweep.read_status(trial_dir)["status"] == "pruned"


@pytest.mark.parametrize("name", ["default.py", "small_corpus.py"])
def test_shipped_search_spaces_set_existing_keys(name):
  path = str(ROOT / "experiments" / name)
  space = search_trial.search_space_of(path)
  study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
  for _ in range(3):
    trial = study.ask()
    overrides = search_trial.trial_overrides(space, trial, {"train.num_steps": 7}, path)
    assert overrides and "train.num_steps" not in overrides and set(overrides) == set(trial.params)
    study.tell(trial, 1.0)


def slurm_problem():
  sys.path.insert(0, str(ROOT / "tests"))
  from test_slurm import slurm_problem as problem   # one definition of "a SLURM cluster answers"
  return problem()


@pytest.mark.slow
def test_study_on_slurm(tmp_path, fake):
  """The 6-trial smoke study with every trial a SLURM job; pruned trials get SIGTERM through scancel."""
  problem = slurm_problem()
  if problem:
    pytest.skip(problem)
  out = tmp_path / "slurm"
  options = search.slurm.SlurmOptions(partition="debug", time_minutes=10)
  env = clean_env(FAKE_STEP_SECONDS="1.0")
  old = dict(os.environ)
  os.environ.clear()
  os.environ.update(env)   # sbatch passes the submitting environment on
  try:
    counts = search.run_search(fake["config_spec"], out, trials=6, parallel=3, seed=0, trainer=fake["trainer"],
                               start=search.slurm.trial_starter(options), poll_seconds=0.5)
  finally:
    os.environ.clear()
    os.environ.update(old)
  assert sum(counts.values()) == 6 and counts.get("complete", 0) >= 1 and counts.get("pruned", 0) >= 1, counts
  for r in _csv(out):
    trial_dir = out / r["run_dir"]
    job = (trial_dir / search.slurm.JOB_FILE).read_text().strip()
    assert search.slurm.job_state(job) in ("COMPLETED", search.slurm.ENDED), (job, r)
    assert (int(r["steps_trained"]) < 6) == (r["status"] == "pruned"), r
    assert (trial_dir / "checkpoints").is_dir(), r
