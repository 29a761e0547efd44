"""The progress of a bulk decoding job, read from its directory: a bar with lines/s, target tokens/s and
the ETA over all workers, and the summary at the end. Nothing here imports JAX, so `--processes K` and
`--launcher slurm` show it from a process that loads no model."""
from __future__ import annotations

import json
import pathlib
import sys
import time

import tqdm

from decode import job as job_lib


class Progress:
  """Polls OUTPUT.parts/ for finished parts; counts what this command saw finish. The bar's rates are
  averages since it appeared (tqdm's smoothing=0), so that its lines/s and tokens/s agree."""

  def __init__(self, output, *, enabled: bool = True):
    self.output = pathlib.Path(output)
    self.enabled = enabled
    self.start = time.perf_counter()
    self.job: job_lib.Job | None = None
    self.seen: dict[int, dict] = {}     # part -> its stats, once done
    self.before: tuple[int, int] | None = None   # lines, target tokens done when we first looked
    self.bar = None
    self.stamp = None                   # the manifest's mtime when read
    self.initial = self._stamp()        # ... when this command started (None: there was no job)

  def _totals(self) -> tuple[int, int]:
    done = self.job.dir / job_lib.DONE
    if self.job.joined():
      totals = json.loads(done.read_text())
      return totals["lines"], totals["tgt_tokens"]
    for part in range(self.job.num_parts):
      if part not in self.seen and self.job.is_done(part):
        try:
          self.seen[part] = json.loads(self.job.stats_file(part).read_text())
        except (FileNotFoundError, json.JSONDecodeError):   # joined meanwhile: counted next time
          pass
    stats = self.seen.values()
    return sum(s["lines"] for s in stats), sum(s["tgt_tokens"] for s in stats)

  def _stamp(self) -> int | None:
    try:
      return (job_lib.job_dir(self.output) / job_lib.MANIFEST).stat().st_mtime_ns
    except FileNotFoundError:
      return None

  def poll(self) -> None:
    manifest = job_lib.job_dir(self.output) / job_lib.MANIFEST
    try:
      stamp = manifest.stat().st_mtime_ns
      if stamp != self.stamp:   # the first look, or a finished job's manifest replaced by a new job's
        self.job, self.stamp = job_lib.Job(self.output, json.loads(manifest.read_text())), stamp
        if self.bar is not None:
          self.bar.close()
        self.seen, self.before, self.bar = {}, None, None
    except (FileNotFoundError, json.JSONDecodeError):   # no worker has made it yet
      return
    lines, tokens = self._totals()
    if self.before is None:
      # a job made since this command started had nothing done before it, however much its workers
      # finished before this first look
      self.before = (lines, tokens) if self.stamp == self.initial else (0, 0)
      self.bar_start = time.perf_counter()
      self.bar = tqdm.tqdm(total=self.job.lines, initial=lines, desc="decode", unit="line",
                           disable=not self.enabled, dynamic_ncols=True, file=sys.stderr, smoothing=0)
    elapsed = max(time.perf_counter() - self.bar_start, 1e-9)
    self.bar.set_postfix_str(f"{(tokens - self.before[1]) / elapsed:.0f} tgt tok/s", refresh=False)
    self.bar.update(lines - self.bar.n)

  def summary(self) -> str:
    """One line: what this command translated (and found done), how fast, where the output is."""
    self.poll()
    if self.bar is not None:
      self.bar.close()
    if self.job is None:
      return f"[decode] no job started for {self.output}"
    lines, tokens = self._totals()
    elapsed = max(time.perf_counter() - self.start, 1e-9)
    new_lines, new_tokens = lines - self.before[0], tokens - self.before[1]
    state = "done" if self.job.joined() else f"{self.job.lines - lines} lines left"
    return (f"[decode] {new_lines} lines translated in {elapsed:.1f} s ({new_lines / elapsed:.1f} lines/s, "
            f"{new_tokens / elapsed:.0f} target tokens/s over all workers); {self.before[0]} lines were "
            f"done before; {self.job.lines} lines in {self.job.num_parts} parts: {state} -> {self.output}")
