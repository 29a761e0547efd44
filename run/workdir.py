"""The run directory's bookkeeping: the single-trainer lock, versions.json and atomic writes.

Layout of a run directory (see docs/runs.md):
    config.json  vocab.model  versions.json  LOCK  metrics.jsonl  tb/  checkpoints/<step>/  averaged/<step>/
"""
from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import pathlib
import platform
import sys

LOCK = "LOCK"
VERSIONS = "versions.json"
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_collections",
             "sentencepiece", "sacrebleu", "tensorflow-datasets", "tensorboardX")


class RunDirLocked(RuntimeError):
  pass


class RunLock:
  """An exclusive fcntl.flock on workdir/LOCK, held while a trainer runs (released when the process
  dies, even by SIGKILL). A second trainer on the same run directory raises RunDirLocked.
  """

  def __init__(self, workdir):
    self.path = pathlib.Path(workdir) / LOCK
    self._file = None

  def acquire(self) -> "RunLock":
    self.path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(self.path, "a+")
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      handle.seek(0)
      holder = handle.read().strip() or "unknown"
      handle.close()
      raise RunDirLocked(
          f"run directory {self.path.parent} is in use by another trainer ({holder}); wait for it to "
          f"finish, stop it, or pass a different --workdir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {platform.node()}\n")
    handle.flush()
    self._file = handle
    return self

  def release(self) -> None:
    if self._file is not None:
      fcntl.flock(self._file, fcntl.LOCK_UN)
      self._file.close()
      self._file = None

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()


def write_atomically(path, data: str | bytes) -> pathlib.Path:
  """Writes `data` to `path` through a temporary file in the same directory, then renames it: a reader
  (or a crash) sees the old file or the new one, never half of one. The only copy of this pattern."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  if isinstance(data, bytes):
    tmp.write_bytes(data)
  else:
    tmp.write_text(data, encoding="utf-8")
  os.replace(tmp, path)
  return path


def write_versions(workdir) -> pathlib.Path:
  """workdir/versions.json: Python and the versions of the packages a result depends on."""
  versions = {"python": sys.version.split()[0]}
  for name in _PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return write_atomically(pathlib.Path(workdir) / VERSIONS, json.dumps(versions, indent=2) + "\n")
