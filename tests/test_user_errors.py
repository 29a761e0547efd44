"""A user's mistake ends `python -m train`, `python -m decode`, the export and the sweep in one readable
line on stderr, `error: ...`, with exit status 2 and no traceback."""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import warnings

import pytest

from run import user_errors

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMOKE = str(ROOT / "experiments" / "default.py") + ":smoke"


def run(module, *args, cwd):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
  result = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
  return result.returncode, result.stderr.strip().splitlines(), result.stdout


def assert_user_error(outcome, *fragments):
  code, lines, _ = outcome
  assert code == 2, lines[-20:]
  assert lines and "error: " in lines[-1], lines[-20:]   # `error: ...` or argparse's `prog: error: ...`
  assert not any("Traceback" in line for line in lines), lines
  for fragment in fragments:
    assert fragment in lines[-1], lines[-1]


@pytest.fixture
def files(tmp_path):
  (tmp_path / "ok.tsv").write_text("".join(f"word {i} here\twort {i} hier\n" for i in range(40)))
  (tmp_path / "src.txt").write_text("a\nb\nc\n")
  (tmp_path / "tgt.txt").write_text("x\ny\n")
  (tmp_path / "empty.tsv").write_text("")
  return tmp_path


def train_with(files, train, dev, extra=()):
  return run("train", f"--config={SMOKE}", f"--workdir={files / 'run'}", "--config.data.source=files",
             f"--config.data.train_path={train}", f"--config.data.dev_path={dev}",
             f"--config.data.test_path={files / 'ok.tsv'}", "--config.data.vocab_size=60",
             "--config.train.progress=False", *extra, cwd=files)


def test_train_misspelled_config_key(files):
  assert_user_error(run("train", f"--config={SMOKE}", "--config.data.trian_path=x.tsv", cwd=files),
                    "data.trian_path", "did you mean 'train_path'")


def test_train_missing_experiment_file_and_unknown_arg(files):
  assert_user_error(run("train", "--config=experiments/nope.py", cwd=files), "nope.py", "does not exist")
  assert_user_error(run("train", f"--config={SMOKE}x", cwd=files), "unknown arg 'smokex'")


def test_train_missing_file_after_a_hint_naming_the_small_corpus_experiment(files):
  outcome = train_with(files, "x.tsv", files / "ok.tsv")
  assert_user_error(outcome, "error: config.data.train_path: file 'x.tsv' does not exist")
  assert "experiments/small_corpus.py" in outcome[2]   # the default experiment on the user's files


def test_train_misaligned_files(files):
  assert_user_error(train_with(files, f"{files / 'src.txt'},{files / 'tgt.txt'}", files / "ok.tsv"),
                    "config.data.train_path", "3 lines", "2", "line-aligned")


def test_train_empty_dev_set(files):
  assert_user_error(train_with(files, files / "ok.tsv", files / "empty.tsv"), "config.data.dev_path",
                    "no usable sentence pairs")


def test_train_with_a_data_cache_that_cannot_be_written(files, monkeypatch):
  (files / "a_file").write_text("a file where the cache root's parent folder should be")
  monkeypatch.setenv("AIAYN_DATA_CACHE", str(files / "a_file" / "cache"))   # even root cannot write there
  outcome = train_with(files, files / "ok.tsv", files / "ok.tsv")
  assert_user_error(outcome, str(files / "a_file" / "cache"), "cannot be written", "set AIAYN_DATA_CACHE")


def test_decode_and_export_of_a_missing_run(files):
  (files / "in.txt").write_text("hello\n")
  assert_user_error(run("decode", "--workdir", str(files / "nowhere"), "--input", str(files / "in.txt"),
                        "--output", str(files / "out.txt"), cwd=files), "nowhere")
  assert_user_error(run("export", "--workdir", str(files / "nowhere"), "--format", "hf", "--out",
                        str(files / "hf"), cwd=files), "nowhere")


def test_sweep_misspelled_key(files):
  assert_user_error(run("jobs.sweep", f"--config={ROOT / 'experiments' / 'table3.py'}:smoke",
                        f"--workdir={files / 'sweep'}", "--config.train.num_stepz=3", cwd=files),
                    "num_stepz")


def test_bugs_keep_their_tracebacks():
  with pytest.raises(ZeroDivisionError):
    with user_errors.reported():
      1 / 0
  with pytest.raises(SystemExit) as exit_info:
    with user_errors.reported():
      raise user_errors.UserError("two\nlines")
  assert exit_info.value.code == 2


# ------------------------------------------------------------------------------------------------------
# A run directory that is wrong in some way: every file run/ reads, and every way it can be wrong. Each
# case ends in one line naming the file and what to do, exit status 2, and nothing changed on disk.
# ------------------------------------------------------------------------------------------------------
MODEL = dict(d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1)


def _config():
  from experiments import default
  config = default.get_config("smoke")
  config.model.update(MODEL)
  config.train.update(progress=False, num_steps=1)
  return config


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
  """A run directory as `python -m train` leaves it, with one checkpoint (step 7) of a tiny model."""
  import jax
  import jax.numpy as jnp

  from data.vocab import Vocab, train_vocab
  from model import Transformer
  from run import checkpoint as ckpt, model_config
  from run.config import save_config
  workdir = tmp_path_factory.mktemp("good") / "run"
  workdir.mkdir()
  texts = [f"word{i % 17} and word{i % 5} then word{i % 11}" for i in range(200)]
  (workdir / "vocab.model").write_bytes(train_vocab(texts, 60, seed=0, sample_sentences=200))
  vocab = Vocab.load(workdir / "vocab.model")
  other = train_vocab([t.replace("word", "term") for t in texts], 60, seed=0, sample_sentences=200)
  (workdir.parent / "other_vocab.model").write_bytes(other)
  config = _config()
  save_config(config, workdir)
  ids = jnp.ones((1, 4), jnp.int32)
  params = Transformer(model_config(config, vocab.size)).init({"params": jax.random.key(0)}, ids, ids)["params"]
  manager = ckpt.make_manager(workdir, async_save=False)
  ckpt.save(manager, 7, params, None, {"step": 7, "vocab_fingerprint": vocab.fingerprint})
  manager.wait_until_finished()
  manager.close()
  (workdir / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\n{"step": 7, "train/loss": 1.0}\n')
  (workdir / "LOCK").write_text("pid 1 on host\n")   # what a finished trainer leaves
  return workdir


def _write(name, data):
  def damage(run):
    path = run / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
  return damage


def _cut(name):
  def damage(run):
    path = run / name
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
  return damage


def _remove(name):
  def damage(run):
    path = run / name
    shutil.rmtree(path) if path.is_dir() else path.unlink()
  return damage


def _make_dir(name):
  def damage(run):
    _remove(name)(run) if (run / name).exists() else None
    (run / name).mkdir()
  return damage


def _edit_json(name, change):
  def damage(run):
    path = run / name
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
  return damage


def _empty_files_under(name):
  def damage(run):
    for path in (run / name).rglob("*"):
      if path.is_file():
        path.write_bytes(b"")
  return damage


def _other_vocab(run):
  shutil.copy(run.parent / "other_vocab.model", run / "vocab.model")


def _model_key(key, value):
  return _edit_json("config.json", lambda c: {**c, "model": {**c["model"], key: value}})


META = "checkpoints/7/meta/metadata"
# (name, how the run directory is wrong, the command that reads it, what the one line must say)
CASES = [
    ("workdir missing", lambda run: shutil.rmtree(run), "decode", ["does not exist", "python -m train"]),
    ("workdir is a file", lambda run: (shutil.rmtree(run), run.write_text("x")), "decode",
     ["is not a directory"]),
    ("config.json missing", _remove("config.json"), "decode", ["config.json not found"]),
    ("config.json empty", _write("config.json", ""), "decode", ["config.json is not valid JSON"]),
    ("config.json truncated", _cut("config.json"), "decode", ["config.json is not valid JSON", "line"]),
    ("config.json not UTF-8", _write("config.json", b"\xff\xfe{}"), "decode", ["config.json is not UTF-8"]),
    ("config.json a directory", _make_dir("config.json"), "decode", ["config.json is a directory"]),
    ("config.json a list", _write("config.json", "[1, 2]"), "decode", ["config.json is not a run's config"]),
    ("config.json without model", _edit_json("config.json", lambda c: {**c, "model": 3}), "decode",
     ["config.json is not a run's config", "model"]),
    ("config.json unknown model key", _model_key("d_modle", 3), "decode",
     ["config.json: its model section does not describe a model", "d_modle"]),
    ("config.json wrong type", _model_key("d_model", "big"), "decode",
     ["config.json: its model section does not describe a model", "big"]),
    ("vocab.model missing", _remove("vocab.model"), "decode", ["vocab.model not found"]),
    ("vocab.model empty", _write("vocab.model", b""), "decode", ["vocab.model is not a SentencePiece"]),
    ("vocab.model truncated", _cut("vocab.model"), "decode", ["vocab.model is not a SentencePiece"]),
    ("vocab.model of another run", _other_vocab, "decode", ["is not the vocabulary", "vocab.model"]),
    ("checkpoints missing", _remove("checkpoints"), "decode", ["no checkpoints in", "checkpoints"]),
    ("checkpoints a file", lambda run: (_remove("checkpoints")(run), _write("checkpoints", "x")(run)), "decode",
     ["no checkpoints in"]),
    ("checkpoints empty", lambda run: (_remove("checkpoints")(run), (run / "checkpoints").mkdir()), "decode",
     ["holds no complete checkpoint"]),
    ("checkpoint files gone", _remove("checkpoints/7/params"), "decode", ["checkpoints/7 is unreadable"]),
    ("checkpoint files emptied", _empty_files_under("checkpoints/7/params"), "decode",
     ["checkpoints/7 is unreadable"]),
    ("step not saved", None, "decode --checkpoint 99", ["no checkpoint for step 99", "[7]"]),
    ("no average", None, "decode --checkpoint averaged", ["train.average"]),
    ("meta not JSON", _write(META, "{"), "decode", ["meta/metadata is not the JSON object"]),
    ("meta fingerprint edited", _edit_json(META, lambda m: {**m, "vocab_fingerprint": "0" * 16}), "decode",
     ["is not the vocabulary"]),
    ("average: workdir missing", lambda run: shutil.rmtree(run), "average", ["does not exist"]),
    ("average: no checkpoints", _remove("checkpoints"), "average", ["no checkpoints in"]),
    ("average: checkpoint damaged", _remove("checkpoints/7/params"), "average", ["checkpoints/7 is unreadable"]),
    ("train: workdir is a file", lambda run: (shutil.rmtree(run), run.write_text("x")), "train",
     ["is a file, not a directory"]),
    ("train: LOCK a directory", _make_dir("LOCK"), "train", ["cannot open the lock file", "LOCK"]),
    ("train: config.json not JSON", _cut("config.json"), "train", ["config.json is not valid JSON"]),
    ("train: vocab.model damaged", _cut("vocab.model"), "train", ["vocab.model is not a SentencePiece"]),
    ("metrics.jsonl edited", _write("metrics.jsonl", '{"step": 1}\nnot json\n{"step": 2}\n'), "metrics",
     ["metrics.jsonl line 2 is not JSON"]),
    ("metrics.jsonl without steps", _write("metrics.jsonl", '{"step": 1}\n[3]\n'), "metrics",
     ["metrics.jsonl line 2 is not a metrics record"]),
]


def _command(command, run, tmp_path):
  """Runs one command on the run directory in this process, as its entry point does."""
  name, *args = command.split()
  if name == "decode":
    from decode.__main__ import main
    main(["--workdir", str(run), "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.txt"),
          *args])
  elif name == "average":
    from train.average import main
    main(["--workdir", str(run), "--last", "1"])   # the run has one checkpoint: more is refused before reading
  elif name == "train":
    from train.train import train_and_evaluate
    with user_errors.reported():
      train_and_evaluate(_config(), run)
  elif name == "metrics":
    from run.metrics import read_metrics
    with user_errors.reported():
      read_metrics(run)


def _snapshot(root: pathlib.Path) -> dict:
  """Every path under root and its bytes; the LOCK only by name (a trainer writes its pid there)."""
  return {str(p.relative_to(root)): p.read_bytes() if p.is_file() and p.name != "LOCK" else None
          for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case, damage, command, fragments", CASES, ids=[c[0] for c in CASES])
def test_a_wrong_run_directory_ends_in_one_line_and_changes_nothing(case, damage, command, fragments, good_run,
                                                                     tmp_path, capsys):
  run = tmp_path / "run"
  shutil.copytree(good_run, run)
  shutil.copy(good_run.parent / "other_vocab.model", tmp_path)
  (tmp_path / "in.txt").write_text("word1 and word2\n")
  if damage:
    damage(run)
  before = _snapshot(tmp_path)
  with pytest.raises(SystemExit) as exit_info:
    _command(command, run, tmp_path)
  lines = capsys.readouterr().err.strip().splitlines()
  assert exit_info.value.code == 2, lines
  assert len(lines) == 1 and lines[0].startswith("error: "), lines
  for fragment in fragments:
    assert fragment in lines[0], lines[0]
  assert _snapshot(tmp_path) == before


def test_the_good_run_reads_and_a_cut_short_last_metrics_line_is_left_out(good_run, tmp_path):
  import run as run_lib
  from run.metrics import read_metrics
  opened = run_lib.load_run(good_run)
  assert opened.step == 7 and opened.model.cfg.d_model == MODEL["d_model"]
  shutil.copytree(good_run, tmp_path / "run")
  with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
    f.write('{"step": 9, "train/lo')   # a kill while the line was written
  assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 7]


def test_a_warning_inside_an_entry_point_reads_as_one_line(capsys):
  with warnings.catch_warnings():
    warnings.simplefilter("always")
    before = warnings.showwarning
    with user_errors.reported():
      warnings.warn("config.data train: skipped 3 pairs:\n  3 longer than max_len=8 tokens", stacklevel=1)
    assert warnings.showwarning is before   # the usual format again once the entry point is done
  assert capsys.readouterr().err == "warning: config.data train: skipped 3 pairs: 3 longer than max_len=8 tokens\n"
