"""`python -m jobs.launch`: a multi-process job on this machine, the way a cluster would start one.

    python -m jobs.launch --processes 2 --devices_per_process 4 -- \\
        --config experiments/default.py:smoke --workdir /tmp/mp

starts N copies of `python -m train <flags>` with a coordinator on 127.0.0.1 (a free port) and, with
--devices_per_process K, K CPU devices each (jax_num_cpu_devices). Every output line is prefixed with
its process ("[p1] ..."). SIGINT/SIGTERM are passed on to every process (they save a checkpoint and
stop). If one process fails, the others are stopped too and the launcher exits with the failed one's code.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_SECONDS = 30   # after a failure: how long the others get to stop on SIGTERM before SIGKILL


def free_port() -> int:
  """A free TCP port for the coordinator, below Linux's ephemeral range (32768-60999): a port the kernel
  hands out (bind to 0) can be taken by another job's gloo connections before our coordinator binds it."""
  rng = random.Random()
  for _ in range(200):
    port = rng.randrange(20000, 32768)
    with socket.socket() as s:
      try:
        s.bind(("127.0.0.1", port))
      except OSError:
        continue
      return port
  raise RuntimeError("no free port between 20000 and 32767 for the coordinator")


def process_env(index: int, count: int, port: int, devices: int | None, base=None) -> dict:
  """The environment of process `index` of `count` (train/multihost.py reads the JAX_* variables)."""
  env = dict(os.environ if base is None else base)
  env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(count),
             JAX_PROCESS_ID=str(index))
  if devices:
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
    # An inherited --xla_force_host_platform_device_count would fight jax_num_cpu_devices.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = flags
    if not flags:
      del env["XLA_FLAGS"]
  return env


def _relay(stream, prefix: str, out) -> None:
  for line in iter(stream.readline, ""):
    out.write(f"{prefix}{line}")
    out.flush()
  stream.close()


def launch(args: list[str], processes: int, devices_per_process: int | None = None, module: str = "train",
           out=None) -> int:
  """Runs `python -m module args` as `processes` cooperating processes; returns the job's exit code."""
  out = out or sys.stdout
  port = free_port()
  children, relays = [], []
  for index in range(processes):
    child = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1,
                             env=process_env(index, processes, port, devices_per_process))
    relay = threading.Thread(target=_relay, args=(child.stdout, f"[p{index}] ", out), daemon=True)
    relay.start()
    children.append(child)
    relays.append(relay)

  def forward(signum, frame):
    for child in children:
      if child.poll() is None:
        child.send_signal(signum)

  previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
  code = 0
  try:
    while any(child.poll() is None for child in children):
      failed = [c for c in children if c.returncode not in (None, 0)]
      if failed:
        code = failed[0].returncode
        _stop(children)
        break
      time.sleep(0.1)
    for child in children:
      child.wait()
    code = code or next((c.returncode for c in children if c.returncode != 0), 0)
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
    _stop(children)
    for relay in relays:
      relay.join(timeout=5)
  if code:
    print(f"[launch] failed: exit codes {[c.returncode for c in children]}", file=out, flush=True)
  return 1 if code and code < 0 else code


def _stop(children) -> None:
  """SIGTERM to the processes still running, SIGKILL to those that outlive the grace period."""
  alive = [c for c in children if c.poll() is None]
  for child in alive:
    child.send_signal(signal.SIGTERM)
  deadline = time.time() + GRACE_SECONDS
  for child in alive:
    try:
      child.wait(timeout=max(0.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      child.kill()
      child.wait()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jobs.launch", description=__doc__.split("\n\n")[0],
                                   usage="python -m jobs.launch --processes N [--devices_per_process K] "
                                         "-- TRAIN_FLAGS")
  parser.add_argument("--processes", type=int, required=True, help="how many processes")
  parser.add_argument("--devices_per_process", type=int, default=None,
                      help="CPU devices per process (default: what JAX finds)")
  parser.add_argument("--module", default="train", help="the module each process runs (default: train)")
  argv = sys.argv[1:] if argv is None else list(argv)
  ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
  args = parser.parse_args(ours)
  if args.processes < 1:
    parser.error(f"--processes must be >= 1, got {args.processes}")
  if args.devices_per_process is not None and args.devices_per_process < 1:
    parser.error(f"--devices_per_process must be >= 1, got {args.devices_per_process}")
  return launch(rest, args.processes, args.devices_per_process, args.module)


if __name__ == "__main__":
  sys.exit(main())
