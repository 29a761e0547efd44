"""A run converted between the unrolled and the scanned layer layouts (compute.scan_layers).

    python -m run.convert --workdir RUN --out NEW --scan_layers=False   # or True

NEW is RUN with config.json's compute.scan_layers set, and every checkpoint (parameters and optimizer
state) and the average rewritten in that layout; its vocabulary, metrics and meta (step, RNG, data
position) are copied, so training resumes in NEW where RUN stopped, with the same numbers up to float
rounding. Decoding and export need no conversion: `run.load_run` unrolls a scanned run when it opens it.
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import shutil

import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging   # Orbax logs through absl

from run import checkpoint as ckpt
from run import layout
from run.config import CONFIG_FILE, load_run_config, read_config_json, save_config
from run.console import log_to_console

log = logging.getLogger("run.convert")   # not __name__: that is "__main__" under python -m run.convert
_NOT_COPIED = (ckpt.CHECKPOINTS, ckpt.TO_AVERAGE, ckpt.AVERAGED, ckpt.UNREADABLE, "LOCK", CONFIG_FILE)


def convert_tree(tree, scan_layers: bool):
  """Every parameter-shaped part of `tree` (a dict with 'encoder' or 'decoder' keys: the parameters,
  each of Adam's moments) in the scanned (scan_layers=True) or unrolled layout; the rest unchanged."""
  if isinstance(tree, dict):
    tree = {key: convert_tree(value, scan_layers) for key, value in tree.items()}
    if any(name in tree for name in layout.STACKS):
      tree = layout.scan_params(tree) if scan_layers else layout.unroll_params(tree)
    return tree
  if isinstance(tree, (list, tuple)):
    return type(tree)(convert_tree(value, scan_layers) for value in tree)
  return tree


def _restore_raw(manager, step: int) -> dict:
  """One checkpoint's items as stored (trees of the on-disk structure, arrays on the first device)."""
  metadata = manager.item_metadata(step)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  items = {"meta": ocp.args.JsonRestore()}
  for name in ("params", "opt_state"):
    tree = metadata.get(name) if hasattr(metadata, "get") else None
    tree = getattr(tree, "tree", tree)
    if tree is not None:
      abstract = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
      items[name] = ocp.args.StandardRestore(abstract)
  return dict(manager.restore(step, args=ocp.args.Composite(**items)))


def convert_run(workdir, out, scan_layers: bool) -> list[str]:
  """Writes run `workdir` in the layout `scan_layers` into the new directory `out`; returns what it
  converted, one line per checkpoint."""
  workdir, out = pathlib.Path(workdir).absolute(), pathlib.Path(out).absolute()
  if out.exists():
    raise FileExistsError(f"--out {out} exists: give a new directory")
  config = load_run_config(workdir)
  done = []
  out.mkdir(parents=True)
  for entry in workdir.iterdir():
    if entry.name not in _NOT_COPIED:
      (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, out / entry.name)
  for directory in (ckpt.CHECKPOINTS, ckpt.TO_AVERAGE, ckpt.AVERAGED):
    if not (workdir / directory).is_dir():
      continue
    reader = ckpt.make_manager(workdir, directory=directory, read_only=True)
    writer = ckpt.make_manager(out, directory=directory, async_save=False)
    for step in sorted(reader.all_steps()):
      items = _restore_raw(reader, step)
      ckpt.save(writer, step, convert_tree(items["params"], scan_layers),
                convert_tree(items.get("opt_state"), scan_layers), items["meta"])
      done.append(f"{directory}/{step}")
    writer.wait_until_finished()
    writer.close()
    reader.close()
  unlocked = read_config_json(workdir / CONFIG_FILE)   # in today's layout, also for an older run
  unlocked["compute"] = {**unlocked["compute"], "scan_layers": bool(scan_layers)}
  save_config(type(config)(unlocked), out)
  return done


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m run.convert", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="the run to convert (left unchanged)")
  parser.add_argument("--out", required=True, help="the new run directory (must not exist)")
  parser.add_argument("--scan_layers", required=True, choices=("True", "False"),
                      help="the layout of the new run: True scanned, False unrolled")
  args = parser.parse_args(argv)
  absl_logging.set_verbosity(absl_logging.ERROR)   # not Orbax's notes on read-only directories
  log_to_console()
  done = convert_run(args.workdir, args.out, args.scan_layers == "True")
  log.info(f"[convert] {args.workdir} -> {args.out} (scan_layers={args.scan_layers}): "
           f"{', '.join(done) or 'no checkpoints'}")


if __name__ == "__main__":
  main()
