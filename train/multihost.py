"""Several processes, one training run: joining the job, who writes what, and agreeing across processes.

    multihost.initialize()             # before any other JAX call; a no-op for a single process
    if multihost.is_primary(): ...     # process 0 alone writes metrics, the console and the progress bar
    hyps = multihost.map_split(translate_some, sentences)   # each process does its share; all get all

When to join (`initialize(mode=...)`):
  - "auto" (default): join when launched as one of several processes: explicit settings (arguments, or
    the environment variables JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID, as
    `python -m jobs.launch` sets them), a SLURM step or an Open MPI job with more than one task (JAX
    detects those itself). Anything else runs as one process, exactly as before.
  - "on": always call jax.distributed.initialize() and let JAX detect the cluster (TPU pod slices,
    Kubernetes, ...).
  - "off": never join.
On CPU the processes exchange arrays with gloo.

Which devices each process drives (run/devices.py): every GPU it sees with one process per node, its own
GPU(s) with one process per GPU; `initialize` passes them to JAX as local_device_ids, and `check_devices`
then logs `processes x local devices = global devices` per host and refuses, in one line naming the
numbers, a process that sees other devices than the job asked for (unless allow_mismatch).
"""
from __future__ import annotations

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from run import devices
from run.user_errors import UserError

MODES = ("auto", "on", "off")
log = logging.getLogger("train.multihost")


class DeviceMismatch(UserError):
  """The devices a process sees differ from what its job asked for (see check_devices)."""


def _launched_as_several() -> bool:
  """True if the environment says this process is one of several (SLURM step or Open MPI job)."""
  env = os.environ
  if "SLURM_STEP_NODELIST" in env and int(env.get("SLURM_NTASKS", env.get("SLURM_STEP_NUM_TASKS", "1"))) > 1:
    return True
  return int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1


def initialize(mode: str = "auto", coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, layout: devices.Layout | None = None) -> bool:
  """Joins the multi-process job if there is one (see the module docstring). Returns True if it joined.

  Must run before anything else touches JAX's backends. Explicit arguments win over the environment.
  layout: this process's devices (default: run.devices.plan(), from the environment).
  """
  if mode not in MODES:
    raise ValueError(f"--distributed={mode!r}: use one of {MODES}")
  env = os.environ
  coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
  if num_processes is None and env.get("JAX_NUM_PROCESSES"):
    num_processes = int(env["JAX_NUM_PROCESSES"])
  if process_id is None and env.get("JAX_PROCESS_ID"):
    process_id = int(env["JAX_PROCESS_ID"])
  explicit = [coordinator_address, num_processes, process_id]
  if any(v is not None for v in explicit) and None in explicit and not _launched_as_several():
    raise ValueError(
        f"a manual multi-process launch needs all three of coordinator address, number of processes and "
        f"process id (flags --coordinator_address/--num_processes/--process_id or JAX_COORDINATOR_ADDRESS/"
        f"JAX_NUM_PROCESSES/JAX_PROCESS_ID); got {coordinator_address!r}, {num_processes!r}, "
        f"{process_id!r}")
  if mode == "off" or (mode == "auto" and None in explicit and not _launched_as_several()):
    return False
  if num_processes == 1 and mode == "auto":
    return False
  layout = devices.plan() if layout is None else layout
  ids = None if layout.local_device_ids is None else list(layout.local_device_ids)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, local_device_ids=ids)
  return True


def check_devices(layout: devices.Layout | None = None, allow_mismatch: bool = False,
                  every_process: bool = False) -> list[dict]:
  """After initialize: every process reports its devices; process 0 logs `P processes x L local devices =
  G global devices`, per host. If a process sees other devices than its job asked for (run/devices.py),
  every process raises the same one-line DeviceMismatch, unless allow_mismatch (then process 0 warns).
  every_process: each process also logs its own line. Returns the reports, one per process."""
  layout = devices.plan() if layout is None else layout
  local = jax.local_devices()
  me = devices.record(layout, jax.process_index(), len(local), jax.default_backend(), [d.id for d in local])
  if every_process:
    log.info(f"[devices] process {me['process']} of {jax.process_count()} on {me['host']}: "
             f"{me['devices']} {me['platform']} device{'' if me['devices'] == 1 else 's'}, ids {me['ids']}; "
             f"{devices.usable_cpus()} CPUs"
             + (f" (local_device_ids {list(layout.local_device_ids)})" if layout.local_device_ids else ""))
  records = gather_objects(me)
  if is_primary():
    log.info(f"[devices] {devices.summary(records)}")
  problems = devices.mismatches(records)
  if problems:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    message = f"device layout: {problems[0]}{more}"
    if not allow_mismatch:
      raise DeviceMismatch(f"{message}; fix the job's --gpus_per_node/--tasks_per_node (or "
                           f"CUDA_VISIBLE_DEVICES), or pass --allow_device_mismatch to run anyway")
    if is_primary():
      log.warning(f"[devices] warning: {message}; running anyway (--allow_device_mismatch)")
  return records


def is_primary() -> bool:
  """True in process 0: the one that writes metrics.jsonl, TensorBoard, the console and the progress bar."""
  return jax.process_index() == 0


def say(message: str) -> None:
  """Logs `message` at INFO on the console, in process 0 only."""
  if is_primary():
    log.info(message)


def barrier(name: str) -> None:
  """Waits until every process got here (a no-op for one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def host_tree(tree):
  """A global (possibly sharded) pytree of arrays -> numpy arrays, the whole value in every process."""
  if jax.process_count() == 1:
    return jax.device_get(tree)

  def one(x):
    if not isinstance(x, jax.Array):
      return np.asarray(x)
    if x.is_fully_replicated or x.is_fully_addressable:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree_util.tree_map(one, tree)


def gather_objects(local) -> list:
  """Every process's JSON-serialisable `local` value, as a list indexed by process (in every process)."""
  if jax.process_count() == 1:
    return [local]
  data = np.frombuffer(json.dumps(local).encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.asarray([data.size], np.int64))   # [processes, 1]
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  every = multihost_utils.process_allgather(padded)                                 # [processes, longest]
  return [json.loads(bytes(row[:int(n)]).decode()) for row, n in zip(every, sizes.reshape(-1))]


def map_split(fn, items: list) -> list:
  """fn(items[p::P]) in process p of P, gathered: the same list as fn(items) in every process.

  fn takes a list and returns a JSON-serialisable list of the same length, one result per item.
  """
  count, index = jax.process_count(), jax.process_index()
  if count == 1:
    return list(fn(list(items)))
  mine = list(fn(list(items[index::count])))
  out = [None] * len(items)
  for p, results in enumerate(gather_objects(mine)):
    out[p::count] = results
  return out


class StopVote:
  """Every process stops the training loop after the same step, whichever of them got the signal.

  vote(flag) casts this step's flag and returns the agreed answer (any process flagged) of the previous
  vote: one step late, so that the host never waits for the step in flight. One process: no vote, the
  flag itself.
  """

  def __init__(self, mesh):
    self._mesh = mesh
    self._previous = None
    if jax.process_count() > 1:
      self._sharding = NamedSharding(mesh, P("data"))
      self._any = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))

  def vote(self, flag: bool) -> bool:
    if jax.process_count() == 1:
      return flag
    local = np.full((len(self._mesh.local_devices),), int(flag), np.int32)
    current = self._any(jax.make_array_from_process_local_data(self._sharding, local))
    previous, self._previous = self._previous, current
    return previous is not None and bool(np.asarray(previous.addressable_data(0)))

  def settle(self) -> bool:
    """The answer of the last vote cast (waits for it)."""
    return self._previous is not None and bool(np.asarray(self._previous.addressable_data(0)))
