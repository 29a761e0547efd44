"""`python -m jobs.status` on a running and on a finished local sweep: every column from the trials' own
files; --watch redraws; a finished trial's hyperparameters and metrics in TensorBoard's HParams format.
A fake trainer writes what the real one writes (config.json, metrics.jsonl with its timing keys, a
checkpoint), stops halfway until the test releases it, and finishes.
"""
import pathlib
import struct
import subprocess
import sys
import textwrap

import pytest
from tensorboardX.proto import event_pb2

from jobs import slurm, status, sweep
from test_sweep import until

ROOT = pathlib.Path(__file__).resolve().parent.parent

TRAINER = textwrap.dedent(f"""
    import json, pathlib, sys, time
    sys.path.insert(0, {str(ROOT)!r})
    import experiments
    from run import config as config_io
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    spec, workdir = args.pop("config"), pathlib.Path(args.pop("workdir"))
    config = experiments.load_experiment(spec)
    experiments.apply_overrides(config, {{k.removeprefix("config."): v for k, v in args.items()}})
    config.train.num_steps = 4
    config_io.save_config(config, workdir)
    h = config.model.num_heads

    def log(step):
      with open(workdir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({{"step": step, "train/loss": 5.0 - step / h, "train/tokens_per_sec": 1234.0 * h,
                             "train/mfu": 0.125, "train/steps_per_sec": 0.01}}) + "\\n")
        f.write(json.dumps({{"step": step, "eval/loss": 4.0 - step / h, "eval/ppl": 9.0,
                             "eval/bleu": 10.0 * step + h}}) + "\\n")
      (workdir / "checkpoints" / str(step)).mkdir(parents=True, exist_ok=True)

    log(2)
    while not (workdir.parent / ("release-" + workdir.name)).exists():
      time.sleep(0.1)
    if h == 3:
      sys.exit(print("ValueError: num_heads=3 does not divide d_model", file=sys.stderr) or 1)
    log(4)
""")

EXPERIMENT = textwrap.dedent("""
    from experiments import default

    def get_config(arg=None):
      return default.get_config("smoke")

    def sweep(add):
      add(name="h2", **{"model.num_heads": 2})
      add(name="h3", **{"model.num_heads": 3})
      add(name="h4", **{"model.num_heads": 4})
""")

WATCHER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from jobs import sweep
    sweep.run_sweep({spec!r}, {workdir!r}, parallel=2, poll_seconds=0.1, trainer=(sys.executable, {trainer!r}))
""")


def _status(capsys, *args) -> str:
  """What `python -m jobs.status ARGS` prints."""
  capsys.readouterr()
  assert status.main([str(a) for a in args]) == 0
  return capsys.readouterr().out


def _rows(table: str) -> dict:
  """{trial: {column: cell}} of a jobs.status table (columns split where the header's names start)."""
  lines = table.splitlines()
  header = next(i for i, l in enumerate(lines) if l.startswith("trial "))
  starts = [lines[header].index(c) for c in status.COLUMNS] + [None]
  cells = lambda l: [l[a:b].strip() for a, b in zip(starts, starts[1:])]
  return {cells(l)[0]: dict(zip(status.COLUMNS, cells(l))) for l in lines[header + 1:] if l.strip()}


def _events(directory: pathlib.Path) -> list:
  """Every Event in the TensorBoard event files of directory (TFRecord: length, crc, data, crc)."""
  events = []
  for path in directory.glob("events.out.tfevents.*"):
    data, i = path.read_bytes(), 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      events.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
      i += 12 + n + 4
  return events


@pytest.mark.slow
def test_status_of_a_running_and_a_finished_sweep(tmp_path, capsys):
  (tmp_path / "train.py").write_text(TRAINER)
  (tmp_path / "exp.py").write_text(EXPERIMENT)
  out = tmp_path / "sweep"
  watcher = subprocess.Popen([sys.executable, "-c", WATCHER.format(
      root=str(ROOT), spec=str(tmp_path / "exp.py"), workdir=str(out), trainer=str(tmp_path / "train.py"))],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  until(lambda: all((out / name / "checkpoints" / "2").is_dir() for name in ("h2", "h3")), "two trials halfway")

  rows = _rows(_status(capsys, out))
  assert set(rows) == {"h2", "h3", "h4"}
  assert rows["h2"]["state"].startswith("running (pid ") and rows["h4"]["state"] == "pending", rows
  assert rows["h2"]["step"] == "2/4" and rows["h2"]["train loss"] == "4.000" and rows["h2"]["dev loss"] == "3.000"
  assert rows["h2"]["dev BLEU"] == "22.00" and rows["h2"]["tok/s"] == "2468" and rows["h2"]["MFU"] == "12.5%"
  assert rows["h2"]["ETA"] == "3m"   # 2 steps left at 0.01 steps/s
  assert rows["h2"]["ckpt age"].endswith("s"), rows["h2"]

  # --watch draws again after its interval.
  watched = _status(capsys, out / "h2", "--watch", "0.2", "--count", "2")
  assert watched.count(f"{out / 'h2'} at ") == 2 and watched.count("\nh2 ") == 2, watched

  for name in ("h2", "h3", "h4"):
    (out / f"release-{name}").touch()
  printed, _ = watcher.communicate(timeout=300)
  assert watcher.returncode == 0, printed
  rows = _rows(_status(capsys, out))
  assert rows["h2"]["state"] == "done" and rows["h2"]["step"] == "4/4" and rows["h4"]["dev BLEU"] == "44.00", rows
  assert rows["h2"]["ETA"] == "-"
  assert rows["h3"]["state"] == "failed: ValueError: num_heads=3 does not divide d_model", rows

  # TensorBoard's HParams view: the trial's overrides and its final metrics, in tb/hparams.
  events = _events(out / "h4" / "tb" / sweep.HPARAMS)
  plugins = [v for e in events for v in e.summary.value if v.metadata.plugin_data.plugin_name == "hparams"]
  assert any(b"model.num_heads" in v.metadata.plugin_data.content for v in plugins), plugins
  scalars = {v.tag: v.simple_value for e in events for v in e.summary.value if v.HasField("simple_value")}
  assert scalars["hparams/dev_bleu"] == 44.0 and scalars["hparams/train_loss"] == 4.0, scalars
  assert not (out / "h3" / "tb").exists()   # a failed trial has no final metrics


def test_the_state_of_a_slurm_trial_is_what_slurm_said(tmp_path):
  (tmp_path / slurm.JOBS_FILE).write_text("41\n42\n")
  (tmp_path / slurm.FOLDER).mkdir()
  running = {"status": "running"}
  say = lambda **jobs: status.state_of(tmp_path, running, {k[1:]: slurm.JobInfo(*v) for k, v in jobs.items()})
  assert say(j41=("CANCELLED",), j42=("PENDING",)) == ("queued (job 42)", False)
  assert say(j41=("RUNNING", "gpu7"), j42=("FAILED",)) == ("running (job 41 on gpu7)", True)
  assert say(j41=("CANCELLED",), j42=("REQUEUED",)) == ("preempted, requeued (job 42)", False)
  slurm.task_log(tmp_path, "42").write_text("...\nRequeued job 42 (1 remaining timeouts)\n")
  assert say(j41=("CANCELLED",), j42=("RUNNING", "gpu1")) == ("running (job 42 on gpu1, requeued)", True)
  slurm.task_log(tmp_path, "42").with_suffix(".err").write_text("Traceback\nRuntimeError: out of memory\n")
  assert say(j41=("CANCELLED",), j42=("FAILED",)) == ("failed (job 42 FAILED): RuntimeError: out of memory", False)
  assert status.state_of(tmp_path, running, "SLURM not answering (squeue timed out)") == \
      ("running (SLURM not answering (squeue timed out))", True)
  (tmp_path / sweep.DONE).write_text("finished\n")
  assert say(j41=("CANCELLED",), j42=("COMPLETED",)) == ("done", False)


def test_the_trials_of_a_sweep_a_search_and_a_run(tmp_path):
  sweep_dir, search_dir = tmp_path / "sweep", tmp_path / "search"
  for d in (sweep_dir / "b", sweep_dir / "extra", search_dir / "trial_0001", search_dir / "trial_0000"):
    d.mkdir(parents=True)
    (d / sweep.LOG).write_text("$ python -m train ...\n")
  (sweep_dir / "results.csv").write_text("trial,status\nb,running\na,pending\n")
  (search_dir / "results.csv").write_text("trial,status,run_dir\n0,failed,trial_0000\n1,complete,trial_0001\n"
                                          "2,complete,trial_0000\n3,waiting,\n")
  assert [n for n, _ in status.trials_of(sweep_dir)] == ["b", "a", "extra"]
  assert [n for n, _ in status.trials_of(search_dir)] == ["trial_0000", "trial_0001"]
  assert status.trials_of(sweep_dir / "b") == [("b", sweep_dir / "b")]
  table = status.render(sweep_dir)
  assert "3 trials" in table and "\na  " in table and "pending" in table, table
