"""SIGTERM and SIGINT as a flag that a loop checks between units of work (a train step, a dev-evaluation
batch or BLEU chunk, a sweep poll).

    signals = SignalFlag().install()
    try:
      while ... and signals.received is None: ...
    finally:
      signals.restore()
"""
from __future__ import annotations

import signal


class SignalFlag:
  """Records the name of the first SIGTERM/SIGINT received ('SIGTERM') instead of dying at once."""

  def __init__(self):
    self.received = None
    self._previous = {}

  def install(self) -> "SignalFlag":
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:   # not the main thread: leave signals alone
        pass
    return self

  def _handle(self, signum, frame):
    self.received = self.received or signal.Signals(signum).name

  def restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
