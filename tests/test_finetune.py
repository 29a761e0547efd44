"""experiments/finetune.py fitted to real use: back-translated pairs (data.synthetic_path) tagged where the
pretrained vocabulary holds "<BT>" and untagged where it cannot (an imported pair of SentencePiece models);
batch and dtype that follow the platform; early stopping that keeps the best dev loss's checkpoint, which
the test BLEU, decode and export then read; and the documented fine-tune chain (import, fine-tune with a
back-translated file, export, decode) run end to end on a tiny Marian model built here.
"""
import json
import pathlib

import numpy as np
import pytest

import experiments
from data import synthetic
from data.vocab import PairVocab, Vocab
from files_config import files_data_config
from run import get_vocab
from run.config import save_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
FINETUNE = ROOT / "experiments" / "finetune.py"
TAG = "<BT>"
QUIET = {"train.progress": False, "train.tensorboard": False}


def _write(path, rows):
  path.write_text("".join(f"{s}\t{t}\n" for s, t in rows))
  return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """train/dev/test TSVs and a back-translated TSV (sources marked 'zz') from the embedded generator."""
  root = tmp_path_factory.mktemp("ft_corpus")
  pairs = synthetic.generate(seed=5, sizes={"train": 400, "dev": 16, "test": 16})
  _write(root / "train.tsv", pairs["train"][:250])
  _write(root / "synth.tsv", [(f"zz {s}", t) for s, t in pairs["train"][250:]])
  _write(root / "dev.tsv", pairs["dev"])
  _write(root / "test.tsv", pairs["test"])
  return root


@pytest.fixture(scope="module")
def pretrained_dirs(corpus, tmp_path_factory):
  """Three pretrained run directories (config.json and vocab.model, no checkpoint: the config is all
  experiments/finetune.py reads): a vocabulary that reserved the tag, one that did not, and an imported
  pair of SentencePiece models (PairVocab, as export.load_hf writes for OPUS-MT)."""
  root = tmp_path_factory.mktemp("pretrained")
  config = experiments.load_experiment(f"{FINETUNE}:smoke")
  out = {}
  for name, tag in (("tagged", TAG), ("plain", "")):
    data = files_data_config(corpus, vocab_size=200, vocab_sample_sentences=2000, synthetic_tag=tag)
    get_vocab(data, root / name)
    save_config(config, root / name)
    out[name] = root / name
  plain = (root / "plain" / "vocab.model").read_bytes()
  pieces = [Vocab(plain).id_to_piece(i) for i in range(Vocab(plain).size)]
  (root / "imported").mkdir()
  (root / "imported" / "vocab.model").write_bytes(PairVocab.bundle(plain, plain, pieces))
  save_config(config, root / "imported")
  out["imported"] = root / "imported"
  return out


def test_back_translated_sources_are_tagged_only_where_the_vocabulary_holds_the_tag(pretrained_dirs):
  tags = {name: experiments.load_experiment(f"{FINETUNE}:{path}").data.synthetic_tag
          for name, path in pretrained_dirs.items()}
  assert tags == {"tagged": TAG, "plain": "", "imported": ""}
  config = experiments.load_experiment(f"{FINETUNE}:{pretrained_dirs['imported']}")
  assert config.data.synthetic_path == "" and config.data.synthetic_ratio == 0.0   # declared: settable
  experiments.apply_overrides(config, {"data.synthetic_path": "synth.src,mono.tgt"})


def test_an_imported_vocabulary_asked_for_the_tag_says_it_cannot_hold_it(pretrained_dirs, corpus, tmp_path):
  from data import DataError, make_train_iterator
  data = files_data_config(corpus, synthetic_path=str(corpus / "synth.tsv"), synthetic_tag=TAG,
                           vocab_file=str(pretrained_dirs["imported"] / "vocab.model"))
  vocab = get_vocab(data, tmp_path)
  with pytest.raises(DataError, match="an imported vocabulary cannot hold a new piece.*synthetic_tag=''"):
    make_train_iterator(data, vocab, seed=0, row_multiple=1)


def test_batch_and_dtype_follow_the_platform(pretrained_dirs):
  from train.__main__ import _for_platform
  spec = f"{FINETUNE}:{pretrained_dirs['imported']}"
  cpu, gpu = (experiments.load_experiment(spec, platform=p) for p in ("cpu", "gpu"))
  assert (cpu.compute.dtype, cpu.data.batch_tokens, cpu.train.num_steps) == ("float32", 2048, 2000)
  assert (gpu.compute.dtype, gpu.data.batch_tokens) == ("bfloat16", 16_384)
  # The same tokens between evals, in the warmup and in all: every step count divided by the ratio, 8.
  ratio = gpu.data.batch_tokens // cpu.data.batch_tokens
  for key in ("num_steps", "warmup_steps", "eval_every", "checkpoint_every_steps"):
    assert gpu.train[key] == -(-cpu.train[key] // ratio), key
  assert gpu.train.learning_rate == cpu.train.learning_rate
  assert experiments.load_experiment(spec).to_json() == cpu.to_json()   # get_config alone: the CPU's
  # The trainer's command line: an override wins over the platform's size.
  config = experiments.load_experiment(spec)
  adapted = _for_platform(spec, ["--config.data.batch_tokens=4096"], config, "gpu")
  assert (adapted.data.batch_tokens, adapted.compute.dtype) == (4096, "bfloat16")
  smoke = experiments.load_experiment(f"{FINETUNE}:smoke", platform="gpu")
  assert smoke.compute.dtype == "bfloat16" and smoke.data.batch_tokens == 256


def _scripted_dev_losses(monkeypatch, losses):
  """The trainer's dev loss, eval by eval, from `losses` (the rest of each eval is real)."""
  from train import evaluation
  real, calls = evaluation.dev_losses, []

  def scripted(*args):
    result = real(*args)
    result["loss"] = losses[min(len(calls), len(losses) - 1)]
    calls.append(result["loss"])
    return result
  monkeypatch.setattr(evaluation, "dev_losses", scripted)
  return calls


@pytest.mark.slow   # two short trainings: about a minute on two shared cores
def test_fine_tune_with_a_tagged_back_translated_file_keeps_and_exports_the_best_step(
    corpus, tmp_path, monkeypatch, capsys):
  """A pretrained run of ours whose vocabulary holds the tag, fine-tuned on parallel + back-translated
  pairs (tagged); early stopping (patience 2, dev loss best at the 2nd eval) keeps that step's checkpoint
  although only 1 is kept besides, and the test BLEU, decode's default and export read it."""
  import jax
  from run import checkpoint as ckpt
  import run
  from train.train import train_and_evaluate
  pretrained = tmp_path / "pretrained"
  base = experiments.load_experiment(f"{FINETUNE}:smoke")
  experiments.apply_overrides(base, {**QUIET, "train.num_steps": 1, "train.test_bleu": False,
                                     "train.early_stop_evals": 0})
  train_and_evaluate(base, pretrained)
  config = experiments.load_experiment(f"{FINETUNE}:{pretrained}")
  assert config.data.synthetic_tag == TAG
  experiments.apply_overrides(config, {
      **QUIET, "data.train_path": str(corpus / "train.tsv"), "data.dev_path": str(corpus / "dev.tsv"),
      "data.test_path": str(corpus / "test.tsv"), "data.synthetic_path": str(corpus / "synth.tsv"),
      "data.batch_tokens": 256, "train.num_steps": 12, "train.warmup_steps": 1, "train.eval_every": 2,
      "train.checkpoint_every_steps": 0, "train.checkpoint_every_minutes": 0.0, "train.keep_checkpoints": 1,
      "train.early_stop_evals": 2, "train.learning_rate": 1e-3, "train.test_sentences": 8})
  _scripted_dev_losses(monkeypatch, [3.0, 2.0, 2.5, 2.6, 2.7])
  capsys.readouterr()
  outcome = train_and_evaluate(config, tmp_path / "ft")
  console = capsys.readouterr()
  log = console.out + console.err
  assert f"tag {TAG})" in log                                       # the stream says it is tagged
  assert outcome.stopped_early and outcome.step == 8 and outcome.best_step == 4
  assert "the best dev loss, 2.0000, was at step 4" in log
  steps = sorted(int(p.name) for p in (tmp_path / "ft" / ckpt.CHECKPOINTS).iterdir() if p.name.isdigit())
  assert steps == [4, 8]                                # the best, kept beside keep_checkpoints=1's last
  best, latest = ckpt.load_params(tmp_path / "ft", 4)[0], ckpt.load_params(tmp_path / "ft", "latest")[0]
  default, step = ckpt.load_params(tmp_path / "ft")
  assert step == 4 and ckpt.load_params(tmp_path / "ft", "best")[1] == 4
  same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                                jax.tree_util.tree_leaves(b)))
  assert same(default, best) and not same(best, latest)
  assert run.load_run(tmp_path / "ft").step == 4
  test_lines = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()
                if "test/bleu" in line]
  assert test_lines[-1]["test/checkpoint_step"] == 4
  # A run without early stopping has no best checkpoint to ask for.
  with pytest.raises(run.UserError, match="no best checkpoint by dev loss"):
    ckpt.load_params(pretrained, "best")


@pytest.mark.slow   # builds a Hugging Face model, fine-tunes it and exports it: about a minute
def test_the_documented_fine_tune_chain_with_an_imported_model_runs_untagged(corpus, tmp_path, capsys):
  """docs/pretrained.md's commands on a tiny random MarianMTModel: python -m export.load_hf, python -m
  train --config experiments/finetune.py:RUN with a back-translated file (untagged: the imported
  vocabulary cannot hold the tag), python -m export --format hf, python -m decode. The export is the
  checkpoint with the best dev loss."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from test_load_hf import build_hf, source_sentences, target_of
  from export import load_hf
  from export.__main__ import main as export_main
  from decode.__main__ import main as decode_main
  from train.__main__ import main as train_main
  from run import checkpoint as ckpt
  hf_dir = build_hf(tmp_path / "hf", tied=False, eos_bias=0.0)
  load_hf.main(["--model", str(hf_dir), "--workdir", str(tmp_path / "opus")])
  pairs = lambda seed, n: [(s, target_of(s)) for s in source_sentences(seed, n)]
  files = {name: _write(tmp_path / f"{name}.tsv", pairs(seed, n))
           for name, seed, n in (("train", 11, 200), ("synth", 15, 100), ("dev", 12, 16), ("test", 13, 16))}
  train_main([f"--config={FINETUNE}:{tmp_path / 'opus'}", f"--workdir={tmp_path / 'ft'}",
              f"--config.data.train_path={files['train']}", f"--config.data.dev_path={files['dev']}",
              f"--config.data.test_path={files['test']}", f"--config.data.synthetic_path={files['synth']}",
              "--config.data.batch_tokens=512", "--config.data.max_len=32", "--config.train.num_steps=6",
              "--config.train.warmup_steps=1", "--config.train.learning_rate=1e-3",
              "--config.train.eval_every=2", "--config.train.checkpoint_every_steps=2",
              "--config.train.test_sentences=8", "--config.train.progress=False",
              "--config.train.tensorboard=False"])
  recorded = json.loads((tmp_path / "ft" / "config.json").read_text())
  assert recorded["data"]["synthetic_tag"] == "" and recorded["compute"]["dtype"] == "float32"
  best = ckpt.best_step(tmp_path / "ft")
  assert best is not None
  export_main(["--workdir", str(tmp_path / "ft"), "--format", "hf", "--out", str(tmp_path / "out")])
  assert json.loads((tmp_path / "out" / "aiayn_export.json").read_text())["step"] == best
  (tmp_path / "test.en").write_text("".join(s + "\n" for s, _ in pairs(13, 4)))
  decode_main(["--workdir", str(tmp_path / "ft"), "--input", str(tmp_path / "test.en"),
               "--output", str(tmp_path / "test.hyp")])
  assert len((tmp_path / "test.hyp").read_text().splitlines()) == 4
