"""What a command shows while it works. The train, data and run packages log through `logging` (one logger
per module, under the loggers "train", "data" and "run"); an entry point calls `log_to_console()` once,
which shows their records as the message alone: INFO on stdout, WARNING and above on stderr. Progress
bars (tqdm) and the one-line errors of run/user_errors.py write to the console themselves.

To silence or redirect them (docs/training.md), set those loggers' level or handlers, e.g.
`logging.getLogger("train").setLevel(logging.WARNING)`.
"""
from __future__ import annotations

import logging
import sys

LOGGERS = ("train", "data", "run")
HANDLER_NAME = "aiayn-console"


class ConsoleHandler(logging.Handler):
  """A record's message alone, on the stream the command printed it to before it logged: sys.stdout, or
  sys.stderr from WARNING up. The stream is looked up for each record, so a test that captures it sees it."""

  def emit(self, record: logging.LogRecord) -> None:
    try:
      stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
      stream.write(self.format(record) + "\n")
      stream.flush()
    except Exception:  # noqa: BLE001 - logging's contract: a handler reports its own failure
      self.handleError(record)


def log_to_console() -> ConsoleHandler:
  """Shows the INFO records of LOGGERS on the console through one ConsoleHandler (replacing one an earlier
  call installed), and on it alone: a library that configures the root logger (TFDS does) would print
  them a second time. -> the handler."""
  handler = ConsoleHandler(logging.INFO)
  handler.set_name(HANDLER_NAME)
  for name in LOGGERS:
    logger = logging.getLogger(name)
    for old in [h for h in logger.handlers if h.get_name() == HANDLER_NAME]:
      logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
  return handler
