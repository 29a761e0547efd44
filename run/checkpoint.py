"""Orbax checkpoints of a run: save, restore with fallback, and `read_params` for decoding.

Layout: workdir/checkpoints/<step>/{params, opt_state, meta} (an Orbax CheckpointManager: by steps, by wall
clock, at the end and on preemption; what training resumes from), workdir/checkpoints_to_average/<step>/
{params, meta} (config.train.average_every_steps > 0: every that many steps, counted back from the last
step, the set train/average.py averages, meta marked {"to_average": every}), and
workdir/averaged/<step>/{params, meta} (written by train/average.py).
- params, opt_state: the arrays, saved asynchronously from their sharded layout.
- meta (JSON): step, the run's train RNG key (uint32 words), the data iterator state, the vocabulary
  fingerprint, the seed, early stopping's state (the best dev loss and its step, `best_step`) and whether
  the step's dev evaluation is owed (`eval_owed`: a signal cut it short; the resumed run does it, then
  records it done with `update_meta`).
The manager keeps the last `keep` steps and any step the trainer marks (KeepSteps): with early stopping,
the step of the best dev loss, however old. `read_params` reads that step by default for such a run
(the run's model is its best checkpoint by dev loss); `latest` reads the newest.
Orbax writes each checkpoint into a temporary directory and renames it when complete, so a crash during a
save leaves the previous checkpoints intact; an incomplete or damaged checkpoint is skipped on restore with
a warning, and moved aside to workdir/checkpoints_unreadable/ so that training can write that step again.
A checkpoint that reads but does not fit the run as configured now is never moved: restoring it stops with
CheckpointMismatch, naming the arrays that differ.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import shutil
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from run.user_errors import UserError
from run.workdir import DAMAGED, WRITTEN_BY_TRAIN, read_file, run_file, write_atomically

CHECKPOINTS = "checkpoints"
TO_AVERAGE = "checkpoints_to_average"   # config.train.average_every_steps: the step checkpoints averaged
AVERAGED = "averaged"
UNREADABLE = "checkpoints_unreadable"

log = logging.getLogger(__name__)


@dataclasses.dataclass
class KeepSteps:
  """An Orbax preservation policy: keeps the checkpoints of `steps` (the trainer updates the set; early
  stopping puts the best dev loss's step in it), whatever the other policies delete."""
  steps: set = dataclasses.field(default_factory=set)

  def should_preserve(self, checkpoints, *, context) -> list[bool]:
    del context
    return [info.step in self.steps for info in checkpoints]


def make_manager(workdir, keep: int | None = None, *, directory: str = CHECKPOINTS,
                 read_only: bool = False, async_save: bool = True,
                 keep_also: KeepSteps | None = None) -> ocp.CheckpointManager:
  """An Orbax CheckpointManager over workdir/<directory>, keeping the last `keep` steps (None: all) and
  the steps of `keep_also`.

  Saving is asynchronous: `save` returns once the arrays are copied off the devices.
  """
  path = pathlib.Path(workdir).absolute() / directory
  policy = None
  if keep_also is not None and not read_only:   # Orbax takes a policy or max_to_keep, not both
    policies = ocp.checkpoint_managers
    policy = policies.AnyPreservationPolicy([policies.LatestN(n=keep), keep_also])
    keep = None
  # A reader asks for no saving (save_interval_steps=0, no max_to_keep) itself: Orbax would otherwise
  # change those settings and log a warning for each.
  options = ocp.CheckpointManagerOptions(max_to_keep=None if read_only else keep, preservation_policy=policy,
                                         create=not read_only,
                                         read_only=read_only, save_interval_steps=0 if read_only else 1,
                                         enable_async_checkpointing=async_save)
  handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
              "meta": ocp.JsonCheckpointHandler()}
  absl = logging.getLogger("absl")
  absl.addFilter(_not_read_only_notice)
  try:
    return ocp.CheckpointManager(path, item_handlers=handlers, options=options)
  finally:
    absl.removeFilter(_not_read_only_notice)


def _not_read_only_notice(record: logging.LogRecord) -> bool:
  """Orbax logs `Given directory is read only=DIR` at WARNING for every manager opened to read (decoding,
  averaging, the test BLEU of the average): reading is what we asked for, not something to warn about."""
  return not record.getMessage().startswith("Given directory is read only")


def save(manager: ocp.CheckpointManager, step: int, params, opt_state, meta: dict) -> None:
  """Starts saving one checkpoint (asynchronous; call manager.wait_until_finished() to block)."""
  if jax.process_count() == 1:
    # One host: copy to numpy first. For replicated arrays Orbax would otherwise cut every array into
    # per-replica slices, slower the more devices there are; restoring puts them back in any sharding.
    params, opt_state = jax.device_get((params, opt_state))
  items = dict(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta))
  if opt_state is not None:
    items["opt_state"] = ocp.args.StandardSave(opt_state)
  manager.save(step, args=ocp.args.Composite(**items), force=True)


def key_to_json(key) -> list[int]:
  """A typed jax PRNG key -> its uint32 words as a JSON list."""
  return [int(x) for x in np.asarray(jax.random.key_data(key)).reshape(-1)]


def key_from_json(words, impl: str = "threefry2x32") -> jax.Array:
  """key_to_json's words -> the typed key of PRNG implementation `impl`."""
  return jax.random.wrap_key_data(np.asarray(words, np.uint32), impl=impl)


class CheckpointMismatch(ValueError):
  """A readable checkpoint that does not fit the run as configured now; the message names what differs."""


class _Unreadable(Exception):
  """Files of a checkpoint are missing or damaged."""


def _key_name(entry) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def flat_leaves(tree) -> dict:
  """{'0/mu/decoder/.../kernel': leaf}: a tree's leaves by path (Orbax's names for them on disk)."""
  return {"/".join(_key_name(k) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _tree(metadata):
  return metadata.tree if hasattr(metadata, "tree") else metadata


def _differences(on_disk: dict, wanted: dict) -> list[str]:
  """What differs between two flat {path: array-like} dicts, in words (the first few of each kind)."""
  gone = sorted(set(on_disk) - set(wanted))
  new = sorted(set(wanted) - set(on_disk))
  reshaped = sorted(k for k in set(on_disk) & set(wanted)
                    if tuple(on_disk[k].shape) != tuple(wanted[k].shape)
                    or np.dtype(on_disk[k].dtype) != np.dtype(wanted[k].dtype))
  show = lambda keys: ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
  out = []
  if gone:
    out.append(f"only in the checkpoint: {show(gone)}")
  if new:
    out.append(f"only in the run now: {show(new)}")
  if reshaped:
    out.append("different shape or dtype: " + show(
        [f"{k} {tuple(on_disk[k].shape)} {on_disk[k].dtype} vs {tuple(wanted[k].shape)} {wanted[k].dtype}"
         for k in reshaped]))
  return out


def _restore_one(manager, step, abstract_params, abstract_opt_state, reset_optimizer=False):
  """One checkpoint -> (params, opt_state or None, meta). opt_state is None also when it was reset.

  Raises _Unreadable for missing or damaged files, CheckpointMismatch for a readable checkpoint that
  does not fit (parameters, or an optimizer state whose arrays differ without reset_optimizer).
  An optimizer state whose arrays match by name, shape and dtype but whose tree differs (e.g. weight decay
  switched on: Adam's moments are the same arrays) is carried over.
  """
  path = pathlib.Path(manager.directory) / str(step)
  try:
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if not isinstance(meta, dict) or "step" not in meta:
      raise ValueError(f"meta of step {step} has no 'step' entry")
    metadata = manager.item_metadata(step)
    params_md = _tree(metadata["params"])
    opt_md = _tree(metadata["opt_state"]) if abstract_opt_state is not None else None
    if params_md is None or (abstract_opt_state is not None and opt_md is None):
      raise ValueError("no array metadata")
  except Exception as error:  # noqa: BLE001 - missing or damaged files, whatever the library raises
    raise _Unreadable(f"{type(error).__name__}: {str(error)[:200]}") from error

  differences = _differences(flat_leaves(params_md), flat_leaves(abstract_params))
  if differences:
    raise CheckpointMismatch(f"checkpoint {path} holds parameters that do not fit the model as configured "
                             f"now ({'; '.join(differences)}); use a new --workdir or restore the settings")
  items = dict(params=ocp.args.StandardRestore(abstract_params))
  carry = None
  if abstract_opt_state is not None:
    wanted = flat_leaves(abstract_opt_state)
    differences = _differences(flat_leaves(opt_md), wanted)
    if differences and not reset_optimizer:
      raise CheckpointMismatch(
          f"checkpoint {path} holds an optimizer state that does not fit the optimizer as configured now "
          f"({'; '.join(differences)}): a config.train setting that shapes the optimizer changed (e.g. "
          f"grad_clip_norm switched on or off). Restore that setting, or pass "
          f"--config.train.reset_optimizer=True to keep parameters, step and data position and start the "
          f"optimizer state afresh")
    if not differences:
      if jax.tree_util.tree_structure(opt_md) == jax.tree_util.tree_structure(abstract_opt_state):
        items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
      else:   # same arrays, another tree: read the tree on disk, then put its arrays in the new one
        on_disk = jax.tree_util.tree_map_with_path(
            lambda p, _: wanted["/".join(_key_name(k) for k in p)], opt_md)
        items["opt_state"] = ocp.args.StandardRestore(on_disk)
        carry = jax.tree_util.tree_structure(abstract_opt_state)
  try:
    restored = manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as error:  # noqa: BLE001 - the layout fits, so the array files are damaged
    raise _Unreadable(f"{type(error).__name__}: {str(error)[:200]}") from error
  opt_state = restored.get("opt_state") if "opt_state" in items else None
  if carry is not None:
    by_name = flat_leaves(opt_state)
    opt_state = jax.tree_util.tree_unflatten(carry, [by_name[k] for k in flat_leaves(abstract_opt_state)])
  return restored["params"], opt_state, meta


def restore_latest(manager, abstract_params, abstract_opt_state, reset_optimizer=False):
  """Restores the newest readable checkpoint of `manager` into the given abstract trees (shapes, dtypes,
  shardings).

  Checkpoints with missing or damaged files are skipped with a warning naming them, and moved to
  RUN/checkpoints_unreadable/<step> beside the manager's directory (then the manager is reloaded); in a
  multi-process run process 0 moves them. A readable checkpoint that does not fit raises CheckpointMismatch (nothing is moved).
  reset_optimizer: a checkpoint whose optimizer state does not fit restores without it (opt_state None).
  Returns (params, opt_state, meta, manager) or (None, None, None, manager) if there is no checkpoint.
  """
  skipped = []
  result = (None, None, None)
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      result = _restore_one(manager, step, abstract_params, abstract_opt_state, reset_optimizer)
      break
    except _Unreadable as error:
      path = pathlib.Path(manager.directory) / str(step)
      warnings.warn(f"checkpoint {path} is unreadable ({error}); skipping it and falling back to an older "
                    f"one", RuntimeWarning, stacklevel=2)
      skipped.append(step)
  if skipped:
    aside = pathlib.Path(manager.directory).parent / UNREADABLE
    if jax.process_index() == 0:
      aside.mkdir(exist_ok=True)
      for step in skipped:
        src = pathlib.Path(manager.directory) / str(step)
        dst = aside / str(step)
        if dst.exists():
          shutil.rmtree(dst)
        shutil.move(str(src), str(dst))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("checkpoints set aside")
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


def load_params(workdir, checkpoint=None, *, directory: str | None = None):
  """read_params of run directory `workdir` through a manager opened for this one read: for tests and
  notebooks. Commands open the run once (run.RunDir) and read through its managers."""
  directory = directory or (AVERAGED if checkpoint == "averaged" else CHECKPOINTS)
  check_readable(pathlib.Path(workdir).absolute() / directory)
  manager = make_manager(workdir, directory=directory, read_only=True)
  try:
    return read_params(manager, checkpoint)
  finally:
    manager.close()


def _hint(directory: str) -> str:
  return ("run `python -m train.average --workdir RUN` first" if directory == AVERAGED
          else WRITTEN_BY_TRAIN + ", and let it save a checkpoint")


def check_readable(path: pathlib.Path) -> None:
  """A UserError naming `path` (a run's checkpoint set) unless it is a directory."""
  run_file(path.parent, path.name)
  if not path.is_dir():
    raise UserError(f"no checkpoints in {path}: {_hint(path.name)}")


def read_params(manager: ocp.CheckpointManager, checkpoint=None):
  """Parameters of one checkpoint of `manager`'s set, for decoding, fine-tuning or averaging: -> (params,
  step).

  checkpoint: None = the run's model: for a run trained with early stopping (config.train.early_stop_evals)
  its checkpoint of the best dev loss, else the newest readable checkpoint; 'latest' = the newest; 'best' =
  the best dev loss's (early stopping only); an int = that step; 'averaged' = the newest of the set (the
  manager of RUN/averaged). Arrays land on the first local device. An unreadable checkpoint falls back to
  an older one with a warning, unless a step was asked for.
  """
  path = pathlib.Path(manager.directory)
  hint = _hint(path.name)
  if not (checkpoint in (None, "averaged", "latest", "best") or type(checkpoint) is int):
    raise ValueError(f"checkpoint={checkpoint!r}: use None (the run's model), 'latest', 'best', a step "
                     f"number or 'averaged'")
  try:
    steps = sorted(manager.all_steps(), reverse=True)
  except OSError as error:
    raise UserError(f"cannot read the checkpoints in {path} ({error.strerror}): check its "
                    f"permissions") from None
  if checkpoint in (None, "best") and steps and path.name == CHECKPOINTS:
    best = best_step(path.parent, steps)
    if best is None and checkpoint == "best":
      raise UserError(f"{path} has no best checkpoint by dev loss: the run was trained without early "
                      f"stopping (config.train.early_stop_evals); pass a step, 'latest' or 'averaged'")
    if best is not None and best != steps[0]:
      log.info(f"[checkpoint] {path.parent}: the best dev loss's checkpoint, step {best} (early stopping; "
               f"--checkpoint latest reads step {steps[0]})")
    checkpoint = best
  if type(checkpoint) is int:
    if checkpoint not in steps:
      raise UserError(f"{path} has no checkpoint for step {checkpoint}; it has {sorted(steps)}: pass one "
                      f"of those to --checkpoint, or none for the newest")
    steps = [checkpoint]
  if not steps:
    raise UserError(f"{path} holds no complete checkpoint: {hint}")
  for i, step in enumerate(steps):
    try:
      metadata = manager.item_metadata(step)["params"]
      if metadata is None:
        raise ValueError(f"no parameter metadata in {path / str(step)}")
      abstract = _host_abstract(metadata.tree if hasattr(metadata, "tree") else metadata)
      restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
      return restored["params"], step
    except Exception as error:  # noqa: BLE001 - missing or damaged files, whatever the library raises
      if i == len(steps) - 1:
        raise UserError(f"checkpoint {path / str(step)} is unreadable ({type(error).__name__}: "
                        f"{' '.join(str(error).split())[:200]}): its files are missing or damaged; "
                        f"restore them, or pass another step to --checkpoint") from None
      warnings.warn(f"checkpoint {path / str(step)} is unreadable ({type(error).__name__}: "
                    f"{str(error)[:200]}); falling back to step {steps[i + 1]}", RuntimeWarning,
                    stacklevel=2)


def best_step(workdir, steps=None) -> int | None:
  """The step of the best dev loss that early stopping recorded in the newest checkpoint's meta, if that
  checkpoint is still there (None for a run without early stopping). steps: the run's steps, newest first."""
  if steps is None:
    path = pathlib.Path(workdir) / CHECKPOINTS
    found = path.iterdir() if path.is_dir() else []
    steps = sorted((int(p.name) for p in found if p.name.isdigit()), reverse=True)
  for newest in steps:
    try:
      best = read_meta(workdir, newest).get("early_stop", {}).get("best_step")
    except UserError:   # a damaged meta: the next older one
      continue
    return best if type(best) is int and best in steps else None
  return None


def read_meta(workdir, step: int, checkpoint=None, *, directory: str | None = None) -> dict:
  """The JSON meta saved with a checkpoint ({} if it has none); checkpoint='averaged' reads the average's,
  directory another set's (TO_AVERAGE). A meta that is not a JSON object (edited or damaged) is a UserError
  naming it."""
  directory = directory or (AVERAGED if checkpoint == "averaged" else CHECKPOINTS)
  path = pathlib.Path(workdir) / directory / str(step) / "meta" / "metadata"
  if not path.exists():
    return {}
  try:
    meta = json.loads(read_file(path))
  except json.JSONDecodeError:
    meta = None
  if not isinstance(meta, dict):
    raise UserError(f"{path} is not the JSON object a checkpoint's meta holds: {DAMAGED}")
  return meta


def update_meta(workdir, step: int, changes: dict) -> None:
  """Rewrites the meta of workdir/checkpoints/<step> with `changes` applied, atomically (a crash leaves the
  old meta or the new one); the arrays are untouched. Orbax cannot save a step again."""
  path = pathlib.Path(workdir) / CHECKPOINTS / str(step) / "meta" / "metadata"
  write_atomically(path, json.dumps({**read_meta(workdir, step), **changes}))
