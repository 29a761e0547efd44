"""A resume never loses a run: a changed optimizer is refused, naming the arrays (nothing moved, metrics
kept) unless reset_optimizer; the batch order does not depend on the devices, accumulation steps or
processes; a data position of the old hardware-dependent order is refused."""
import json

import jax
import numpy as np
import pytest

from data.batching import ORDER, BatchIterator
from run import checkpoint as ckpt
from run import metrics as metrics_io
from run.mesh import make_mesh
from train.train import train_and_evaluate
from test_train import smoke_config

FIRST = {"train.num_steps": 4, "train.log_every": 1, "train.checkpoint_every_steps": 2}


def _steps(workdir):
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_a_changed_optimizer_is_refused_then_reset_keeps_params_step_and_metrics(tmp_path):
  train_and_evaluate(smoke_config(**FIRST), tmp_path)
  lines = metrics_io.read_metrics(tmp_path)
  params_before, _ = ckpt.load_params(tmp_path)

  # grad_clip_norm switched on: the optimizer state gains a level. Refused, naming the arrays; nothing moved.
  clipped = {**FIRST, "train.num_steps": 6, "train.grad_clip_norm": 1.0}
  with pytest.raises(ckpt.CheckpointMismatch, match=r"only in the run now: 1/0/count.*reset_optimizer=True"):
    train_and_evaluate(smoke_config(**clipped), tmp_path)
  assert _steps(tmp_path) == [2, 4] and not (tmp_path / ckpt.UNREADABLE).exists()
  assert metrics_io.read_metrics(tmp_path) == lines
  assert json.loads((tmp_path / "config.json").read_text())["train"]["grad_clip_norm"] == 0.0
  # Weight decay adds a masked step before the schedule's: the schedule's count moves (1/ -> 2/).
  with pytest.raises(ckpt.CheckpointMismatch, match=r"only in the checkpoint: 1/count; only in the run now: 2/count"):
    train_and_evaluate(smoke_config(**{**FIRST, "train.weight_decay": 0.1}), tmp_path)
  assert _steps(tmp_path) == [2, 4] and metrics_io.read_metrics(tmp_path) == lines

  # With reset_optimizer: step 4's parameters and data position, a fresh optimizer, metrics kept.
  outcome = train_and_evaluate(smoke_config(**clipped, **{"train.reset_optimizer": True}), tmp_path)
  assert outcome.step == 6
  after = metrics_io.read_metrics(tmp_path)
  assert after[:len(lines)] == lines and [l["step"] for l in after if "train/loss" in l] == [1, 2, 3, 4, 5, 6]
  assert ckpt.read_meta(tmp_path, 6)["data"]["index"] == ckpt.read_meta(tmp_path, 4)["data"]["index"] + 2
  params_after, _ = ckpt.load_params(tmp_path, 4)   # step 4 was not rewritten
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(params_before),
                         jax.device_get(params_after))


def _pairs(n, seed=0):
  rng = np.random.default_rng(seed)
  src = [rng.integers(4, 50, rng.integers(1, 20)).astype(np.int32) for _ in range(n)]
  tgt = [rng.integers(4, 50, rng.integers(1, 20)).astype(np.int32) for _ in range(n)]
  return src, tgt


def _global_rows(row_multiple, process_count, pack, steps=12):
  """The real (non-padding) rows of the first `steps` global batches, process blocks joined."""
  src, tgt = _pairs(300)
  iterators = [BatchIterator(src, tgt, max_len=32, batch_tokens=256, row_multiple=row_multiple, seed=3,
                             pack=pack, process_index=p, process_count=process_count)
               for p in range(process_count)]
  out = []
  for _ in range(steps):
    parts = [next(it) for it in iterators]
    batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    real = batch["tgt_segments"].any(axis=1)
    out.append({k: v[real] for k, v in batch.items()})
    assert batch["src"].shape[0] % row_multiple == 0
  return out


@pytest.mark.parametrize("pack", [False, True])
def test_batches_do_not_depend_on_devices_accumulation_or_processes(pack):
  reference = _global_rows(1, 1, pack)
  for row_multiple, processes in ((8, 1), (16, 2), (24, 1), (8, 2)):   # 8 devices; x2 accumulation; ...
    got = _global_rows(row_multiple, processes, pack)
    for a, b in zip(reference, got):
      for key in a:
        np.testing.assert_array_equal(a[key], b[key][:, :a[key].shape[1]])


def test_a_data_position_from_the_device_dependent_order_is_refused():
  src, tgt = _pairs(50)
  iterator = BatchIterator(src, tgt, max_len=32, batch_tokens=256, row_multiple=8, seed=0)
  with pytest.raises(ValueError, match=r"devices x grad_accum_steps \(now 8\)"):
    iterator.set_state({"epoch": 0, "index": 3})
  iterator.set_state({"epoch": 0, "index": 3, "order": ORDER})
  assert iterator.get_state() == {"epoch": 0, "index": 3, "order": ORDER}
  one = BatchIterator(src, tgt, max_len=32, batch_tokens=256, row_multiple=1, seed=0)
  one.set_state({"epoch": 0, "index": 3})   # one device, no accumulation: the old order was this one


def test_a_readable_checkpoint_that_does_not_fit_is_never_moved(tmp_path):
  from train import step as step_lib
  import optax
  mesh = make_mesh()
  params = {"dense": {"kernel": np.ones((8, 8), np.float32), "bias": np.zeros((3,), np.float32)}}
  manager = ckpt.make_manager(tmp_path)
  for step in (2, 4):
    ckpt.save(manager, step, params, optax.adam(1e-3).init(params), {"step": step})
  manager.wait_until_finished()

  def abstract(tree):
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
  wider = {"dense": {"kernel": np.ones((8, 16), np.float32), "bias": np.zeros((3,), np.float32)}}
  with pytest.raises(ckpt.CheckpointMismatch, match=r"dense/kernel \(8, 8\) float32 vs \(8, 16\) float32"):
    ckpt.restore_latest(manager, abstract(wider), abstract(optax.adam(1e-3).init(wider)))
  clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)).init(params)
  with pytest.raises(ckpt.CheckpointMismatch, match=r"only in the checkpoint: 0/count, 0/mu/dense/bias"):
    ckpt.restore_latest(manager, abstract(params), abstract(clipped))
  assert sorted(manager.all_steps()) == [2, 4] and not (tmp_path / ckpt.UNREADABLE).exists()
  got, opt_state, meta, manager = ckpt.restore_latest(manager, abstract(params), abstract(clipped),
                                                      reset_optimizer=True)
  assert meta["step"] == 4 and opt_state is None
  np.testing.assert_array_equal(jax.device_get(got["dense"]["kernel"]), params["dense"]["kernel"])
  manager.close()


@pytest.mark.slow
def test_a_run_resumes_on_another_number_of_devices_with_the_same_batches(tmp_path):
  from test_train import finish, trainer
  settings = ["train.schedule=inverse_sqrt", "train.log_every=1", "train.checkpoint_every_steps=4",
              "train.checkpoint_every_minutes=0"]
  whole, part = tmp_path / "whole", tmp_path / "part"
  whole.mkdir()
  part.mkdir()
  uninterrupted = trainer(whole, *settings, "train.num_steps=8", devices=8)
  code, out = finish(trainer(part, *settings, "train.num_steps=4", devices=8), timeout=400)
  assert code == 0, out
  code, out = finish(trainer(part, *settings, "train.num_steps=8", devices=2), timeout=400)  # 8 -> 2 devices
  assert code == 0 and "resumed" in out, out
  code, out = finish(uninterrupted, timeout=400)
  assert code == 0, out
  a = [l for l in metrics_io.read_metrics(part) if "train/loss" in l]
  b = [l for l in metrics_io.read_metrics(whole) if "train/loss" in l]
  assert [l["step"] for l in a] == [l["step"] for l in b] == list(range(1, 9))
  for x, y in zip(a, b):
    assert x["train/tokens"] == y["train/tokens"]                     # the same batches...
    assert x["train/loss"] == pytest.approx(y["train/loss"], rel=1e-4)  # ...summed over other devices
