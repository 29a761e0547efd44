"""Where metrics go: workdir/metrics.jsonl, TensorBoard event files under workdir/tb, and the console.

metrics.jsonl holds one JSON object per line: train lines {"step", "train/loss", "train/nll", ...} every
log_every steps, eval lines {"step", "eval/loss", "eval/ppl", ... and "eval/bleu" when computed}, and a
final {"step", "test/bleu", "test/signature"}. On resume, lines past the restored step are dropped (they
will be written again), so the file of a resumed run equals that of an uninterrupted one.
"""
from __future__ import annotations

import json
import math
import pathlib
import sys

from run.user_errors import UserError
from run.workdir import DAMAGED, read_file, run_file, write_atomically

METRICS = "metrics.jsonl"
TB = "tb"


def _jsonable(value):
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)   # JSON has no NaN/inf; keep it readable
  return value


def tensorboardx():
  """The tensorboardX package (and its `summary` module), imported without PyTorch: tensorboardX imports
  torch whenever it is installed (the interop extra), only to accept torch tensors, which we never log;
  that import was 1.6 s of every trainer's start, and 1.6 s of every sweep trial's (tests/TIMES.md). torch
  stays importable afterwards, and a process that has already imported it keeps it."""
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None   # `import torch` raises ImportError, which tensorboardX handles
  try:
    import tensorboardX
    import tensorboardX.summary
  finally:
    if hide:
      del sys.modules["torch"]
  return tensorboardX


class MetricsWriter:
  """Appends metric dicts to metrics.jsonl and TensorBoard (scalars only)."""

  def __init__(self, workdir, resume_step: int = 0, tensorboard: bool = True, drop_reports: bool = False):
    """drop_reports: also drop the eval/test lines AT resume_step (a finished run reporting again
    rewrites them instead of adding a second copy)."""
    self.path = pathlib.Path(workdir) / METRICS
    truncate_after(self.path, resume_step, drop_reports_at_step=drop_reports)
    self._file = open(self.path, "a")
    self._tb = None
    if tensorboard:
      # purge_step drops events of an interrupted run past the step we resume from.
      self._tb = tensorboardx().SummaryWriter(str(pathlib.Path(workdir) / TB),
                                              purge_step=resume_step if resume_step > 0 else None)

  def write(self, step: int, metrics: dict) -> None:
    line = {"step": int(step)}
    line.update({k: _jsonable(float(v) if not isinstance(v, str) else v) for k, v in metrics.items()})
    self._file.write(json.dumps(line) + "\n")
    self._file.flush()
    if self._tb is not None:
      for key, value in metrics.items():
        if not isinstance(value, str):
          self._tb.add_scalar(key, float(value), int(step))
      self._tb.flush()

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


class NoMetrics:
  """What processes other than 0 write metrics to: nowhere."""

  def write(self, step, metrics) -> None:
    pass

  def close(self) -> None:
    pass


def _is_report(record: dict) -> bool:
  return any(key.startswith(("eval/", "test/")) for key in record)


def truncate_after(path, step: int, drop_reports_at_step: bool = False) -> None:
  """Drops the lines of a metrics.jsonl with "step" > step (atomically); with drop_reports_at_step, also
  the eval/test lines with "step" == step."""
  path = pathlib.Path(path)
  if not path.exists():
    return
  kept = []
  for line in path.read_text().splitlines():
    try:
      record = json.loads(line)
      if record["step"] < step or (record["step"] == step and not (drop_reports_at_step
                                                                   and _is_report(record))):
        kept.append(line)
    except (ValueError, KeyError):
      continue   # a line cut short by a kill
  write_atomically(path, "".join(line + "\n" for line in kept))


def read_metrics(workdir) -> list[dict]:
  """All lines of workdir/metrics.jsonl as dicts. A last line cut short by a kill is left out (the trainer
  drops it on resume); any other line that is not a JSON object with a "step" is a UserError naming it."""
  path = run_file(workdir, METRICS)
  lines = read_file(path).splitlines()
  records = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as error:
      if number == len(lines):
        break
      raise UserError(f"{path} line {number} is not JSON ({error.msg}): {DAMAGED}") from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
      raise UserError(f"{path} line {number} is not a metrics record (a JSON object with an integer "
                      f"\"step\"): {DAMAGED}")
    records.append(record)
  return records
