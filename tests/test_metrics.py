"""run/metrics.py: the TensorBoard scalars the trainer writes, without importing PyTorch."""
import json
import subprocess
import sys
import textwrap

from files_config import clean_env

# In a fresh process: the writer writes its scalars, has not imported torch, and leaves it importable.
WRITER = textwrap.dedent("""\
    import json, sys
    from run import metrics
    writer = metrics.MetricsWriter(sys.argv[1])
    writer.write(3, {"train/loss": 2.5, "eval/bleu": 40.0})
    writer.close()
    imported_by_writer = "torch" in sys.modules
    import torch   # still importable after the writer
    print(json.dumps([imported_by_writer, torch.__name__]))
""")


def test_tensorboard_scalars_are_written_without_importing_torch(tmp_path):
  done = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path)], capture_output=True, text=True,
                        env=clean_env(), check=True)
  assert json.loads(done.stdout.splitlines()[-1]) == [False, "torch"]
  # The event file holds both scalars at step 3 (read with tensorboardX's own protobuf, torch allowed here).
  from tensorboardX.proto import event_pb2
  (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
  data, scalars = events.read_bytes(), {}
  while data:   # TFRecord: length (8 bytes), its crc (4), the record, its crc (4)
    length = int.from_bytes(data[:8], "little")
    event = event_pb2.Event.FromString(data[12:12 + length])
    data = data[16 + length:]
    for value in event.summary.value:
      scalars[value.tag] = (event.step, value.simple_value)
  assert scalars == {"train/loss": (3, 2.5), "eval/bleu": (3, 40.0)}
  assert json.loads((tmp_path / "metrics.jsonl").read_text())["train/loss"] == 2.5


# A sweep trial's hyperparameters for TensorBoard's HParams view, from a fresh process: torch stays out.
HPARAMS = textwrap.dedent("""\
    import json, pathlib, sys
    from jobs import sweep_trial
    trial = pathlib.Path(sys.argv[1])
    (trial / "metrics.jsonl").write_text(json.dumps({"step": 4, "eval/loss": 1.5}) + "\\n")
    sweep_trial.write_hparams(trial, {"model.num_heads": 4})
    print(json.dumps(["torch" in sys.modules]))
""")


def test_a_sweep_trials_hparams_are_written_without_importing_torch(tmp_path):
  done = subprocess.run([sys.executable, "-c", HPARAMS, str(tmp_path)], capture_output=True, text=True,
                        env=clean_env(), check=True)
  assert json.loads(done.stdout.splitlines()[-1]) == [False]
  (events,) = (tmp_path / "tb" / "hparams").glob("events.out.tfevents.*")
  assert b"model.num_heads" in events.read_bytes() and b"hparams/dev_loss" in events.read_bytes()
