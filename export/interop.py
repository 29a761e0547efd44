"""The interop extra (torch, transformers, ctranslate2, safetensors), imported where the Hugging Face
export and import use it: `transformers = need("transformers")`. Where it is not installed, a one-line
UserError names the install line instead of a ModuleNotFoundError's traceback."""
from __future__ import annotations

import importlib
import types

from run.user_errors import UserError

INSTALL = ("pip install -e '.[interop]' -c constraints.txt; on a GPU machine, torch's CPU build first, then "
           "pip install -e '.[gpu]' -c constraints-gpu.txt (docs/accelerators.md#install)")


def need(module: str) -> types.ModuleType:
  """import `module`, a package of the interop extra; a UserError naming the install line if it is missing."""
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as error:
    raise UserError(f"the Hugging Face export and import need {error.name or module} (the interop extra), "
                    f"which is not installed: {INSTALL}") from None
