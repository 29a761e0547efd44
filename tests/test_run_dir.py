"""The run directory opened once per command (run.RunDir): one Orbax CheckpointManager per checkpoint set
per process for train, average, the Hugging Face import and fine-tuning; a run written before the run
object existed (tests/data/run_before: the smoke experiment at 16 wide, 100 pieces, 2 steps, its last 2
steps averaged, written by commit c8a5994) still opens, resumes and decodes; and averaging by hand, which
defaults to the run's own settings, reads one checkpoint at a time and never replaces the run's average
unasked.
"""
import collections
import json
import pathlib
import shutil
import tracemalloc

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import run
from decode.translate import translate
from run import checkpoint as ckpt
from run import metrics as metrics_io
from run.user_errors import UserError
from train import average

BEFORE = pathlib.Path(__file__).parent / "data" / "run_before"


def count_managers(monkeypatch) -> collections.Counter:
  """{directory: how many Orbax CheckpointManagers were constructed over it} from now on (the test's end)."""
  counts = collections.Counter()
  original = ocp.CheckpointManager

  class Counting(original):
    def __init__(self, directory, *args, **kwargs):
      counts[pathlib.Path(directory).absolute()] += 1
      super().__init__(directory, *args, **kwargs)

  monkeypatch.setattr(ocp, "CheckpointManager", Counting)
  return counts


@pytest.fixture
def opened(monkeypatch):
  return count_managers(monkeypatch)


def sets(workdir, *names) -> dict:
  """{workdir/name: 1}: each checkpoint set opened once."""
  return {pathlib.Path(workdir).absolute() / name: 1 for name in names}


def copy_before(tmp_path) -> pathlib.Path:
  return pathlib.Path(shutil.copytree(BEFORE, tmp_path / "run_before"))


def test_a_run_written_before_the_run_object_opens_and_decodes(opened):
  old = run.RunDir(BEFORE)
  assert old.steps() == [2] and old.steps(ckpt.TO_AVERAGE) == [1, 2] and old.steps(ckpt.AVERAGED) == [2]
  for which in (None, "latest", 2, "averaged"):
    loaded = old.load(which)
    assert loaded.step == 2
    hyps = translate(loaded.model, loaded.params, loaded.vocab, ["a small test .", "the cat"], beam_size=2,
                     max_extra_len=4)
    assert len(hyps) == 2 and all(isinstance(h, str) for h in hyps)
  old.close()
  assert opened == sets(BEFORE, ckpt.CHECKPOINTS, ckpt.TO_AVERAGE, ckpt.AVERAGED)   # however often read


@pytest.mark.slow   # one training step, the end's evaluation, test BLEU and average: 11 s, cache filled
def test_a_run_written_before_the_run_object_resumes_opening_each_checkpoint_set_once(tmp_path, opened):
  from train.train import train_and_evaluate
  workdir = copy_before(tmp_path)
  config = run.load_run_config(workdir)
  config.train.num_steps = 3
  data_index = ckpt.read_meta(workdir, 2)["data"]["index"]
  outcome = train_and_evaluate(config, workdir)
  assert outcome.step == 3 and outcome.averaged_steps == [2, 3]
  assert ckpt.read_meta(workdir, 3)["data"]["index"] == data_index + 1     # resumed where it stopped
  assert [line["step"] for line in metrics_io.read_metrics(workdir) if "train/loss" in line] == [1, 2, 3]
  # Training, its end's average (read from checkpoints_to_average, written beside RUN/averaged and
  # swapped in) and its test BLEU: each checkpoint set opened once.
  assert opened == sets(workdir, ckpt.CHECKPOINTS, ckpt.TO_AVERAGE, ckpt.AVERAGED + ".tmp", ckpt.AVERAGED)
  assert run.load_run(workdir, "averaged").step == 3


def write_run(workdir, steps, average_last, seed=0, wide=8) -> list:
  """A run directory without training: config.json (average_last, step checkpoints 1 step apart) and a
  params-only checkpoint of random parameters at each of `steps` in checkpoints_to_average. -> the trees."""
  workdir.mkdir()
  (workdir / "config.json").write_text(json.dumps({
      "model": {}, "data": {}, "train": {"average_last": average_last, "average_every_steps": 1}}))
  rng = np.random.default_rng(seed)
  manager = ckpt.make_manager(workdir, directory=ckpt.TO_AVERAGE, async_save=False)
  trees = []
  for step in steps:
    tree = {"dense": {"kernel": rng.normal(size=(256, wide)).astype(np.float32),
                      "bias": rng.normal(size=(wide,)).astype(np.float32)},
            "embed": rng.normal(size=(32, 16)).astype(np.float32)}
    ckpt.save(manager, step, tree, None, {"step": step, "to_average": 1})
    trees.append(tree)
  manager.close()
  return trees


def test_average_defaults_to_the_runs_own_average_last_and_equals_the_all_at_once_mean(tmp_path, opened):
  trees = write_run(tmp_path / "run", range(1, 11), average_last=8)
  opened.clear()
  average.main(["--workdir", str(tmp_path / "run")])
  meta = ckpt.read_meta(tmp_path / "run", 10, directory=ckpt.AVERAGED)
  assert meta["averaged_steps"] == list(range(3, 11))          # the run's average_last, 8
  assert opened == sets(tmp_path / "run", ckpt.TO_AVERAGE, ckpt.AVERAGED + ".tmp")   # written beside, swapped in
  # The streamed average is the all-at-once average, bit for bit.
  streamed, _ = ckpt.load_params(tmp_path / "run", "averaged")
  at_once = average.average_params(trees[2:])
  for a, b in zip(jax.tree_util.tree_leaves(streamed), jax.tree_util.tree_leaves(at_once)):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_averaging_holds_one_checkpoint_in_host_memory_whatever_how_many(tmp_path, monkeypatch):
  """The peak of Python's host allocations while averaging 8 checkpoints exceeds that of averaging 2 by
  less than half of what reading them all at once would add (6 checkpoints): streamed, the two peaks
  differ by noise (0.2-0.3 MB alone; 1.25 MB, over one checkpoint, once in a CI worker that had run other
  tests). Each checkpoint is read into numpy arrays here (traced by tracemalloc, as a restore on an
  accelerator host copies into host memory; on the CPU JAX's arrays would hide in XLA's buffers, which
  tracemalloc does not see)."""
  trees = write_run(tmp_path / "run", range(1, 9), average_last=8, wide=1024)
  one = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(trees[0]))
  read_params = ckpt.read_params
  monkeypatch.setattr(ckpt, "read_params", lambda manager, checkpoint=None: (
      jax.tree_util.tree_map(np.array, read_params(manager, checkpoint)[0]), checkpoint))

  def peak(last):
    tracemalloc.start()
    try:
      average.average_checkpoints(tmp_path / "run", last, overwrite=True)
      return tracemalloc.get_traced_memory()[1]
    finally:
      tracemalloc.stop()

  two, eight = peak(2), peak(8)
  assert two > 2 * one                          # the float64 sum is measured: the measure sees the arrays
  assert eight - two < 3 * one, (two, eight, one)


def test_average_refuses_to_replace_the_runs_average_unless_asked(tmp_path, capsys):
  write_run(tmp_path / "run", range(1, 6), average_last=3)
  workdir = str(tmp_path / "run")
  average.main(["--workdir", workdir])                          # as the end of training would: 3, 4, 5
  average.main(["--workdir", workdir])                          # the same steps again: left as it is
  assert "already holds the average of steps [3, 4, 5]" in capsys.readouterr().out
  with pytest.raises(SystemExit) as exit_info:
    average.main(["--workdir", workdir, "--last", "5"])
  assert exit_info.value.code == 2
  assert "holds the average of steps [3, 4, 5]" in capsys.readouterr().err
  assert ckpt.read_meta(workdir, 5, directory=ckpt.AVERAGED)["averaged_steps"] == [3, 4, 5]
  average.main(["--workdir", workdir, "--last", "5", "--overwrite"])
  assert ckpt.read_meta(workdir, 5, directory=ckpt.AVERAGED)["averaged_steps"] == [1, 2, 3, 4, 5]


def test_average_of_a_run_that_does_not_average_asks_for_last(tmp_path):
  write_run(tmp_path / "run", range(1, 3), average_last=0)
  with pytest.raises(UserError, match=r"average_last=0.*pass --last K"):
    average.average_checkpoints(tmp_path / "run")


def test_table3_keeps_only_the_checkpoints_its_rows_read():
  """Every full-size row of experiments/table3.py (big too) keeps the 2 newest full checkpoints to resume
  from and averages parameter-only step checkpoints, of which it keeps the average_last it reads."""
  import experiments
  from experiments import table3
  table = str(pathlib.Path(__file__).resolve().parent.parent / "experiments" / "table3.py")
  for name, overrides in table3.full_size_rows():
    train = experiments.apply_overrides(experiments.load_experiment(table), overrides).train
    assert train.keep_checkpoints == 2, name
    assert train.average_every_steps > 0 and train.average_last == 5, name
