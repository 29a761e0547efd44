"""The GPU install covers the GPU docs: one extra (`gpu`) holds the CUDA plugin, the interop extra for the
Hugging Face import and export, and pytest for scripts/device_check.sh, all pinned by constraints-gpu.txt;
a missing interop package is a one-line error naming the install line."""
import pathlib
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from export import hf, interop
from model import TransformerConfig
from run.user_errors import UserError

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _pins(path) -> dict:
  lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
  return {Requirement(line).name.lower().replace("_", "-"): Version(str(next(iter(Requirement(line).specifier)).version))
          for line in lines if line}


def test_the_gpu_extra_is_the_cuda_plugin_interop_and_test_all_pinned_in_range():
  (gpu,) = (Requirement(text) for text in EXTRAS["gpu"])
  assert gpu.name == "aiayn" and gpu.extras == {"cuda13", "interop", "test"}
  pins = _pins(ROOT / "constraints-gpu.txt")
  for extra in ("interop", "test"):
    for requirement in map(Requirement, EXTRAS[extra]):
      version = pins.get(requirement.name.lower())
      assert version is not None and requirement.specifier.contains(version), (requirement, version)
  assert "pytest" in {Requirement(r).name for r in EXTRAS["test"]}   # scripts/device_check.sh runs pytest


def test_the_documented_gpu_line_is_the_one_for_export_and_the_check():
  for doc in ("docs/install.md", "docs/pretrained.md"):
    assert "pip install -e '.[gpu]' -c constraints-gpu.txt" in (ROOT / doc).read_text(), doc
  assert "pip install -e '.[gpu]' -c constraints-gpu.txt" in interop.INSTALL


@pytest.mark.parametrize("missing", ["transformers", "torch"])
def test_a_missing_interop_package_is_one_line_naming_the_install_line(monkeypatch, missing):
  monkeypatch.setitem(sys.modules, missing, None)   # import raises ModuleNotFoundError, as when not installed
  with pytest.raises(UserError) as error:
    if missing == "transformers":
      hf.hf_config(TransformerConfig(vocab_size=8), vocab=None)
    else:
      hf.hf_state({}, TransformerConfig(vocab_size=8))
  message = str(error.value)
  assert f"need {missing} (the interop extra), which is not installed" in message
  assert "pip install -e '.[interop]' -c constraints.txt" in message and "\n" not in message
