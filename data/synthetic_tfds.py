"""The embedded corpus as a tensorflow-datasets builder, so it flows through the same TFDS path as WMT.

Prepared once per (seed, train size) into array_record files (no TensorFlow needed) under the TFDS data
directory, then read with `tfds.data_source`.
"""
from __future__ import annotations

import tensorflow_datasets as tfds
from absl import logging as absl_logging

from data import synthetic

# TFDS warns at length about custom builder configs; ours are intended.
absl_logging.set_verbosity(absl_logging.ERROR)

NAME = "aiayn_synthetic"


class AiaynSynthetic(tfds.core.GeneratorBasedBuilder):
  """Synthetic English-like -> German-like translation pairs (see data/synthetic.py)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First version."}
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=f"seed0_train{synthetic.DEFAULT_SIZES['train']}")]

  def _info(self):
    return self.dataset_info_from_configs(
        features=tfds.features.Translation(languages=("en", "de")),
        supervised_keys=("en", "de"),
        description=synthetic.__doc__)

  def _split_generators(self, dl_manager):
    seed, train_size = parse_config_name(self.builder_config.name)
    corpus = synthetic.generate(seed, {"train": train_size})
    return {"train": self._generate_examples(corpus["train"]),
            "validation": self._generate_examples(corpus["dev"]),
            "test": self._generate_examples(corpus["test"])}

  def _generate_examples(self, pairs):
    for i, (src, tgt) in enumerate(pairs):
      yield i, {"en": src, "de": tgt}


def config_name(seed: int, train_size: int) -> str:
  return f"seed{int(seed)}_train{int(train_size)}"


def parse_config_name(name: str) -> tuple[int, int]:
  seed, train = name.split("_")
  return int(seed.removeprefix("seed")), int(train.removeprefix("train"))


def builder(seed: int, train_size: int, data_dir: str | None = None) -> AiaynSynthetic:
  name = config_name(seed, train_size)
  # TFDS refuses a custom config named like a predefined one: pass the predefined one by name.
  predefined = {c.name for c in AiaynSynthetic.BUILDER_CONFIGS}
  config = name if name in predefined else tfds.core.BuilderConfig(name=name)
  return AiaynSynthetic(config=config, data_dir=data_dir or None, file_format="array_record")
