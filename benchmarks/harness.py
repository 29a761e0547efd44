"""The benchmark harness: every system in a process of its own, timed round-robin; statistics; machine facts.

    workers = [Worker("ours", "benchmarks.systems.ours", spec), Worker("torch", ...), ...]
    start(workers, log_dir)                     # one at a time, so that compile times are not shared
    times = round_robin(workers, "greedy", warmup=2, repeats=7, pause=0.5)    # {name: [seconds, ...]}
    close(workers)

A worker process (benchmarks/worker.py) imports only its own system and loads the shared files
(benchmarks/files.py). In each round every worker runs the task once, in turn, so that load from elsewhere
on the machine hits every system alike; the first worker of a round rotates, so that no system always
follows the same one. Before each timed run the harness sleeps `pause` seconds, so that the worker
threads of the system before (OpenMP and XLA spin for a while after their work) are idle. The times
are measured inside the worker around the run alone. Standard library only.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import selectors
import statistics
import subprocess
import sys
import time

from experiments import _cpu as cpu

REPO = pathlib.Path(__file__).resolve().parent.parent


def _child_env(extra: dict, tree=REPO) -> dict:
  """The environment of a child process: ours, plus `extra`, with `tree` (this checkout) first on the path."""
  env = dict(os.environ, **extra)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
  return env


class WorkerError(RuntimeError):
  """A worker failed, hung or exited; its message is the reason recorded in the results."""


class Worker:
  """One system in its own process. status: 'new', 'ready', 'absent' or 'failed' (with `reason`)."""

  def __init__(self, name: str, module: str, spec: dict, env: dict | None = None, tree=REPO):
    """tree: the checkout the worker's code comes from (another one: a before/after comparison)."""
    self.name, self.module, self.spec, self.env, self.tree = name, module, spec, env or {}, tree
    self.status, self.reason, self.pid, self.info, self.tasks = "new", None, None, {}, []
    self.process = self.log = None

  def start(self, log_dir, timeout: float) -> None:
    """Starts the process and waits until it is set up (loaded, compiled, warmed once)."""
    self.log = pathlib.Path(log_dir) / f"{self.name}.log"
    env = _child_env(self.env, self.tree)
    with open(self.log, "w") as log:
      self.process = subprocess.Popen([sys.executable, "-m", self.module, json.dumps(self.spec)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                      env=env, cwd=self.tree, text=True, bufsize=1)
    try:
      message = self._receive(timeout)
    except WorkerError as error:
      self._fail(str(error))
      return
    if "ready" in message:
      ready = message["ready"]
      self.status, self.pid, self.info, self.tasks = "ready", ready["pid"], ready["info"], ready["tasks"]
    else:
      absent = "absent" in message
      self._fail(message["absent"] if absent else message.get("failed"), "absent" if absent else "failed")

  def run(self, task: str, timeout: float) -> float:
    """Runs `task` once; returns its seconds as the worker measured them."""
    self.send(task)
    return self.seconds(timeout)

  def send(self, task: str) -> None:
    """Starts `task` without waiting for it (several workers can run at once); then `seconds`."""
    try:
      self.process.stdin.write(json.dumps({"run": task}) + "\n")
      self.process.stdin.flush()
    except (BrokenPipeError, OSError):
      raise WorkerError(f"{self.name} exited ({self._log_tail()})") from None

  def seconds(self, timeout: float) -> float:
    """Waits for the run that `send` started; returns its seconds as the worker measured them."""
    message = self._receive(timeout)
    if "seconds" not in message:
      raise WorkerError(message.get("failed", str(message)))
    return message["seconds"]

  def close(self) -> None:
    if self.process and self.process.poll() is None:
      try:
        self.process.stdin.write(json.dumps({"quit": True}) + "\n")
        self.process.stdin.close()
        self.process.wait(timeout=30)
      except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
        self.process.kill()
        self.process.wait()

  def _receive(self, timeout: float) -> dict:
    with selectors.DefaultSelector() as selector:
      selector.register(self.process.stdout, selectors.EVENT_READ)
      if not selector.select(timeout):
        self.process.kill()
        raise WorkerError(f"{self.name} gave no answer within {timeout:.0f} s (killed)")
    line = self.process.stdout.readline()
    if not line:
      self.process.wait()
      raise WorkerError(f"{self.name} exited with code {self.process.returncode} ({self._log_tail()})")
    return json.loads(line)

  def _fail(self, reason: str, status: str = "failed") -> None:
    self.status, self.reason = status, reason
    self.close()

  def _log_tail(self, lines: int = 3) -> str:
    try:
      tail = [l for l in self.log.read_text().splitlines() if l.strip()][-lines:]
    except OSError:
      tail = []
    return " | ".join(tail)[-600:] or "no output"


def prepare(spec: dict, log_dir) -> None:
  """Writes the shared files (benchmarks/prepare.py) in a process of its own, which exits before timing."""
  log = pathlib.Path(log_dir) / "prepare.log"
  env = _child_env({})
  with open(log, "w") as out:
    code = subprocess.run([sys.executable, "-m", "benchmarks.prepare", json.dumps(spec)], stdout=out,
                          stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
  if code:
    raise SystemExit(f"benchmarks.prepare failed (exit code {code}):\n{log.read_text()[-2000:]}")


def start(workers: list[Worker], log_dir, timeout: float = 1800.0) -> None:
  """Starts the workers one after another (each sets up alone, so its compile time is its own)."""
  for worker in workers:
    print(f"[harness] starting {worker.name}", file=sys.stderr, flush=True)
    worker.start(log_dir, timeout)
    if worker.status != "ready":
      print(f"[harness] {worker.name} {worker.status}: {worker.reason}", file=sys.stderr, flush=True)


def close(workers: list[Worker]) -> None:
  for worker in workers:
    worker.close()


def round_robin(workers: list[Worker], task: str, *, warmup: int, repeats: int, pause: float,
                timeout: float = 900.0) -> dict[str, list[float]]:
  """Times `task` on every ready worker that offers it: `warmup` untimed runs each, then `repeats` rounds
  of one run per worker. A worker that fails is marked failed and leaves the rotation.
  Returns {worker name: [seconds per round]}."""
  active = [w for w in workers if w.status == "ready" and task in w.tasks]
  times = {w.name: [] for w in active}

  def attempt(worker) -> float | None:
    try:
      return worker.run(task, timeout)
    except WorkerError as error:
      worker._fail(f"{task}: {error}")
      active.remove(worker)
      times.pop(worker.name, None)
      return None

  for worker in list(active):
    for _ in range(warmup):
      if attempt(worker) is None:
        break
  for round_ in range(repeats):
    order = active[round_ % len(active):] + active[:round_ % len(active)] if active else []
    for worker in order:
      time.sleep(pause)
      seconds = attempt(worker)
      if seconds is not None:
        times[worker.name].append(seconds)
  return times


def summary(seconds: list[float]) -> dict:
  """Median and spread of one system's timed runs."""
  s = sorted(seconds)
  q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else (s[0], s[0], s[0])
  return {"median_s": statistics.median(s), "min_s": s[0], "max_s": s[-1], "q1_s": q1, "q3_s": q3,
          "runs": len(s), "seconds": seconds}


# ----------------------------------------------------------------------------------------------------
# The machine.
# ----------------------------------------------------------------------------------------------------
machine = cpu.machine              # CPU model, cores and bfloat16 flags (experiments/_cpu.py)


def versions(names=("jax", "jaxlib", "flax", "torch", "transformers", "ctranslate2", "numpy")) -> dict:
  """Installed versions (from package metadata: nothing is imported)."""
  out = {"python": platform.python_version()}
  for name in names:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = "absent"
  return out


def commit_of(tree=REPO) -> str:
  """The short commit of a checkout, with '+changes' when its tracked files (results apart) differ from it."""
  git = lambda *a: subprocess.run(["git", "-C", str(tree), *a], capture_output=True, text=True)
  head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
  changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results").stdout
  return head + ("+changes" if changed.strip() else "")


def finish(result: dict, out, render) -> dict:
  """Ends a benchmark: the load average at the end, the results JSON written to `out`, and the page
  section `render(result)` printed. Returns the result."""
  result["load_average"]["end"] = os.getloadavg()[0]
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  print(render(result))
  print(f"wrote {out}")
  return result


def now() -> str:
  return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
