"""python -m data.prepare on a small fake of the WMT14 EN-DE download (tests/wmt_fake.py: the archives in
the layout tensorflow_datasets/translate/wmt.py reads, given with --archives instead of downloaded), then
the Table 2 chain on it: the smoke training reads it with --config.data.tfds_data_dir=DIR and scores the
prepared test split, train.average and decode (both BLEUs) work on the run (slow)."""
import os
import pathlib
import subprocess
import sys

import ml_collections
import pytest

import wmt_fake
from data import prepare, sources

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = "wmt14_translate/de-en"


def _env():
  return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """(DIR, the fake corpus, the command's output) after `python -m data.prepare` with --archives."""
  root = tmp_path_factory.mktemp("wmt")
  corpus = wmt_fake.write_archives(root / "archives")
  done = subprocess.run([sys.executable, "-m", "data.prepare", NAME, "--data_dir", str(root / "tfds"),
                         "--archives", str(root / "archives")], cwd=ROOT, env=_env(), capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  return root / "tfds", corpus, done.stdout + done.stderr


def _data_config(data_dir, split_langs=("en", "de")):
  return ml_collections.ConfigDict(dict(source="tfds", tfds_name=NAME, tfds_data_dir=str(data_dir),
                                        src_lang=split_langs[0], tgt_lang=split_langs[1], max_len=0))


def test_prepare_writes_the_splits_training_reads_and_the_test_set_as_text(prepared):
  data_dir, corpus, output = prepared
  config = _data_config(data_dir)
  # Train = the three training archives, dev = newstest2013, test = newstest2014 (from the .sgm files).
  assert sorted(sources.load_pairs(config, "train")) == sorted(corpus["train"])
  assert sorted(sources.load_pairs(config, "dev")) == sorted(corpus["dev"])
  test = sources.load_pairs(config, "test")
  assert sorted(test) == sorted(corpus["test"])
  folder = data_dir / "wmt14_translate" / "de-en"
  en = (folder / "newstest2014.en").read_text(encoding="utf-8").splitlines()
  de = (folder / "newstest2014.de").read_text(encoding="utf-8").splitlines()
  assert list(zip(en, de)) == test            # line-aligned, in the prepared split's order
  assert "[prepare] wmt14_translate/de-en in" in output and "train 300" in output and "test 48" in output
  assert "extract dev.tgz" in output          # progress of the extraction
  assert f"--config.data.tfds_data_dir={data_dir}" in output


def test_prepare_again_leaves_the_dataset_and_a_missing_archive_is_named(prepared, tmp_path, capsys):
  data_dir = prepared[0]
  builder, _ = prepare.prepare(NAME, data_dir, archives=tmp_path, progress=False)   # nothing to read there
  assert builder.info.splits["train"].num_examples == 300
  with pytest.raises(SystemExit) as exit_info:
    prepare.main([NAME, "--data_dir", str(tmp_path / "new"), "--archives", str(tmp_path), "--no_progress"])
  err = capsys.readouterr().err.strip()
  assert exit_info.value.code == 2 and len(err.splitlines()) == 1
  assert "is missing" in err and "http://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz" in err


def test_an_unprepared_dataset_names_the_prepare_command(tmp_path):
  command = f"python -m data.prepare {NAME} --data_dir DIR"
  with pytest.raises(sources.DataError, match=f"not prepared in .*{command}"):
    sources.load_pairs(_data_config(tmp_path), "dev")


def test_tfds_or_synthetic_reads_the_prepared_dataset_only_given_a_directory(prepared):
  config = _data_config(prepared[0])
  config.source = "tfds_or_synthetic"
  assert sources.resolved_source(config) == "tfds"
  assert sorted(sources.load_pairs(config, "test")) == sorted(prepared[1]["test"])
  config.tfds_data_dir = ""
  assert sources.resolved_source(config) == "synthetic"


@pytest.mark.slow
def test_the_table2_chain_runs_from_the_documented_commands_on_the_prepared_files(prepared, tmp_path):
  data_dir = prepared[0]
  run = tmp_path / "run"

  def command(*args):
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-1500:]
    return done.stdout + done.stderr

  trained = command("train", "--config", "experiments/wmt14_ende.py:smoke", "--workdir", str(run),
                    f"--config.data.tfds_data_dir={data_dir}", "--config.train.progress=False")
  assert "test sacreBLEU" in trained and 'the "Rhein-Main" house costs 1,000 euros .' in trained
  assert (run / "checkpoints_to_average").is_dir()
  # By hand, as REPRODUCING.md says: the run's own averaging settings, which the end of training applied.
  averaged = command("train.average", "--workdir", str(run))
  assert "already holds the average of steps [1, 2]" in averaged, averaged
  folder = data_dir / "wmt14_translate" / "de-en"
  decoded = command("decode", "--workdir", str(run), "--checkpoint", "averaged", "--input",
                    str(folder / "newstest2014.en"), "--reference", str(folder / "newstest2014.de"),
                    "--output", str(tmp_path / "hyp.de"), "--max_extra_len", "5")
  assert "sacreBLEU" in decoded and "tok:13a" in decoded
  assert "paper-style BLEU" in decoded and "tok:moses-de+compound-split" in decoded
  assert len((tmp_path / "hyp.de").read_text().splitlines()) == wmt_fake.TEST_SIZE
