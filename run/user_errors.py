"""Mistakes in what the user typed or gave end a command in one readable line, without a traceback.

    with user_errors.reported():       # in an entry point's main()
      ...

prints `error: config.data.train_path: file 'x.tsv' does not exist` on stderr and exits with status 2
(argparse's status for a usage error) when the work raises one of USER_ERRORS. Any other exception is a
bug and keeps its traceback. (Flags and --config.KEY overrides are the entry points' argparse parsers'
to check: `prog: error: ...`, status 2.) A warning shown meanwhile reads as one line too,
`warning: message`, without the file, line and source line Python prints with it.
"""
from __future__ import annotations

import contextlib
import sys
import warnings

from data.sources import DataError

EXIT_STATUS = 2


class UserError(ValueError):
  """A setting, path or run directory the user gave cannot work; the message says which and what to do."""


USER_ERRORS = (DataError, UserError, FileNotFoundError)   # run.workdir.RunDirLocked is a UserError


def fail(message: str) -> None:
  """Prints `error: message` (on one line) to stderr and exits with EXIT_STATUS."""
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
  sys.exit(EXIT_STATUS)


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
  """warnings.showwarning as one line: `warning: message` on stderr."""
  print(f"warning: {' '.join(str(message).split())}", file=file or sys.stderr, flush=True)


@contextlib.contextmanager
def reported():
  """Runs the block, showing warnings as one line each (show_warning); a USER_ERRORS exception ends the
  program with fail(its message)."""
  shown, warnings.showwarning = warnings.showwarning, show_warning
  try:
    yield
  except USER_ERRORS as error:
    text = str(error)
    if isinstance(error, FileNotFoundError) and error.filename and error.strerror:
      text = f"file {error.filename!r} does not exist"
    fail(text)
  finally:
    warnings.showwarning = shown
