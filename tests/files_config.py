"""A helper shared by the tests that read a corpus of TSV files (not a test module)."""


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
