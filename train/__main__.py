"""`python -m train`: train an experiment, evaluate it, and print how to decode with it.

    python -m train                                         # experiments/default.py, workdir runs/default
    python -m train --config=experiments/default.py:smoke --workdir=/tmp/smoke
    python -m train --config.train.num_steps=5000 --config.model.num_encoder_layers=4

Rerunning a command resumes its run directory. A misspelled --config.* key is an error.
"""
from __future__ import annotations

import os
import pathlib
import sys

from absl import app, flags, logging

from train import user_errors

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_DEFAULT = os.path.relpath(_ROOT / "experiments" / "default.py")

_CONFIG = user_errors.define_config_flag(_DEFAULT)   # a misspelled --config.KEY: one line, exit 2
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (default: the config's workdir)")


def _config_path() -> str:
  """The experiment file of --config (without its :arg)."""
  from ml_collections import config_flags
  return config_flags.get_config_filename(flags.FLAGS["config"]).partition(":")[0]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; use --config=... --workdir=...")
  logging.set_verbosity(logging.WARNING)   # Orbax logs every file it renames at INFO
  import jax
  jax.config.update("jax_compilation_cache_dir", str(pathlib.Path.home() / ".cache" / "aiayn_jax"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  from train.train import NonFiniteError, train_and_evaluate

  config = _CONFIG.value
  workdir = _WORKDIR.value or config.workdir
  if config.data.source == "files" and os.path.samefile(_config_path(), _ROOT / "experiments" / "default.py"):
    print("[train] hint: for your own corpus, experiments/small_corpus.py is tuned for real text "
          "(docs/small_corpus.md); this is the default experiment, tuned for the synthetic corpus")
  try:
    with user_errors.reported():
      outcome = train_and_evaluate(config, workdir)
  except NonFiniteError as error:
    print(f"[train] error: {error}", file=sys.stderr)
    sys.exit(1)
  if outcome.interrupted:
    return
  print()
  if outcome.eval:
    print(f"dev loss {outcome.eval['eval/loss']:.4f}  ppl {outcome.eval['eval/ppl']:.3f}  "
          f"accuracy {outcome.eval['eval/accuracy']:.4f}  (step {outcome.step})")
  if outcome.test_bleu is not None:
    print(f"test sacreBLEU {outcome.test_bleu:.2f}   {outcome.test_signature}")
    if outcome.test_bleu_averaged is not None:
      print(f"test sacreBLEU {outcome.test_bleu_averaged:.2f}   average of the checkpoints of steps "
            f"{outcome.averaged_steps} (decode it with --checkpoint averaged)")
    for src, ref, hyp in outcome.samples or []:
      print(f"  src: {src}\n  ref: {ref}\n  hyp: {hyp}\n")
  print(f"run directory: {outcome.workdir}")
  shown = os.path.relpath(outcome.workdir)
  shown = outcome.workdir if shown.startswith("..") else shown
  print(f"decode with:   python -m decode --workdir {shown} --input FILE --output FILE")


if __name__ == "__main__":
  app.run(main)
