"""The run directory's bookkeeping: the single-trainer lock, versions.json, atomic writes, and the checks
every reader of a run makes first (`run_file`, `read_file`): a wrong run directory ends in a UserError
naming the file and what to do, and nothing on disk is changed.

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

from run.user_errors import UserError

LOCK = "LOCK"
# What to do about a run directory that is not what a command expects.
WRITTEN_BY_TRAIN = "give the --workdir of a run written by `python -m train`"
DAMAGED = ("it was edited or damaged: undo the edit or restore it from a copy, or train again in a new "
           "--workdir")
VERSIONS = "versions.json"
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_collections",
             "sentencepiece", "sacrebleu", "tensorflow-datasets", "tensorboardX")


class RunDirLocked(UserError):
  """Another trainer holds the run directory's LOCK."""


def run_file(workdir, name: str) -> pathlib.Path:
  """workdir/name, once workdir is known to be an existing directory (else a UserError naming it)."""
  workdir = pathlib.Path(workdir)
  if not workdir.exists():
    raise UserError(f"run directory {workdir} does not exist: {WRITTEN_BY_TRAIN}")
  if not workdir.is_dir():
    raise UserError(f"{workdir} is not a directory: {WRITTEN_BY_TRAIN}")
  return workdir / name


def read_file(path, *, binary: bool = False) -> str | bytes:
  """The contents of a run's file; missing, a directory, unreadable or not UTF-8 is a UserError naming it."""
  path = pathlib.Path(path)
  if not path.exists():
    raise UserError(f"{path} not found: {WRITTEN_BY_TRAIN} (is {path.parent} one?)")
  try:
    return path.read_bytes() if binary else path.read_text(encoding="utf-8")
  except IsADirectoryError:
    raise UserError(f"{path} is a directory, not a file: {DAMAGED}") from None
  except UnicodeDecodeError as error:
    raise UserError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}): {DAMAGED}") from None
  except OSError as error:
    raise UserError(f"cannot read {path} ({error.strerror}): check its permissions") from None


def make_run_dir(workdir) -> pathlib.Path:
  """Creates workdir (and its parents) for a trainer; a path that exists and is not a directory, or one
  that cannot be created, is a UserError."""
  workdir = pathlib.Path(workdir)
  if workdir.exists() and not workdir.is_dir():
    raise UserError(f"--workdir {workdir} is a file, not a directory: give a new or existing run directory")
  try:
    workdir.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    raise UserError(f"cannot create the run directory {workdir} ({error.strerror}): give another "
                    f"--workdir") from None
  return workdir


class RunLock:
  """An exclusive fcntl.flock on workdir/LOCK, held while a trainer runs (released when the process
  dies, even by SIGKILL). A second trainer on the same run directory raises RunDirLocked.
  """

  def __init__(self, workdir):
    self.path = pathlib.Path(workdir) / LOCK
    self._file = None

  def acquire(self) -> "RunLock":
    make_run_dir(self.path.parent)
    try:
      handle = open(self.path, "a+")
    except OSError as error:
      raise UserError(f"cannot open the lock file {self.path} ({error.strerror}): it must be a file the "
                      f"trainer can write; remove it or fix its permissions") from None
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
