"""Orbax checkpoints of a run: save, restore with fallback, and `load_params` for decoding.

Layout: workdir/checkpoints/<step>/{params, opt_state, meta} (an Orbax CheckpointManager), and
workdir/averaged/<step>/{params, meta} (written by train/average.py).
- params, opt_state: the arrays, saved asynchronously from their sharded layout.
- meta (JSON): step, the run's train RNG key (uint32 words), the data iterator state, the vocabulary
  fingerprint and the seed.
Orbax writes each checkpoint into a temporary directory and renames it when complete, so a crash during a
save leaves the previous checkpoints intact; an incomplete or damaged checkpoint is skipped on restore with
a warning, and moved aside to workdir/checkpoints_unreadable/ so that training can write that step again.
"""
from __future__ import annotations

import json
import logging
import pathlib
import shutil
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp

CHECKPOINTS = "checkpoints"
AVERAGED = "averaged"
UNREADABLE = "checkpoints_unreadable"

log = logging.getLogger(__name__)


def make_manager(workdir, keep: int | None = None, *, directory: str = CHECKPOINTS,
                 read_only: bool = False, async_save: bool = True) -> ocp.CheckpointManager:
  """An Orbax CheckpointManager over workdir/<directory>, keeping the last `keep` steps (None: all).

  Saving is asynchronous: `save` returns once the arrays are copied off the devices.
  """
  path = pathlib.Path(workdir).absolute() / directory
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only, read_only=read_only,
                                         enable_async_checkpointing=async_save)
  handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
              "meta": ocp.JsonCheckpointHandler()}
  return ocp.CheckpointManager(path, item_handlers=handlers, options=options)


def save(manager: ocp.CheckpointManager, step: int, params, opt_state, meta: dict) -> None:
  """Starts saving one checkpoint (asynchronous; call manager.wait_until_finished() to block)."""
  if jax.process_count() == 1:
    # One host: copy to numpy first. For replicated arrays Orbax would otherwise cut every array into
    # per-replica slices (about 4x slower with 8 devices); restoring puts them back in any sharding.
    params, opt_state = jax.device_get((params, opt_state))
  items = dict(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta))
  if opt_state is not None:
    items["opt_state"] = ocp.args.StandardSave(opt_state)
  manager.save(step, args=ocp.args.Composite(**items), force=True)


def key_to_json(key) -> list[int]:
  """A typed jax PRNG key -> its uint32 words as a JSON list."""
  return [int(x) for x in np.asarray(jax.random.key_data(key)).reshape(-1)]


def key_from_json(words) -> jax.Array:
  return jax.random.wrap_key_data(np.asarray(words, np.uint32))


def _restore_one(manager, step, abstract_params, abstract_opt_state):
  items = dict(params=ocp.args.StandardRestore(abstract_params), meta=ocp.args.JsonRestore())
  if abstract_opt_state is not None:
    items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
  restored = manager.restore(step, args=ocp.args.Composite(**items))
  meta = restored["meta"]
  if not isinstance(meta, dict) or "step" not in meta:
    raise ValueError(f"meta of step {step} has no 'step' entry")
  return restored["params"], restored.get("opt_state") if abstract_opt_state is not None else None, meta


def restore_latest(workdir, manager, abstract_params, abstract_opt_state):
  """Restores the newest readable checkpoint into the given abstract trees (shapes, dtypes, shardings).

  Unreadable newer checkpoints are skipped with a warning naming them, and moved to
  workdir/checkpoints_unreadable/<step> (then the manager is reloaded).
  Returns (params, opt_state, meta, manager) or (None, None, None, manager) if there is no checkpoint.
  """
  skipped = []
  result = (None, None, None)
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      result = _restore_one(manager, step, abstract_params, abstract_opt_state)
      break
    except Exception as error:  # noqa: BLE001 - any failure to read means "not usable"
      path = pathlib.Path(manager.directory) / str(step)
      warnings.warn(f"checkpoint {path} is unreadable ({type(error).__name__}: {str(error)[:200]}); "
                    f"skipping it and falling back to an older one", RuntimeWarning, stacklevel=2)
      skipped.append(step)
  if skipped:
    aside = pathlib.Path(workdir).absolute() / UNREADABLE
    aside.mkdir(exist_ok=True)
    for step in skipped:
      src = pathlib.Path(manager.directory) / str(step)
      dst = aside / str(step)
      if dst.exists():
        shutil.rmtree(dst)
      shutil.move(str(src), str(dst))
    manager.reload()
    if result[2] is not None:
      warnings.warn(f"restored step {result[2]['step']} after skipping unreadable steps {skipped} "
                    f"(moved to {aside})", RuntimeWarning, stacklevel=2)
  return (*result, manager)


def _host_abstract(tree_metadata):
  """Orbax array metadata -> ShapeDtypeStructs on the first local device (for single-process use)."""
  sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding),
                                tree_metadata)


def load_params(workdir, checkpoint=None):
  """Parameters of a run for decoding or fine-tuning: -> (params, step).

  checkpoint: None = the newest readable training checkpoint; an int = that step; 'averaged' = the
  average written by `python -m train.average`. Arrays land on the first local device.
  """
  directory = AVERAGED if checkpoint == "averaged" else CHECKPOINTS
  path = pathlib.Path(workdir).absolute() / directory
  if not path.is_dir():
    hint = ("run `python -m train.average --workdir RUN --last K` first" if directory == AVERAGED
            else "is it a run directory written by `python -m train`?")
    raise FileNotFoundError(f"no checkpoints in {path}: {hint}")
  manager = make_manager(workdir, directory=directory, read_only=True)
  try:
    steps = sorted(manager.all_steps(), reverse=True)
    if isinstance(checkpoint, int) and not isinstance(checkpoint, bool):
      if checkpoint not in steps:
        raise FileNotFoundError(f"{path} has no checkpoint for step {checkpoint}; it has {sorted(steps)}")
      steps = [checkpoint]
    elif checkpoint not in (None, "averaged"):
      raise ValueError(f"checkpoint={checkpoint!r}: use None (latest), a step number or 'averaged'")
    if not steps:
      raise FileNotFoundError(f"{path} holds no complete checkpoint")
    for i, step in enumerate(steps):
      try:
        metadata = manager.item_metadata(step)["params"]
        if metadata is None:
          raise ValueError(f"no parameter metadata in {path / str(step)}")
        abstract = _host_abstract(metadata.tree if hasattr(metadata, "tree") else metadata)
        restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
        return restored["params"], step
      except Exception as error:  # noqa: BLE001
        if i == len(steps) - 1:
          raise
        warnings.warn(f"checkpoint {path / str(step)} is unreadable ({type(error).__name__}: "
                      f"{str(error)[:200]}); falling back to step {steps[i + 1]}", RuntimeWarning,
                      stacklevel=2)
  finally:
    manager.close()


def read_meta(workdir, step: int, checkpoint=None) -> dict:
  """The JSON meta saved with a checkpoint ({} if it has none); checkpoint='averaged' reads the average's."""
  directory = AVERAGED if checkpoint == "averaged" else CHECKPOINTS
  path = pathlib.Path(workdir) / directory / str(step) / "meta" / "metadata"
  try:
    meta = json.loads(path.read_text())
  except (OSError, ValueError):
    return {}
  return meta if isinstance(meta, dict) else {}
