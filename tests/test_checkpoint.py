"""Checkpoints: exact round trip, fallback past a damaged checkpoint, load_params, averaging, the lock."""
import logging
import pathlib

import jax
import numpy as np
import optax
import pytest

from train import average
from run import checkpoint as ckpt
from run import workdir as run_dir
from run.mesh import make_mesh
from run.user_errors import UserError
from train import step as step_lib


def make_state(mesh, value: float, fsdp=True):
  """A small sharded (params, opt_state) pair whose parameters are all `value` + an offset pattern."""
  params = {"dense": {"kernel": np.arange(64, dtype=np.float32).reshape(8, 8) / 64 + value,
                      "bias": np.full((3,), value, np.float32)}}
  opt_state = optax.adam(1e-3).init(params)
  shardings = step_lib.state_shardings((params, opt_state), mesh, fsdp)
  params, opt_state = jax.device_put((params, opt_state), shardings)
  return params, opt_state


def abstract_of(tree):
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def write_checkpoints(workdir, mesh, steps, keep=None):
  manager = ckpt.make_manager(workdir, keep=keep)
  for step in steps:
    params, opt_state = make_state(mesh, float(step))
    ckpt.save(manager, step, params, opt_state, {"step": step, "data": {"epoch": 1, "index": step},
                                                 "rng": ckpt.key_to_json(jax.random.key(step))})
  manager.wait_until_finished()
  return manager


def test_round_trip_is_exact_and_sharded(tmp_path):
  mesh = make_mesh()
  manager = write_checkpoints(tmp_path, mesh, [10, 20])
  params, opt_state = make_state(mesh, 20.0)
  got_params, got_opt, meta, manager = ckpt.restore_latest(manager, abstract_of(params),
                                                           abstract_of(opt_state))
  manager.close()
  assert meta["step"] == 20 and meta["data"] == {"epoch": 1, "index": 20}
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(got_params), jax.device_get(params))
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(got_opt), jax.device_get(opt_state))
  assert got_params["dense"]["kernel"].sharding == params["dense"]["kernel"].sharding
  key = ckpt.key_from_json(meta["rng"])
  np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(jax.random.key(20)))


def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
  mesh = make_mesh()
  manager = write_checkpoints(tmp_path, mesh, [10, 20, 30])
  manager.close()
  # Damage step 30's arrays: overwrite every file of its params item with garbage.
  for path in (tmp_path / "checkpoints" / "30" / "params").rglob("*"):
    if path.is_file():
      path.write_bytes(b"garbage")
  params, opt_state = make_state(mesh, 0.0)
  manager = ckpt.make_manager(tmp_path)
  with pytest.warns(RuntimeWarning, match=r"checkpoints/30 is unreadable"):
    got_params, _, meta, manager = ckpt.restore_latest(manager, abstract_of(params),
                                                       abstract_of(opt_state))
  assert meta["step"] == 20
  np.testing.assert_array_equal(jax.device_get(got_params["dense"]["bias"]), np.full(3, 20.0, np.float32))
  # The damaged step was moved aside, so training can write step 30 again.
  assert (tmp_path / "checkpoints_unreadable" / "30").is_dir()
  assert manager.all_steps() == [10, 20]
  new_params, new_opt = make_state(mesh, 31.0)
  ckpt.save(manager, 30, new_params, new_opt, {"step": 30})
  manager.wait_until_finished()
  manager.close()
  assert ckpt.load_params(tmp_path)[1] == 30


def test_load_params(tmp_path):
  mesh = make_mesh()
  write_checkpoints(tmp_path, mesh, [1, 2, 3], keep=2).close()
  params, step = ckpt.load_params(tmp_path)
  assert step == 3
  np.testing.assert_array_equal(params["dense"]["bias"], np.full(3, 3.0, np.float32))
  assert len(params["dense"]["kernel"].sharding.device_set) == 1
  assert ckpt.load_params(tmp_path, 2)[1] == 2
  with pytest.raises(UserError, match="no checkpoint for step 1"):   # only 2 kept
    ckpt.load_params(tmp_path, 1)
  with pytest.raises(UserError, match="train.average"):
    ckpt.load_params(tmp_path, "averaged")
  with pytest.raises(UserError, match="run directory"):
    ckpt.load_params(tmp_path / "nowhere")


def test_averaging_arithmetic(tmp_path, capsys):
  mesh = make_mesh()
  write_checkpoints(tmp_path, mesh, [100, 200, 300, 400]).close()
  average.main(["--workdir", str(tmp_path), "--last", "3"])
  assert "[200, 300, 400]" in capsys.readouterr().out
  params, step = ckpt.load_params(tmp_path, "averaged")
  assert step == 400
  np.testing.assert_allclose(params["dense"]["bias"], np.full(3, 300.0), rtol=0, atol=0)
  expected_kernel = np.arange(64, dtype=np.float32).reshape(8, 8) / 64 + 300.0
  np.testing.assert_allclose(params["dense"]["kernel"], expected_kernel, rtol=1e-7)
  # Averaging other steps is refused while RUN/averaged holds an average, unless --overwrite.
  with pytest.raises(SystemExit):
    average.main(["--workdir", str(tmp_path), "--last", "1"])
  assert "holds the average of steps [200, 300, 400]" in capsys.readouterr().err
  params, step = ckpt.load_params(tmp_path, "averaged")
  np.testing.assert_allclose(params["dense"]["bias"], np.full(3, 300.0), rtol=0, atol=0)
  average.average_checkpoints(tmp_path, last=1, overwrite=True)
  params, step = ckpt.load_params(tmp_path, "averaged")
  np.testing.assert_array_equal(params["dense"]["bias"], np.full(3, 400.0, np.float32))
  np.testing.assert_array_equal(average.average_params([{"a": np.float32(1)}, {"a": np.float32(2)}])["a"],
                                np.float32(1.5))


def test_second_trainer_on_a_run_dir_is_refused(tmp_path):
  with run_dir.RunLock(tmp_path):
    with pytest.raises(run_dir.RunDirLocked, match=r"in use by another trainer \(pid"):
      run_dir.RunLock(tmp_path).acquire()
  with run_dir.RunLock(tmp_path):   # released: free again
    pass
  assert (pathlib.Path(tmp_path) / "LOCK").exists()


def test_a_manager_opened_to_read_logs_no_warning_and_leaves_other_warnings_alone(tmp_path, caplog):
  (tmp_path / ckpt.CHECKPOINTS).mkdir()
  # The absl logger's own level too: a command run earlier in this process may have raised it.
  with caplog.at_level(logging.WARNING, logger="absl"):
    ckpt.make_manager(tmp_path, read_only=True).close()
    logging.getLogger("absl").warning("Given directory is read only=%s, said after the manager", tmp_path)
  assert [r.getMessage() for r in caplog.records if "read only" in r.getMessage() or "read_only" in r.getMessage()] == [
      f"Given directory is read only={tmp_path}, said after the manager"]
