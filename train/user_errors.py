"""Mistakes in what the user typed or gave end a command in one readable line, without a traceback.

    with user_errors.reported():       # in an entry point's main()
      ...

prints `error: config.data.train_path: file 'x.tsv' does not exist` on stderr and exits with status 2
(argparse's status for a usage error) when the work raises one of USER_ERRORS. Any other exception is a
bug and keeps its traceback. `define_config_flag` does the same for a --config flag whose experiment file,
arg or --config.KEY override does not exist (ml_collections checks those while defining the flag).
"""
from __future__ import annotations

import contextlib
import difflib
import pathlib
import sys

from data.sources import DataError
from train.run_dir import RunDirLocked

EXIT_STATUS = 2


class UserError(ValueError):
  """A setting, path or run directory the user gave cannot work; the message says which and what to do."""


USER_ERRORS = (DataError, UserError, RunDirLocked, FileNotFoundError)


def fail(message: str) -> None:
  """Prints `error: message` (on one line) to stderr and exits with EXIT_STATUS."""
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
  sys.exit(EXIT_STATUS)


@contextlib.contextmanager
def reported():
  """Runs the block; a USER_ERRORS exception ends the program with fail(its message)."""
  try:
    yield
  except USER_ERRORS as error:
    text = str(error)
    if isinstance(error, FileNotFoundError) and error.filename and error.strerror:
      text = f"file {error.filename!r} does not exist"
    fail(text)


def define_config_flag(default_spec: str, argv=None):
  """config_flags.DEFINE_config_file('config', ...) (locked), failing readably on a missing experiment
  file, an unknown experiment arg or a misspelled --config.KEY override in argv (default sys.argv)."""
  from ml_collections import config_flags
  problem = diagnose_config_args(sys.argv if argv is None else argv, default_spec)
  if problem is not None:   # else ml_collections reports it later, inside a traceback or flag dump
    fail(problem)
  return config_flags.DEFINE_config_file("config", default_spec, "experiment file[:arg]", lock_config=True)


def diagnose_config_args(argv, default_spec: str) -> str | None:
  """What is wrong with argv's --config=SPEC and --config.KEY=VALUE flags, or None if nothing is."""
  from train import config_io
  spec = default_spec
  overrides = []
  for i, arg in enumerate(argv[1:], 1):
    if arg.startswith("--config="):
      spec = arg.split("=", 1)[1]
    elif arg == "--config" and i + 1 < len(argv):
      spec = argv[i + 1]
    elif arg.startswith("--config."):
      overrides.append(arg[len("--config."):].split("=", 1)[0])
  path, _, _ = spec.partition(":")
  if not pathlib.Path(path).is_file():
    return f"--config: experiment file {path!r} does not exist (e.g. experiments/default.py)"
  try:
    config = config_io.load_experiment(spec)
  except ValueError as error:   # get_config's "unknown arg" and friends
    return f"--config={spec}: {error}"
  for dotted in overrides:
    node, walked = config, "config"
    for name in dotted.split("."):
      keys = list(node.keys()) if hasattr(node, "keys") else []
      if name not in keys:
        close = difflib.get_close_matches(name, keys, n=1)
        hint = f"; did you mean {walked}.{close[0]}?" if close else f"; it has {sorted(keys)}"
        return f"--config.{dotted}: {walked} has no key {name!r}{hint}"
      node, walked = node[name], f"{walked}.{name}"
  return None
