"""Which devices each bulk decoding worker gets: one share of this host's devices per worker, decided
before any worker starts JAX, so that no process holds memory on a device it does not use.

    kind, ids = host_devices()          # ('gpu', ['0', '1', '2', '3']) on a 4-GPU host
    shares = split(kind, ids, 2)        # [['0', '1'], ['2', '3']]
    env = share_env(kind, shares[1], os.environ, index=1, cpu_devices=4)   # worker 1's environment

- GPUs (NVIDIA): worker i sees only its share through CUDA_VISIBLE_DEVICES; JAX's preallocation (75% of
  a GPU) then happens on its own GPUs alone.
- TPU chips: one chip per worker, through TPU_VISIBLE_CHIPS with one-chip process bounds, a mesh
  controller port of its own and ALLOW_MULTIPLE_LIBTPU_LOAD (as JAX's multi-process test harness and
  Cloud TPU's recipe for independent processes on one VM set them). Untested here: no TPU.
- CPU: the worker's share of the cores this process may use (os.sched_getaffinity) is set as its CPU
  affinity, and --cpu_devices (or XLA_FLAGS' --xla_force_host_platform_device_count) is split between
  the workers. With fewer cores than workers, the workers share the cores (no affinity is set).

Nothing here imports JAX. `worker_report` (called in a worker once JAX is up) names the devices JAX gave
the worker beside its share, in the line every worker logs.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import socket
import subprocess

from run import devices as run_devices

_XLA_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
TPU_PORT = 8476          # the first worker's mesh controller port; worker i gets TPU_PORT + i


def _platforms() -> str:
  return os.environ.get("JAX_PLATFORMS", os.environ.get("JAX_PLATFORM_NAME", "")).lower()


def _nvidia_gpus() -> list[str]:
  """The NVIDIA GPUs a process started from here would see: CUDA_VISIBLE_DEVICES's list when it is set,
  else one id per GPU the driver lists (/proc/driver/nvidia/gpus, or `nvidia-smi -L`)."""
  ids = run_devices.visible_gpu_ids()
  if ids is not None and (ids or "CUDA_VISIBLE_DEVICES" in os.environ):
    return ids
  count = 0
  if shutil.which("nvidia-smi"):
    try:
      listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
      listed = ""
    count = sum(line.startswith("GPU ") for line in listed.splitlines())
  return [str(i) for i in range(count)]


def _tpu_chips() -> list[str]:
  visible = os.environ.get("TPU_VISIBLE_CHIPS")
  if visible is not None:
    return [chip.strip() for chip in visible.split(",") if chip.strip()]
  chips = sorted(pathlib.Path("/dev").glob("accel[0-9]*"), key=lambda p: int(p.name[5:]))
  return [p.name[5:] for p in chips]


def cpu_cores() -> list[int]:
  """The cores this process may run on (its affinity, which SLURM and taskset restrict), not the
  machine's count."""
  try:
    return sorted(os.sched_getaffinity(0))
  except AttributeError:   # not Linux
    return list(range(os.cpu_count() or 1))


def host_devices() -> tuple[str, list[str]]:
  """('gpu', GPU ids) or ('tpu', chip ids) where JAX would find them, else ('cpu', core numbers).
  JAX_PLATFORMS=cpu chooses the CPU whatever the host has."""
  platforms = _platforms()
  if platforms and not any(p in platforms for p in ("cuda", "gpu", "tpu")):
    return "cpu", [str(c) for c in cpu_cores()]
  if not platforms or any(p in platforms for p in ("cuda", "gpu")):
    gpus = _nvidia_gpus()
    if gpus:
      return "gpu", gpus
  if not platforms or "tpu" in platforms:
    chips = _tpu_chips()
    if chips:
      return "tpu", chips
  return "cpu", [str(c) for c in cpu_cores()]


def split(kind: str, ids: list[str], workers: int) -> list[list[str]]:
  """`workers` disjoint shares of `ids`, as even as they come (the first ones one larger). A GPU or TPU
  chip is never shared: more workers than those is a ValueError naming both numbers. CPU cores are
  shared (every worker gets them all) only when there are fewer cores than workers."""
  if len(ids) < workers:
    if kind != "cpu":
      raise ValueError(f"--processes {workers} but this host has {len(ids)} {kind.upper()}"
                       f"{'s' if len(ids) != 1 else ''} ({','.join(ids) or 'none'}): one worker per "
                       f"device at most; give --processes {max(len(ids), 1)} or fewer")
    return [list(ids) for _ in range(workers)]
  if kind == "tpu" and len(ids) != workers:
    raise ValueError(f"--processes {workers} on a host with {len(ids)} TPU chips: each worker takes one "
                     f"chip; give --processes {len(ids)}")
  size, extra = divmod(len(ids), workers)
  shares, start = [], 0
  for i in range(workers):
    end = start + size + (i < extra)
    shares.append(list(ids[start:end]))
    start = end
  return shares


def cpu_device_count(cpu_devices: int, environ=None) -> int:
  """The CPU devices the workers split: XLA_FLAGS' --xla_force_host_platform_device_count when it is
  set (it wins over --cpu_devices in a worker too), else JAX_NUM_CPU_DEVICES, else --cpu_devices."""
  environ = os.environ if environ is None else environ
  found = _XLA_COUNT.search(environ.get("XLA_FLAGS", ""))
  if found:
    return int(found.group(1))
  if environ.get("JAX_NUM_CPU_DEVICES", "").isdigit():
    return int(environ["JAX_NUM_CPU_DEVICES"])
  return cpu_devices


def share_env(kind: str, share: list[str], environ, *, index: int, cpu_devices: int) -> dict:
  """Worker `index`'s environment: `environ` with its share of the devices made the only ones it sees
  (GPU, TPU), or with its number of CPU devices (`cpu_devices`, this worker's part) in XLA_FLAGS and
  JAX_NUM_CPU_DEVICES where those set one."""
  env = dict(environ)
  if kind == "gpu":
    env["CUDA_VISIBLE_DEVICES"] = ",".join(share)
  elif kind == "tpu":
    # TPU_VISIBLE_DEVICES: older libtpu's name; ALLOW_MULTIPLE_LIBTPU_LOAD: libtpu otherwise lets one
    # process per VM load it.
    env.update(TPU_VISIBLE_CHIPS=",".join(share), TPU_VISIBLE_DEVICES=",".join(share),
               ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_PROCESS_BOUNDS="1,1,1",
               TPU_CHIPS_PER_PROCESS_BOUNDS="1,1,1",
               TPU_MESH_CONTROLLER_ADDRESS=f"localhost:{TPU_PORT + index}",
               TPU_MESH_CONTROLLER_PORT=str(TPU_PORT + index))
  else:
    if _XLA_COUNT.search(env.get("XLA_FLAGS", "")):
      env["XLA_FLAGS"] = _XLA_COUNT.sub(f"--xla_force_host_platform_device_count={cpu_devices}",
                                        env["XLA_FLAGS"])
    if "JAX_NUM_CPU_DEVICES" in env:
      env["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
  return env


def pin_slurm_task(gpus_per_task: int) -> None:
  """In a SLURM task of `python -m decode --launcher slurm --gpus_per_task G`: where SLURM showed the
  task every GPU of its node (a cluster without per-task GPU binding), keep only the task's own G, by its
  SLURM_LOCALID. Where SLURM bound them already (CUDA_VISIBLE_DEVICES lists G), nothing changes."""
  local = os.environ.get("SLURM_LOCALID", "")
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if gpus_per_task < 1 or not local.isdigit() or visible is None:
    return
  gpus = [gpu for gpu in visible.split(",") if gpu]
  first = int(local) * gpus_per_task
  if len(gpus) > gpus_per_task and first + gpus_per_task <= len(gpus):
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[first:first + gpus_per_task])


def worker_report(devices) -> str:
  """One line naming a worker and what it runs on: its host and pid, the devices JAX gave it, and its
  share of the host (the GPUs or TPU chips it sees, or the cores it may use)."""
  platform = devices[0].platform if devices else "none"
  if platform == "gpu" or platform == "cuda":
    share = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(all)')}"
  elif platform == "tpu":
    share = f"TPU_VISIBLE_CHIPS={os.environ.get('TPU_VISIBLE_CHIPS', '(all)')}"
  else:
    share = "cores " + ",".join(map(str, cpu_cores()))
  task = os.environ.get("SLURM_PROCID")
  where = f"pid {os.getpid()} on {socket.gethostname()}" + (f", SLURM task {task}" if task else "")
  return (f"worker {where}: {len(devices)} {platform} device{'s' if len(devices) != 1 else ''} "
          f"[{', '.join(str(d.id) for d in devices)}]; its share: {share}")
