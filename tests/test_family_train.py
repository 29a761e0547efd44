"""The train loop on every config.data.task (data/tasks.py), on the smoke experiments: decoder-only
translation puts no loss or gradient on source tokens and packs; the masked LM scores masked tokens only,
never padding, and masks alike on a resume; every task resumes exactly; a wrong task is a one-line user
error; a decoder-only translation run translates (test BLEU, translate, python -m decode) with the beam
search after a cached prefill.
"""
import functools
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import experiments
import run
from data import load_pairs, make_eval_batches, make_train_iterator
from data.batching import BATCH_KEYS, ORDER
from data.lm import SEP
from data.tasks import TASKS
from data.vocab import BOS, EOS, VOCAB_FILE
from decode.bleu import sacrebleu_score
from decode.prompt import prompt_search
from decode.translate import translate
from model import Transformer
from run import checkpoint as ckpt, config as config_io, metrics as metrics_io, user_errors
from run.mesh import make_mesh
from train import schedules
from train import step as step_lib
from train.optimizer import make_optimizer
from train.train import TIMING_KEYS, train_and_evaluate

ROOT = pathlib.Path(__file__).resolve().parent.parent
QUIET = {"train.bleu_every": 0, "train.progress": False, "train.tensorboard": False, "train.eval_every": 0,
         "train.dev_sentences": 8, "train.test_sentences": 4, "decode.max_extra_len": 4}
RUN = {"train.num_steps": 4, "train.log_every": 1, "train.checkpoint_every_steps": 2,
       "train.checkpoint_every_minutes": 0.0, "train.test_bleu": True}
NEW_TASKS = ("decoder_only_mt", "lm", "mlm")   # each trained by the experiment file of its name


def config_for(experiment, **overrides):
  config = experiments.load_experiment(f"{ROOT}/experiments/{experiment}.py:smoke")
  return experiments.apply_overrides(config, {**QUIET, **overrides})


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
  """One vocabulary for every run here (the smoke experiments share their data settings)."""
  directory = tmp_path_factory.mktemp("vocab")
  run.get_vocab(config_for("lm").data, directory)
  return directory


@pytest.fixture(scope="module")
def vocab(vocab_dir):
  return run.load_vocab(vocab_dir)


def new_workdir(vocab_dir, path):
  path.mkdir(parents=True)
  shutil.copy(vocab_dir / VOCAB_FILE, path / VOCAB_FILE)
  return path


@pytest.fixture(scope="module")
def trained(vocab_dir, tmp_path_factory):
  """task -> (workdir, Outcome) of its smoke experiment trained RUN's 4 steps (once per module)."""
  done = {}

  def get(task):
    if task not in done:
      workdir = new_workdir(vocab_dir, tmp_path_factory.mktemp(task) / "run")
      done[task] = workdir, train_and_evaluate(config_for(task, **RUN), workdir)
    return done[task]
  return get


def stepper(config, vocab):
  """batch -> (new params, metrics) of one train step, always from the same initial state, on one
  device (compiled once per batch shape)."""
  mesh = make_mesh(jax.devices()[:1])
  model = Transformer(run.model_config(config, vocab.size))
  schedule = schedules.make_schedule(config.train, config.model.d_model)
  tx = make_optimizer(config.train, schedule)
  state, _ = step_lib.create_state(model, tx, mesh, jax.random.key(0))
  step = jax.jit(functools.partial(step_lib.train_step, model=model, tx=tx, schedule=schedule,
                                   label_smoothing=0.1))   # no donation: the state is used again
  return lambda batch: jax.device_get(step(state, step_lib.place_batch(batch, mesh), jax.random.key(1)))


def relabel(batch, where, seed=0):
  """The batch with other tgt_out labels (real pieces) at `where`."""
  labels = np.random.default_rng(seed).integers(EOS + 1, 100, batch["tgt_out"].shape, dtype=np.int32)
  return {**batch, "tgt_out": np.where(where, labels, batch["tgt_out"]).astype(np.int32)}


def assert_trees_equal(a, b):
  jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


# ------------------------------------------------------------------------------------------------------
def test_decoder_only_mt_batches_pack_and_score_target_and_eos_only(vocab):
  config = config_for("decoder_only_mt", **{"data.max_len": 128})   # rows with room for several pairs
  batch = next(make_train_iterator(config.data, vocab, seed=0, row_multiple=8))
  assert set(batch) == set(BATCH_KEYS) | {"tgt_weights"}
  assert batch["src_segments"].sum() == 0 and batch["tgt_segments"].max() > 1   # packed, no encoder input
  pairs = 0
  for row in range(batch["tgt_in"].shape[0]):
    for segment in range(1, batch["tgt_segments"][row].max() + 1):
      at = batch["tgt_segments"][row] == segment
      tokens_in, tokens_out, weights = (batch[k][row][at] for k in ("tgt_in", "tgt_out", "tgt_weights"))
      sep = list(tokens_in).index(SEP, 1)                       # BOS source SEP target
      assert tokens_in[0] == BOS and tokens_out[-1] == EOS and sep > 1
      np.testing.assert_array_equal(tokens_out[:-1], tokens_in[1:])
      np.testing.assert_array_equal(weights, [0] * sep + [1] * (len(tokens_in) - sep))
      np.testing.assert_array_equal(batch["tgt_positions"][row][at], np.arange(len(tokens_in)))
      pairs += 1
  assert pairs > (batch["tgt_segments"].max(axis=1) > 0).sum()   # more pairs than filled rows


def test_decoder_only_mt_puts_no_loss_or_gradient_on_source_tokens(vocab):
  config = config_for("decoder_only_mt")
  batch = next(make_train_iterator(config.data, vocab, seed=0, row_multiple=1))
  step = stepper(config, vocab)
  params, metrics = step(batch)
  source = (batch["tgt_weights"] == 0) & (batch["tgt_segments"] > 0)
  other_source = relabel(batch, source)
  assert (other_source["tgt_out"] != batch["tgt_out"]).sum() > 50
  params2, metrics2 = step(other_source)
  assert metrics2["loss"] == metrics["loss"] and metrics2["tokens"] == batch["tgt_weights"].sum()
  assert_trees_equal(params2, params)
  _, metrics3 = step(relabel(batch, batch["tgt_weights"] > 0))   # the target labels do count
  assert metrics3["loss"] != metrics["loss"]


def test_mlm_scores_masked_tokens_only_never_padding_and_masks_alike_on_resume(vocab):
  config = config_for("mlm")
  iterator = make_train_iterator(config.data, vocab, seed=0, row_multiple=8)
  batches = [next(iterator) for _ in range(3)]
  for batch in batches:
    chosen, real = batch["tgt_weights"] > 0, batch["src_segments"] > 0
    assert not chosen[~real].any() and not batch["src"][~real].any()        # padding: never masked
    assert (batch["tgt_out"][chosen] > EOS).all()                          # nor specials
    np.testing.assert_array_equal(batch["src"][~chosen], batch["tgt_out"][~chosen])
    assert 0.08 < chosen.sum() / real.sum() < 0.22
  # The position (seed, epoch, index) alone decides a batch's masks: a resumed iterator masks alike.
  resumed = make_train_iterator(config.data, vocab, seed=0, row_multiple=8)
  resumed.set_state({"epoch": 0, "index": 2, "order": ORDER})
  assert_trees_equal(next(resumed), batches[2])
  other = next(make_train_iterator(config.data, vocab, seed=1, row_multiple=8))
  assert not np.array_equal(other["tgt_weights"], batches[0]["tgt_weights"])
  dev = load_pairs(config.data, "dev")[:32]
  assert_trees_equal(make_eval_batches(config.data, vocab, dev, row_multiple=8),
                     make_eval_batches(config.data, vocab, dev, row_multiple=8))
  # The loss reads the masked positions only.
  batch = next(make_train_iterator(config.data, vocab, seed=0, row_multiple=1))
  step = stepper(config, vocab)
  params, metrics = step(batch)
  params2, metrics2 = step(relabel(batch, batch["tgt_weights"] == 0))
  assert metrics2["loss"] == metrics["loss"] and metrics["tokens"] == batch["tgt_weights"].sum()
  assert_trees_equal(params2, params)


@pytest.mark.parametrize("task", ["decoder_only_mt", pytest.param("lm", marks=pytest.mark.slow),
                                  pytest.param("mlm", marks=pytest.mark.slow)])   # 20-30 s each, cold
def test_each_task_resumes_exactly(task, trained, tmp_path):
  whole, outcome = trained(task)
  resumed = tmp_path / "resumed"
  shutil.copytree(whole, resumed)
  shutil.rmtree(resumed / ckpt.CHECKPOINTS / "4")      # as if killed after saving step 2
  again = train_and_evaluate(config_for(task, **{**RUN, "train.test_bleu": False}), resumed)
  assert outcome.step == again.step == 4
  comparable = lambda workdir: [{k: v for k, v in line.items() if k not in TIMING_KEYS}
                                for line in metrics_io.read_metrics(workdir) if "test/bleu" not in line]
  assert comparable(resumed) == comparable(whole)
  assert [line["step"] for line in comparable(whole) if "train/loss" in line] == [1, 2, 3, 4]
  assert_trees_equal(jax.device_get(ckpt.load_params(resumed)), jax.device_get(ckpt.load_params(whole)))
  if task in ("lm", "mlm"):   # no translations: no test BLEU, though config.train.test_bleu asked for it
    assert outcome.test_bleu is None and outcome.eval["eval/accuracy"] >= 0
    assert not [line for line in metrics_io.read_metrics(whole) if "test/bleu" in line]


def test_the_test_bleu_of_decoder_only_mt_is_its_translations(trained):
  workdir, outcome = trained("decoder_only_mt")
  opened = run.load_run(workdir)
  pairs = load_pairs(opened.config.data, "test")[:4]
  hyps = translate(opened.model, opened.params, opened.vocab, [s for s, _ in pairs],
                   **opened.config.decode.to_dict())
  assert outcome.test_bleu == pytest.approx(sacrebleu_score(hyps, [t for _, t in pairs])[0], abs=1e-9)


def test_decode_translates_with_a_decoder_only_mt_run(trained, tmp_path, capsys):
  from decode.__main__ import main
  workdir, _ = trained("decoder_only_mt")
  opened = run.load_run(workdir)
  settings = opened.config.decode          # what the run's test BLEU searched with (compiled already)
  sentences = [s for s, _ in load_pairs(opened.config.data, "test")[:2]]
  hyps = translate(opened.model, opened.params, opened.vocab, sentences, **settings.to_dict())
  for sentence, hyp in zip(sentences, hyps):   # == beam search after a prefill of BOS source SEP
    ids = opened.vocab.encode(sentence)
    seqs, _ = prompt_search(opened.model, opened.params, jnp.asarray([[BOS, *ids, SEP]]),
                            beam_size=settings.beam_size, max_len=len(ids) + settings.max_extra_len,
                            alpha=settings.alpha)
    assert hyp == opened.vocab.decode([int(t) for t in seqs[0, 0]])
  (tmp_path / "in.txt").write_text("".join(s + "\n" for s in sentences))
  main(["--workdir", str(workdir), "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.txt")])
  assert (tmp_path / "out.txt").read_text().splitlines() == hyps


@pytest.mark.parametrize("task", ["mlm", "lm"])
def test_decode_refuses_to_translate_with_an_mlm_or_lm_run(task, tmp_path, capsys):
  from decode.__main__ import main
  config_io.save_config(config_for(task), tmp_path)     # refused before any checkpoint is read
  (tmp_path / "in.txt").write_text("a sentence\n")
  with pytest.raises(SystemExit) as exit_info:
    main(["--workdir", str(tmp_path), "--input", str(tmp_path / "in.txt")])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and f"config.data.task={task!r}" in err
  assert ("--prompt" in err) == (task == "lm")


@pytest.mark.parametrize("experiment, overrides, message", [
    ("lm", {"data.task": "bert"}, "config.data.task='bert' is not one of"),
    ("lm", {"data.task": "mlm"},
     "config.data.task='mlm' needs config.model.arch='encoder_only', not 'decoder_only'"),
    ("variants", {"model.arch": "decoder_only"}, "config.data.task='translation' needs config.model.arch"),
    ("mlm", {"data.text_side": "both"}, "config.data.text_side='both' is not one of"),
])
def test_a_task_that_does_not_fit_is_a_one_line_user_error(experiment, overrides, message, tmp_path, capsys):
  workdir = tmp_path / "run"
  with pytest.raises(SystemExit) as exit_info, user_errors.reported():
    train_and_evaluate(config_for(experiment, **overrides), workdir)
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err
  if "data.task" in message:
    assert all(task in err for task in TASKS)
  assert not workdir.exists()                            # checked before anything is written


@pytest.mark.slow
@pytest.mark.parametrize("switches", [
    {},                                                                   # rope, MQA, SwiGLU, RMSNorm
    {"model.positions": "relative", "model.num_kv_heads": 2, "model.activation": "geglu"},
    {"model.positions": "alibi", "model.activation": "gelu", "model.norm": "layernorm",
     "model.pre_norm": True}],
    ids=["rope_mqa_swiglu_rmsnorm", "relative_gqa_geglu", "alibi_gelu_prenorm"])
def test_each_variant_resumes_exactly(switches, vocab_dir, tmp_path):
  """Every kind of switch (positions, KV heads, FFN, norm) on the translation task: 4 steps in one go
  equal 2 steps, a kill, and a resume for 2 more (metrics and parameters)."""
  config = config_for("variants", **{**RUN, **switches, "train.test_bleu": False})
  whole = new_workdir(vocab_dir, tmp_path / "whole")
  outcome = train_and_evaluate(config, whole)
  resumed = tmp_path / "resumed"
  shutil.copytree(whole, resumed)
  shutil.rmtree(resumed / ckpt.CHECKPOINTS / "4")      # as if killed after saving step 2
  again = train_and_evaluate(config, resumed)
  assert outcome.step == again.step == 4
  comparable = lambda workdir: [{k: v for k, v in line.items() if k not in TIMING_KEYS}
                                for line in metrics_io.read_metrics(workdir)]
  assert comparable(resumed) == comparable(whole)
  assert_trees_equal(jax.device_get(ckpt.load_params(resumed)), jax.device_get(ckpt.load_params(whole)))


def test_decoder_only_mt_ships_pre_norm_rope_and_keeps_the_paper_stack_as_an_arg():
  """The shipped stack and the paper-style one (docs/family.md) differ in exactly the two switches and the
  shipped stack's schedule (tripled peak, inverse-sqrt decay); both keep the default experiment's width,
  optimizer and steps; smoke shrinks the shipped one."""
  def leaves(spec):
    config = experiments.load_experiment(f"{ROOT}/experiments/{spec}")
    return {f"{s}.{k}": v for s in ("model", "data", "train") for k, v in config[s].items()}, config
  shipped, shipped_config = leaves("decoder_only_mt.py")
  paper, paper_config = leaves("decoder_only_mt.py:paper")
  default = experiments.load_experiment(f"{ROOT}/experiments/default.py")
  assert {k for k in shipped if shipped[k] != paper[k]} == {"model.pre_norm", "model.positions",
                                                            "train.learning_rate", "train.schedule"}
  assert (shipped["model.pre_norm"], shipped["model.positions"]) == (True, "rope")
  assert shipped["train.learning_rate"] == 3 * default.train.learning_rate
  assert paper["train.learning_rate"] == default.train.learning_rate
  assert (shipped["train.schedule"], paper["train.schedule"]) == ("inverse_sqrt", default.train.schedule)
  assert (paper["model.pre_norm"], paper["model.positions"]) == (False, "sinusoidal")
  assert shipped_config.workdir != paper_config.workdir
  for key in ("d_model", "d_ff", "num_heads"):
    assert shipped_config.model[key] == default.model[key]
  assert paper_config.train.to_dict() == default.train.to_dict()
  assert ({k: v for k, v in shipped_config.train.items() if k not in ("learning_rate", "schedule")}
          == {k: v for k, v in default.train.items() if k not in ("learning_rate", "schedule")})
  smoke = config_for("decoder_only_mt").model
  assert (smoke.pre_norm, smoke.positions) == (True, "rope")
  with pytest.raises(ValueError, match="'paper'"):
    experiments.load_experiment(f"{ROOT}/experiments/decoder_only_mt.py:papers")
