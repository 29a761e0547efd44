"""Helpers shared by tests (not a test module): the data config of a corpus of TSV files, and the
XLA_FLAGS of a test's subprocess."""
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
