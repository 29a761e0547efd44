"""Where a run's wall-clock goes: step compute, waiting for input, evaluation, checkpointing, compilation.

    clock = Goodput()
    with clock.part("input"):
      batch = next(batches)
    state, metrics = train_step(state, batch, key)      # not in a part: counted as step time
    ...
    split = clock.close_interval()   # {'step': s, 'input': s, 'eval': s, 'checkpoint': s, 'compile': s}

Every second of an interval lands in exactly one part: `step` is what the measured parts leave of the
interval's wall-clock, so the parts sum to it. Compilation is read from JAX's own compile events
(jax.monitoring: tracing, lowering, XLA compilation or a persistent-cache read), wherever it happens (the
first call of a step, the first evaluation), and taken out of the part it happened in; the run's summary
names its kinds (COMPILE_KINDS). With asynchronous
dispatch the host fetches the next batch while the device still computes the last step, so `input` is
the host's time in the input pipeline: an upper bound on the device's wait for it.
"""
from __future__ import annotations

import contextlib
import threading
import time

import jax

PARTS = ("step", "input", "eval", "checkpoint", "compile")
# JAX's events for tracing (outermost jits only), lowering to StableHLO, and XLA compilation, which
# includes reading the persistent compilation cache where it holds the program (its own event)
_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "tracing",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
           "/jax/core/compile/backend_compile_duration": "backend compile",
           "/jax/compilation_cache/cache_retrieval_time_sec": "cache reads",
           "/aiayn/program_cache/load_sec": "program loads"}
COMPILE_KINDS = ("tracing", "lowering", "cache reads", "backend compile")
# seconds reported in this process's main thread so far; "backend compile" with its cache reads, and the
# programs run/programs.py loaded without tracing (shown within "cache reads")
_compile_seconds = dict.fromkeys(_EVENTS.values(), 0.0)
_registered = []


def _on_event(name: str, seconds: float, **kwargs) -> None:
  if name in _EVENTS and threading.current_thread() is threading.main_thread():
    _compile_seconds[_EVENTS[name]] += seconds


def _compiled() -> float:
  if not _registered:   # one listener per process, however many runs it trains
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    _registered.append(True)
  return sum(seconds for kind, seconds in _compile_seconds.items() if kind != "cache reads")


class Goodput:
  """Accumulates PARTS per log interval (close_interval) and for the whole run (`total`)."""

  def __init__(self):
    self.total = dict.fromkeys(PARTS, 0.0)
    self._interval = dict.fromkeys(PARTS, 0.0)
    self._start = time.perf_counter()
    self._compile_mark = _compiled()
    self._kinds_mark = dict(_compile_seconds)

  @contextlib.contextmanager
  def part(self, name: str):
    """Counts the block's wall-clock as `name` (less any compilation inside it)."""
    if name not in PARTS or name in ("step", "compile"):
      raise ValueError(f"part {name!r}: one of {PARTS[1:-1]}")
    start, compiled = time.perf_counter(), _compiled()
    try:
      yield
    finally:
      elapsed = time.perf_counter() - start
      self._interval[name] += max(elapsed - min(_compiled() - compiled, elapsed), 0.0)

  def close_interval(self) -> dict:
    """The split of the wall-clock since the last call (or construction), in seconds; starts the next."""
    now, compiled = time.perf_counter(), _compiled()
    wall = now - self._start
    split = dict(self._interval)
    split["compile"] = min(compiled - self._compile_mark, wall)
    split["step"] = max(wall - sum(split[k] for k in PARTS if k != "step"), 0.0)
    for key in PARTS:
      self.total[key] += split[key]
    self._interval = dict.fromkeys(PARTS, 0.0)
    self._start, self._compile_mark = now, compiled
    return split

  def compile_split(self) -> dict:
    """{COMPILE_KINDS: seconds} since construction: what `compile` was, XLA's compilation less the
    cache reads within it."""
    spent = {k: _compile_seconds[k] - self._kinds_mark[k] for k in _compile_seconds}
    kinds = {k: spent[k] for k in COMPILE_KINDS}
    kinds["backend compile"] -= spent["cache reads"]
    kinds["cache reads"] += spent["program loads"]
    return kinds

  def summary(self) -> str:
    """One line: the whole run's split, in seconds and shares of the wall-clock."""
    wall = max(sum(self.total.values()), 1e-9)
    parts = ", ".join(f"{k} {self.total[k]:.1f} s ({self.total[k] / wall:.0%})" for k in PARTS)
    compile_kinds = ", ".join(f"{k} {s:.1f} s" for k, s in self.compile_split().items())
    return f"[train] time: {wall:.1f} s = {parts} [{compile_kinds}]; goodput {self.total['step'] / wall:.0%}"


def interval_metrics(split: dict) -> dict:
  """A close_interval split as metrics.jsonl keys: time/<part>_s and time/wall_s."""
  out = {f"time/{k}_s": v for k, v in split.items()}
  out["time/wall_s"] = sum(split.values())
  return out
