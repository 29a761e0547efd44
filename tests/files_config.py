"""Helpers shared by tests (not a test module): the data config of a corpus of TSV files, and the
XLA_FLAGS and environment of a test's subprocess."""
import os


def files_data_config(folder, **changes):
  """The default experiment's data config reading folder/train.tsv and folder/dev.tsv (dev also as the
  test set), with `changes` applied (keys the default lacks allowed)."""
  from experiments.default import get_config
  config = get_config().data
  config.update(source="files", train_path=str(folder / "train.tsv"), dev_path=str(folder / "dev.tsv"),
                test_path=str(folder / "dev.tsv"))
  with config.ignore_type():
    for key, value in changes.items():
      config[key] = value
  return config


def xla_flags(*flags) -> str:
  """XLA_FLAGS for a test's subprocess: `flags` and the instruction-set cap the suite was run with, if any
  (`XLA_FLAGS=--xla_cpu_max_isa=AVX2 pytest` runs it as an AVX2-only CPU does), so that the subprocess
  compiles the code the test's own process does."""
  cap = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag.startswith("--xla_cpu_max_isa")]
  return " ".join([*cap, *flags])


# What conftest.py sets for the processes the tests start, kept where a test clears JAX's settings.
_SHARED = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")


def clean_env(**changes) -> dict:
  """The environment for a subprocess that must not inherit the pytest process's JAX and XLA settings (its
  8 fake devices, its platform): os.environ without them, but with the tests' shared compilation cache and
  the suite's instruction-set cap (xla_flags()), then `changes`."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_")) or k in _SHARED}
  if xla_flags():
    env["XLA_FLAGS"] = xla_flags()
  env.update(changes)
  return env
