"""The worker side of the benchmark protocol: one system, in a process of its own, timing one run per request.

A system module (benchmarks/systems/*.py) defines `setup(spec) -> (tasks, info)`, where tasks maps a task
name ('peak', 'train', 'greedy', 'beam4') to a zero-argument callable that runs it once to completion,
and calls `serve(setup)` from its `main`. The harness (benchmarks/harness.py) starts it as
`python -m benchmarks.systems.NAME SPEC_JSON` and talks to it in JSON lines:

    worker -> {"ready": {"pid": ..., "tasks": [...], "info": {...}}}   or {"absent": why} / {"failed": why}
    harness -> {"run": "greedy"}        worker -> {"seconds": 0.123}     (or {"failed": why}, then exits)
    harness -> {"quit": true} (or closes stdin)                          worker exits

Only this module's standard-library code runs before setup, so a worker imports nothing but its own
system. Anything a library prints to stdout is sent to stderr, which keeps stdout for the protocol.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _protocol_stream():
  """Keeps the real stdout for protocol lines and points file descriptor 1 at stderr."""
  out = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  return out


def _why(error: BaseException) -> str:
  return f"{type(error).__name__}: {str(error).strip()[:400]}"


def serve(setup) -> None:
  """Reads the spec from argv[1], sets the system up, then answers run requests until told to quit."""
  out = _protocol_stream()
  send = lambda message: out.write(json.dumps(message) + "\n")
  spec = json.loads(sys.argv[1])
  try:
    tasks, info = setup(spec)
  except ImportError as error:       # a peer that is not installed is reported, not skipped silently
    send({"absent": _why(error)})
    return
  except Exception as error:  # noqa: BLE001  (any failure is reported to the harness with its reason)
    traceback.print_exc()
    send({"failed": _why(error)})
    return
  send({"ready": {"pid": os.getpid(), "tasks": sorted(tasks), "info": info}})
  for line in sys.stdin:
    request = json.loads(line)
    if "quit" in request:
      break
    try:
      start = time.perf_counter()
      tasks[request["run"]]()
      send({"seconds": time.perf_counter() - start})
    except Exception as error:  # noqa: BLE001
      traceback.print_exc()
      send({"failed": _why(error)})
      return


def first_run(fn) -> float:
  """Runs fn once and returns its seconds (compiles, for systems that compile on the first call)."""
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def beam_size(spec: dict, task: str) -> int:
  """The beam a decoding task runs: 1 for greedy, the spec's beam_size for beam."""
  return 1 if task == "greedy" else spec["decode"]["beam_size"]
