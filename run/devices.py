"""Which accelerators each process of a job drives, read from the cluster's environment before JAX starts,
and the words that say so (or say what is wrong) once the job has joined.

    layout = devices.plan()      # environment only: nothing here starts a JAX backend
    jax.distributed.initialize(..., local_device_ids=layout.local_device_ids)
    records = [devices.record(layout), ...]          # one per process (train/multihost.py gathers them)
    devices.summary(records)     # '2 processes x 8 local devices = 16 global devices (gpu); per host: ...'
    devices.mismatches(records)  # what differs from what the job asked for, one sentence each

Both GPU layouts work:
  - one process per node driving all its GPUs (SLURM `--ntasks-per-node=1 --gpus-per-node=8`): the
    process gets every GPU it can see. JAX alone would give it one: its SLURM and Open MPI detection sets
    local_device_ids to [local rank] whenever the caller passes none.
  - one process per GPU (`--ntasks-per-node=8 --gpus-per-node=8`): process `local rank` of the node gets
    GPU `local rank` of the 8 it sees; where SLURM already bound each task to its own GPUs
    (`--gpus-per-task`, `--gpu-bind`), a task sees fewer GPUs than the node has and keeps all it sees.
In general the GPUs a task sees are split evenly among the tasks of its node that see the same GPUs.

What the job asked for: SLURM's GPUs on the node (SLURM_GPUS_ON_NODE, else SLURM_STEP_GPUS/SLURM_JOB_GPUS,
else SLURM_GPUS_PER_NODE) over its tasks on the node (SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE,
SLURM_TASKS_PER_NODE); under Open MPI the GPUs a process sees over OMPI_COMM_WORLD_LOCAL_SIZE; on a TPU
host, TPU_CHIPS_PER_HOST_BOUNDS (or _PER_PROCESS_) chips times the cores each chip shows as a device
(2 on v2/v3, else 1) where TPU_ACCELERATOR_TYPE is set; an explicit JAX_LOCAL_DEVICE_IDS (JAX reads it
too) asks for exactly those. The GPUs a process sees: the entries of CUDA_VISIBLE_DEVICES, else the GPUs
NVIDIA's driver lists in /proc/driver/nvidia/gpus. JAX_PLATFORMS without cuda/gpu/rocm means the user
chose another platform: GPUs are then not expected, unless SLURM allocated the job GPUs (SLURM_GPUS_ON_NODE,
SLURM_STEP_GPUS/SLURM_JOB_GPUS, SLURM_GPUS_PER_NODE, else CUDA_VISIBLE_DEVICES): then the layout's problem
names the variable (a JAX_PLATFORMS=cpu exported from the login shell would silently train on the CPU).
jobs.submit refuses the same mistake before the queue (gpu_platform_problem).

CPUs: record() compares the CPUs this process may use (its affinity) with SLURM_CPUS_PER_TASK and logs one
line when they differ (cpu_problem): from Slurm 22.05 to 23.02 srun did not pass the job's --cpus-per-task
on, and a task could get one CPU.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import socket

from data.vocab import threads as usable_cpus   # the CPUs this process may use, not the machine's

log = logging.getLogger(__name__)

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"   # one directory per GPU the driver knows
# SLURM's --cpus-per-task where the user gives none (jobs.submit, jobs.sweep, decode's launcher): enough
# for a GPU's input pipeline and a cold start's tokenization, and within what 8-GPU nodes offer (32 of
# 48-128 cores); without a GPU, 2, so that two trials share a small node.
CPUS_PER_GPU = 4
CPUS_WITHOUT_GPU = 2
GPU_PLATFORMS = r"cuda|gpu|rocm"   # JAX_PLATFORMS entries that drive a GPU


@dataclasses.dataclass(frozen=True)
class Layout:
  """What this process should drive. local_device_ids: for jax.distributed.initialize (None: leave it to
  JAX). expected: how many local devices it should see (None: nothing asked for). asked: what was asked,
  in words, for the messages. problem: a request that cannot be met (e.g. 8 GPUs among 3 tasks)."""
  cluster: str                        # "slurm", "ompi", "tpu", "explicit" or "none"
  local_device_ids: tuple | None = None
  expected: int | None = None
  asked: str = ""
  problem: str | None = None


def default_cpus_per_task(gpus_per_task: float) -> int:
  """--cpus-per-task for a task that drives `gpus_per_task` GPUs (0: none), when the user gives none."""
  return max(CPUS_WITHOUT_GPU, math.ceil(CPUS_PER_GPU * gpus_per_task))


def slurm_parameters(cpus_per_task: int, sbatch=()) -> dict:
  """submitit.SlurmExecutor parameters every job of ours shares: each task's CPUs, and the extra #SBATCH
  options (--sbatch KEY[=VALUE]) as submitit's additional_parameters.

  From Slurm 22.05 to 23.02 srun does not pass the job's --cpus-per-task on to its tasks (a task may get
  one CPU): the job's srun asks for them itself, and SRUN_CPUS_PER_TASK (srun's own variable, read since
  22.05) gives them to any other srun in the job."""
  extra = {}
  for option in sbatch:
    key, sep, value = option.partition("=")
    extra[key.replace("-", "_")] = value if sep else True
  return dict(cpus_per_task=cpus_per_task, srun_args=[f"--cpus-per-task={cpus_per_task}"],
              setup=[f"export SRUN_CPUS_PER_TASK={cpus_per_task}"], additional_parameters=extra)


def _platforms_without_gpu(env) -> str | None:
  """JAX_PLATFORMS where it names platforms and none that drives a GPU (e.g. 'cpu'), else None."""
  platforms = env.get("JAX_PLATFORMS", "").strip()
  return platforms if platforms and not re.search(GPU_PLATFORMS, platforms) else None


def gpu_platform_problem(asked: str, env=None) -> str | None:
  """A sentence where GPUs were asked for (`asked`: who asked, in words, e.g. '--gpus_per_node 8 asks for
  GPUs') but JAX_PLATFORMS names platforms none of which drives a GPU (e.g. 'cpu'); else None."""
  platforms = _platforms_without_gpu(os.environ if env is None else env)
  if platforms is None:
    return None
  return (f"{asked}, but JAX_PLATFORMS={platforms} leaves GPUs out, so JAX would run on the CPU: unset "
          f"JAX_PLATFORMS (or set JAX_PLATFORMS=cuda) where the job starts")


def cpu_problem(env=None, usable: int | None = None) -> str | None:
  """A sentence where this process may use other CPUs than its SLURM job asked for per task
  (SLURM_CPUS_PER_TASK), else None. usable: the CPUs it may use (default: its affinity, usable_cpus())."""
  env = os.environ if env is None else env
  asked = env.get("SLURM_CPUS_PER_TASK", "").strip()
  if not asked.isdigit():
    return None
  usable = usable_cpus() if usable is None else usable
  if usable == int(asked):
    return None
  why = ("srun did not hand the job's --cpus-per-task to the task (Slurm 22.05-23.02 do not pass it on: give "
         "srun --cpus-per-task or export SRUN_CPUS_PER_TASK; jobs.submit and jobs.sweep do)" if usable < int(asked)
         else "SLURM does not bind tasks to their CPUs here (no task/affinity or task/cgroup plugin)")
  return (f"this process may use {usable} CPU{'' if usable == 1 else 's'} (its affinity), but the job asked "
          f"for {asked} per task (SLURM_CPUS_PER_TASK={asked}): {why}; tokenization and the input pipeline "
          f"size their threads from the {usable}")


def visible_gpu_ids(env=None, driver_dir: str = NVIDIA_GPUS) -> list[str] | None:
  """The NVIDIA GPUs this process can see, as CUDA_VISIBLE_DEVICES names them (else the driver's count as
  0..N-1), without starting CUDA; None when nothing says."""
  env = os.environ if env is None else env
  value = env.get("CUDA_VISIBLE_DEVICES")
  if value is not None:
    ids = []
    for entry in value.split(","):
      entry = entry.strip()
      if not entry or entry == "NoDevFiles" or entry.startswith("-"):
        break   # CUDA stops enumerating at the first entry that names no device
      ids.append(entry)
    return ids
  try:
    return [str(i) for i in range(len(os.listdir(driver_dir)))]
  except OSError:
    return None


def visible_gpus(env=None, driver_dir: str = NVIDIA_GPUS) -> int | None:
  """How many NVIDIA GPUs this process can see, without starting CUDA; None when nothing says."""
  ids = visible_gpu_ids(env, driver_dir)
  return None if ids is None else len(ids)


def _expand(spec: str) -> list[int]:
  """SLURM's per-node counts, '2(x3),1' -> [2, 2, 2, 1]."""
  out = []
  for part in spec.split(","):
    match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
    if not match:
      return []
    out += [int(match.group(1))] * int(match.group(2) or 1)
  return out


def _gpu_count(value: str) -> int | None:
  """SLURM_GPUS_PER_NODE's '8', 'a100:8' or 'a100:4,v100:4' -> 8."""
  counts = [re.search(r"(\d+)$", part.strip()) for part in value.split(",") if part.strip()]
  return sum(int(m.group(1)) for m in counts) if counts and all(counts) else None


def _slurm_gpus_on_node(env) -> tuple[int | None, str]:
  if env.get("SLURM_GPUS_ON_NODE", "").strip().isdigit():
    return int(env["SLURM_GPUS_ON_NODE"]), "SLURM_GPUS_ON_NODE"
  for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
    if env.get(name, "").strip():
      return len([g for g in env[name].split(",") if g.strip()]), name
  if env.get("SLURM_GPUS_PER_NODE"):
    return _gpu_count(env["SLURM_GPUS_PER_NODE"]), "SLURM_GPUS_PER_NODE"
  return None, ""


def _slurm_tasks_on_node(env) -> tuple[int, str]:
  node = int(env.get("SLURM_NODEID", "0") or 0)
  for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
    counts = _expand(env.get(name, ""))
    if counts:
      return counts[min(node, len(counts) - 1)], name
  nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")) or 1)
  return math.ceil(int(env.get("SLURM_NTASKS", "1")) / nodes), "SLURM_NTASKS / SLURM_NNODES"


def _gpu_layout(cluster: str, env, driver_dir, rank: int, tasks: int, tasks_from: str,
                on_node: int | None, on_node_from: str) -> Layout:
  if _platforms_without_gpu(env):
    allocated, source = on_node, on_node_from
    if not allocated and cluster == "slurm" and env.get("CUDA_VISIBLE_DEVICES") is not None:
      allocated, source = len(visible_gpu_ids(env)), "CUDA_VISIBLE_DEVICES"
    if not allocated:
      return Layout(cluster)   # the user chose another platform (e.g. JAX_PLATFORMS=cpu) on a CPU job
    return Layout(cluster, problem=gpu_platform_problem(f"SLURM gave this job {allocated} GPUs on the node "
                                                        f"({source}={env[source]})", env))
  visible = visible_gpus(env, driver_dir)
  if visible is None:
    visible = on_node
  if not visible and not on_node:
    return Layout(cluster)   # no GPUs here, none asked for: leave the devices to JAX
  task_word = "task" if tasks == 1 else "tasks"
  if on_node:
    asked = (f"the job asked for {on_node} GPUs on the node ({on_node_from}={on_node}) over {tasks} "
             f"{task_word} ({tasks_from}={tasks})")
  else:
    asked = f"this node shows {visible} GPUs to its {tasks} {task_word} ({tasks_from}={tasks})"
  total = on_node or visible
  if total % tasks:
    return Layout(cluster, None, None, asked, f"{asked}, which do not divide evenly: give every task as "
                                              "many GPUs (--gpus_per_node a multiple of --tasks_per_node)")
  share = total // tasks
  if not visible:
    ids = None
  elif tasks == 1 or visible <= share:
    ids = tuple(range(visible))                  # every GPU it sees is its own (SLURM bound them)
  elif visible % tasks == 0:
    k = visible // tasks                         # the node's GPUs, shared: split by local rank
    ids = tuple(range(rank * k, rank * k + k))
  else:
    ids = None
  return Layout(cluster, ids, share, f"{asked}: {share} per process")


def plan(env=None, driver_dir: str = NVIDIA_GPUS) -> Layout:
  """This process's Layout, from the environment alone (the cluster JAX would detect, in JAX's order)."""
  env = os.environ if env is None else env
  if env.get("JAX_LOCAL_DEVICE_IDS"):
    ids = tuple(int(i) for i in env["JAX_LOCAL_DEVICE_IDS"].split(",") if i.strip())
    return Layout("explicit", None, len(ids), f"JAX_LOCAL_DEVICE_IDS={env['JAX_LOCAL_DEVICE_IDS']} asks "
                                              f"for {len(ids)} per process")
  if "OMPI_MCA_orte_hnp_uri" in env:
    tasks = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    rank = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    return _gpu_layout("ompi", env, driver_dir, rank, tasks, "OMPI_COMM_WORLD_LOCAL_SIZE", None, "")
  if all(name in env for name in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                                  "SLURM_LOCALID")):
    tasks, tasks_from = _slurm_tasks_on_node(env)
    on_node, on_node_from = _slurm_gpus_on_node(env)
    return _gpu_layout("slurm", env, driver_dir, int(env["SLURM_LOCALID"]), max(tasks, 1), tasks_from,
                       on_node, on_node_from)
  bounds = env.get("TPU_CHIPS_PER_PROCESS_BOUNDS") or env.get("TPU_CHIPS_PER_HOST_BOUNDS")
  kind = env.get("TPU_ACCELERATOR_TYPE", "")
  if kind and bounds:
    chips = math.prod(int(b) for b in bounds.split(","))
    cores = 2 if kind.startswith(("v2", "v3")) else 1   # v2/v3 show each of a chip's 2 cores as a device
    return Layout("tpu", None, chips * cores,
                  f"the TPU host has {chips} chips ({kind}, chips per host {bounds}) = {chips * cores} devices")
  return Layout("none")


def record(layout: Layout, process: int, local_devices: int, platform: str, device_ids=()) -> dict:
  """What one process reports about itself (JSON: the processes exchange these). Logs, once per process,
  a warning where its CPUs differ from the job's (cpu_problem)."""
  cpus = cpu_problem()
  if cpus:
    log.warning(f"[devices] warning: process {process} on {socket.gethostname()}: {cpus}")
  return {"host": socket.gethostname(), "process": process, "devices": local_devices, "platform": platform,
          "ids": list(device_ids), "expected": layout.expected, "asked": layout.asked,
          "problem": layout.problem, "gpu": layout.cluster in ("slurm", "ompi") and layout.expected is not None}


def _plural(n: int, word: str) -> str:
  return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")


def summary(records: list[dict]) -> str:
  """'2 processes x 8 local devices = 16 global devices (gpu); per host: gpu01 1 process x 8, gpu02 ...'."""
  counts = sorted({r["devices"] for r in records})
  local = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
  platforms = "/".join(sorted({r["platform"] for r in records}))
  hosts: dict[str, list[int]] = {}
  for r in records:
    hosts.setdefault(r["host"], []).append(r["devices"])
  per_host = ", ".join(f"{host} {_plural(len(ns), 'process')} x "
                       f"{ns[0] if len(set(ns)) == 1 else '+'.join(map(str, ns))}" for host, ns in hosts.items())
  return (f"{_plural(len(records), 'process')} x {local} local device{'' if local == '1' else 's'} = "
          f"{_plural(sum(r['devices'] for r in records), 'global device')} ({platforms}); per host: {per_host}")


def mismatches(records: list[dict]) -> list[str]:
  """One sentence per process whose devices differ from what its job asked for; if none asked for any,
  processes that see different numbers of devices (a data-parallel mesh needs the same everywhere)."""
  out = []
  for r in records:
    where = f"process {r['process']} on {r['host']}"
    if r["problem"]:
      out.append(f"{where}: {r['problem']}")
    elif r["expected"] is not None and (r["devices"] != r["expected"] or (r["gpu"] and r["platform"] != "gpu")):
      out.append(f"{where} sees {_plural(r['devices'], r['platform'] + ' device')}, but {r['asked']}")
  if not out and len({r["devices"] for r in records}) > 1:
    seen = ", ".join(f"process {r['process']} on {r['host']}: {r['devices']}" for r in records)
    out.append(f"the processes see different numbers of local devices ({seen})")
  return out
