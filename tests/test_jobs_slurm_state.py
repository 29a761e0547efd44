"""SLURM's state, asked and never guessed (jobs/slurm.py), tested with fake `sbatch`, `squeue` and `sacct`
first on PATH: they record every call, answer from a small JSON file of jobs, and fail or hang on the calls
a test chooses. No job runs: the fake squeue moves each job it is asked about one state on (PENDING ->
RUNNING -> COMPLETED) and, at COMPLETED, writes the DONE marker that a trial's own job would write.
"""
import json
import os
import pathlib
import sys
import textwrap

import pytest

from jobs import slurm, sweep
from test_sweep import THREE_TRIALS

# Shared by the three fakes: FAKE_SLURM is their directory (jobs.json, calls.log, fail.json).
COMMON = textwrap.dedent("""
    import json, os, pathlib, sys, time
    home = pathlib.Path(os.environ["FAKE_SLURM"])
    name = pathlib.Path(sys.argv[0]).name
    with open(home / "calls.log", "a") as f:
      f.write(name + " " + " ".join(sys.argv[1:]) + "\\n")
    number = sum(1 for l in open(home / "calls.log") if l.split()[0] == name)
    fail = json.loads((home / "fail.json").read_text()) if (home / "fail.json").exists() else {}
    if number in fail.get(name, []):
      print(f"{name}: error: Socket timed out on send/recv operation", file=sys.stderr)
      sys.exit(1)
    if number in fail.get(name + "_hang", []):
      time.sleep(30)
    jobs = json.loads((home / "jobs.json").read_text()) if (home / "jobs.json").exists() else {}
""")

SBATCH = COMMON + textwrap.dedent("""
    job_id = str(1000 + len(jobs))
    script = pathlib.Path(sys.argv[-1])
    jobs[job_id] = {"state": "PENDING", "dir": str(script.parent.parent)}   # TRIAL_DIR/slurm/script
    (home / "jobs.json").write_text(json.dumps(jobs))
    print(f"Submitted batch job {job_id}")
""")

SQUEUE = COMMON + textwrap.dedent("""
    if os.environ.get("FAKE_SLURM_INVALID"):   # what squeue says of an id it does not know
      sys.exit(print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr) or 1)
    ids = sys.argv[sys.argv.index("-j") + 1].split(",")
    alive = [i for i, job in jobs.items() if job["state"] != "COMPLETED"]
    with open(home / "alive.log", "a") as f:   # the jobs queued or running when the sweep asked
      f.write(f"{len(alive)}\\n")
    nexts = {"PENDING": "RUNNING", "RUNNING": "COMPLETED"}
    for i in ids:
      job = jobs.get(i)
      if job is None:
        continue
      print(f"{i} {job['state']} node{int(i) % 3}")
      if os.environ.get("FAKE_SLURM_FROZEN") or job["state"] not in nexts:
        continue
      job["state"] = nexts[job["state"]]
      if job["state"] == "COMPLETED":
        (pathlib.Path(job["dir"]) / "DONE").write_text("finished by the fake job\\n")
    (home / "jobs.json").write_text(json.dumps(jobs))
""")

SACCT = COMMON + textwrap.dedent("""
    print("Slurm accounting storage is disabled", file=sys.stderr)
    sys.exit(1)
""")


class FakeSlurm:
  def __init__(self, home: pathlib.Path):
    self.home = home

  def jobs(self, **states) -> None:
    self.home.joinpath("jobs.json").write_text(json.dumps({i.removeprefix("j"): {"state": s, "dir": str(self.home)}
                                                            for i, s in states.items()}))

  def fail(self, **calls) -> None:
    """fail(squeue=[2, 3]): those calls (counted from 1 per command) exit 1; squeue_hang=[...]: they hang."""
    self.home.joinpath("fail.json").write_text(json.dumps(calls))

  def calls(self, command: str) -> list[str]:
    path = self.home / "calls.log"
    return [l for l in path.read_text().splitlines() if l.split()[0] == command] if path.exists() else []

  def alive_counts(self) -> list[int]:
    return [int(n) for n in (self.home / "alive.log").read_text().split()]


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
  home = tmp_path / "fake_slurm"
  bin_dir = home / "bin"
  bin_dir.mkdir(parents=True)
  for name, body in (("sbatch", SBATCH), ("squeue", SQUEUE), ("sacct", SACCT)):
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  monkeypatch.setenv("FAKE_SLURM", str(home))
  monkeypatch.setattr(slurm, "BACKOFF", (0.0, 0.0, 0.0))   # four tries a call, no pauses
  monkeypatch.setattr(slurm, "QUERY_TIMEOUT", 2.0)
  return FakeSlurm(home)


def _sweep(tmp_path, parallel, said):
  (tmp_path / "exp.py").write_text(THREE_TRIALS)
  options = slurm.SlurmOptions(partition="debug", time_minutes=5, cpus_per_task=1)
  start = slurm.trial_starter(options, on_success=sweep.TrialResult, poller=slurm.Poller(every=0.0, say=said.append))
  return sweep.run_sweep(str(tmp_path / "exp.py"), tmp_path / "sweep", parallel=parallel, poll_seconds=0.01,
                         trainer=("true",), start=start)


def test_a_failing_squeue_submits_nothing_twice_and_fails_no_trial(tmp_path, fake_slurm, capsys):
  # Calls 2-5 are every try of the sweep's second look at its jobs; 7-10 of its fourth: errors, then a hang.
  fake_slurm.fail(squeue=[2, 3, 4, 5, 7, 8, 9], squeue_hang=[10])
  said = []
  statuses = _sweep(tmp_path, 3, said)
  assert statuses == {"first": "done", "held": "done", "lost": "done"}, capsys.readouterr().out
  assert len(fake_slurm.calls("sbatch")) == 3
  assert [s for s in said if s.startswith("SLURM not answering since ")], said
  assert "timed out after 2 s" in " ".join(said) and "Socket timed out" in " ".join(said), said
  assert any(s.startswith("SLURM answers again") for s in said), said
  for name in ("first", "held", "lost"):
    status = sweep.read_status(tmp_path / "sweep" / name)
    assert status["status"] == "done" and status["returncode"] == 0, status
    assert "FAILED" not in (tmp_path / "sweep" / name / sweep.LOG).read_text()


def test_one_squeue_call_a_tick_for_every_watched_job(tmp_path, fake_slurm):
  fake_slurm.jobs(j7="PENDING", j8="PENDING", j9="RUNNING")
  poller = slurm.Poller(every=0.0)
  with open(tmp_path / "log", "w") as log:
    trials = [slurm.SlurmTrial(job_id, tmp_path, log, poller) for job_id in ("7", "8", "9")]
    for tick in range(2):
      assert [t.poll() for t in trials] == [None, None, 0 if tick else None]
    squeues = fake_slurm.calls("squeue")
    assert len(squeues) == 2 and all(" -j 7,8,9 " in call for call in squeues), squeues
    assert [t.nodes for t in trials] == ["node1", "node2", "node0"]
    # Job 9 ended: the next tick asks for the two still watched, in one call.
    assert [t.poll() for t in trials] == [0, 0, 0]
  assert len(fake_slurm.calls("squeue")) == 3 and " -j 7,8 " in fake_slurm.calls("squeue")[-1]


def test_a_poll_slurm_does_not_answer_leaves_the_trial_running(tmp_path, fake_slurm):
  fake_slurm.jobs(j7="RUNNING")
  fake_slurm.fail(squeue=list(range(2, 10)))   # the second and third looks: every try fails
  said = []
  poller = slurm.Poller(every=0.0, say=said.append)
  with open(tmp_path / "log", "w") as log:
    trial = slurm.SlurmTrial("7", tmp_path, log, poller)
    assert trial.poll() is None                  # RUNNING
    assert trial.poll() is None and trial.poll() is None and trial.returncode is None   # silence
    assert len(said) == 1 and said[0].startswith("SLURM not answering since "), said   # once a minute
    assert trial.poll() == 0                     # answered: COMPLETED
  with pytest.raises(slurm.NotAnswering, match="Socket timed out"):
    fake_slurm.fail(squeue=list(range(1, 100)))
    slurm.job_state("7")


def test_a_resubmission_needs_every_recorded_job_ended(tmp_path, fake_slurm):
  trial = tmp_path / "trial"
  trial.mkdir()
  (trial / slurm.JOBS_FILE).write_text("5\n6\n")
  (trial / slurm.JOB_FILE).write_text("6\n")
  fake_slurm.jobs(j5="RUNNING", j6="FAILED")   # 6, the last recorded, ended; 5 still runs
  fake_slurm.fail(squeue=[1, 2, 3, 4])         # the first look is not answered: waited out
  os.environ["FAKE_SLURM_FROZEN"] = "1"
  try:
    said = []
    assert slurm.recorded_job(trial, slurm.Silence(said.append)) == "5"
    assert said and said[0].startswith("SLURM not answering since "), said
    start = slurm.trial_starter(slurm.SlurmOptions(), poller=slurm.Poller(every=0.0))
    with open(tmp_path / "log", "w") as log:
      assert start(["true"], trial, log).job_id == "5"
    assert fake_slurm.calls("sbatch") == []
    assert " -j 5,6 " in fake_slurm.calls("squeue")[-1]
    fake_slurm.jobs(j5="CANCELLED", j6="FAILED")
    assert slurm.recorded_job(trial) is None
  finally:
    del os.environ["FAKE_SLURM_FROZEN"]


def test_parallel_bounds_the_jobs_queued_or_running_at_once(tmp_path, fake_slurm):
  statuses = _sweep(tmp_path, 2, [])
  assert statuses == {"first": "done", "held": "done", "lost": "done"}
  assert len(fake_slurm.calls("sbatch")) == 3
  assert max(fake_slurm.alive_counts()) == 2


def test_an_unknown_job_is_an_answer_only_where_one_job_was_asked_for(fake_slurm, monkeypatch):
  # squeue asked for one id it does not know exits 1 naming it; asked for several it lists those it
  # knows and exits 0, so the same error there is no answer about any of them.
  monkeypatch.setenv("FAKE_SLURM_INVALID", "1")
  assert slurm.query(["7"]) == {"7": slurm.JobInfo(slurm.ENDED)}
  with pytest.raises(slurm.NotAnswering, match="Invalid job id"):
    slurm.query(["7", "8"])
