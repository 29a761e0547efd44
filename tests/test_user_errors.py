"""A user's mistake ends `python -m train`, `python -m decode`, the export and the sweep in one readable
line on stderr, `error: ...`, with exit status 2 and no traceback."""
import os
import pathlib
import subprocess
import sys

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


def test_decode_and_export_of_a_missing_run(files):
  (files / "in.txt").write_text("hello\n")
  assert_user_error(run("decode", "--workdir", str(files / "nowhere"), "--input", str(files / "in.txt"),
                        "--output", str(files / "out.txt"), cwd=files), "nowhere")
  assert_user_error(run("export", "--workdir", str(files / "nowhere"), "--format", "hf", "--out",
                        str(files / "hf"), cwd=files), "nowhere")


def test_sweep_misspelled_key(files):
  assert_user_error(run("train.sweep", f"--config={ROOT / 'experiments' / 'table3.py'}:smoke",
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
