"""The multi-process plumbing that needs no second process: joining rules, the launcher's failure path,
the SLURM flags and CPUs, the devices each process of a SLURM/Open MPI/TPU job drives and the refusal of
others. (Real multi-process training: tests/test_multiprocess.py; real SLURM: tests/test_slurm.py.)"""
import argparse
import os
import pathlib
import subprocess
import sys

import pytest

from files_config import clean_env
from jobs import launch, slurm
from run import devices
from train import multihost

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_one_process_joins_nothing_and_a_half_manual_launch_is_refused(monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_STEP_NODELIST",
               "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(name, raising=False)
  assert multihost.initialize("auto") is False and multihost.initialize("off") is False
  with pytest.raises(ValueError, match=r"needs all three.*--num_processes"):
    multihost.initialize("auto", coordinator_address="127.0.0.1:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  with pytest.raises(ValueError, match=r"JAX_PROCESS_ID"):
    multihost.initialize("auto")
  with pytest.raises(ValueError, match=r"--distributed='sometimes'"):
    multihost.initialize("sometimes")
  assert multihost.map_split(lambda xs: [x * 2 for x in xs], [1, 2, 3]) == [2, 4, 6]


def test_launcher_environment_and_failure(tmp_path):
  env = launch.process_env(1, 2, 4321, 4, base={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:4321" and env["JAX_PROCESS_ID"] == "1"
  assert env["JAX_NUM_PROCESSES"] == "2" and env["JAX_NUM_CPU_DEVICES"] == "4" and "XLA_FLAGS" not in env
  # Both processes reject a misspelled key: the launcher prefixes their output and exits non-zero.
  done = subprocess.run([sys.executable, "-m", "jobs.launch", "--processes", "2", "--", "--config.train.num_stepz=3",
                         f"--workdir={tmp_path}"], cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)),
                        capture_output=True, text=True, timeout=120)
  assert done.returncode != 0 and "[launch] failed" in done.stdout, done.stdout + done.stderr
  assert "[p0]" in done.stdout and "[p1]" in done.stdout and "num_stepz" in done.stdout


def test_slurm_flags():
  parser = argparse.ArgumentParser()
  slurm.add_flags(parser)
  args = parser.parse_args(["--partition", "gpu", "--nodes", "2", "--gpus_per_node", "8", "--time", "90",
                            "--sbatch", "account=abc", "--sbatch", "exclusive"])
  options = slurm.options_from(args)
  assert options.nodes == 2 and options.gpus_per_node == 8 and options.sbatch == ("account=abc", "exclusive")
  with pytest.raises(ValueError, match="--nodes must be >= 1"):
    slurm.options_from(parser.parse_args(["--nodes", "0"]))
  with pytest.raises(ValueError, match="--sbatch '--qos=high'"):
    slurm.options_from(parser.parse_args(["--sbatch=--qos=high"]))


# --- which devices each process drives (run/devices.py, multihost.initialize/check_devices) ---------------

def slurm_env(nodes: int, tasks_per_node: int, gpus_per_node: int, rank: int, **more) -> dict:
  """What SLURM sets in task `rank` of `sbatch --nodes N --ntasks-per-node T --gpus-per-node G` + srun, on
  nodes gpu01, gpu02, ... (no --gpu-bind: every task of a node sees all of the node's GPUs)."""
  gpus = ",".join(map(str, range(gpus_per_node)))
  env = dict(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST=f"gpu[01-{nodes:02d}]", SLURM_NNODES=str(nodes),
             SLURM_STEP_NUM_NODES=str(nodes), SLURM_NTASKS=str(nodes * tasks_per_node), SLURM_PROCID=str(rank),
             SLURM_LOCALID=str(rank % tasks_per_node), SLURM_NODEID=str(rank // tasks_per_node),
             SLURM_NTASKS_PER_NODE=str(tasks_per_node), SLURM_TASKS_PER_NODE=f"{tasks_per_node}(x{nodes})",
             SLURM_STEP_TASKS_PER_NODE=f"{tasks_per_node}(x{nodes})", SLURM_GPUS_PER_NODE=str(gpus_per_node),
             SLURM_GPUS_ON_NODE=str(gpus_per_node), SLURM_STEP_GPUS=gpus, SLURM_JOB_GPUS=gpus,
             CUDA_VISIBLE_DEVICES=gpus)
  env.update(more)
  return env


def joined_with(monkeypatch, env: dict) -> dict:
  """The keyword arguments multihost.initialize hands jax.distributed.initialize under `env` (mocked: no
  GPU and no coordinator here)."""
  for name in list(os.environ):
    if name.startswith(("SLURM_", "OMPI_", "TPU_", "CUDA_", "JAX_")):
      monkeypatch.delenv(name)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  calls = []
  monkeypatch.setattr(multihost.jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
  monkeypatch.setattr(multihost.jax.config, "update", lambda *args: None)
  assert multihost.initialize("auto") is True
  (kwargs,) = calls
  return kwargs


@pytest.mark.parametrize("rank", [0, 1])
def test_one_task_per_node_drives_every_gpu_of_its_node(monkeypatch, rank):
  # --nodes 2 --tasks_per_node 1 --gpus_per_node 8: JAX's own SLURM detection would give each process
  # [SLURM_LOCALID] = [0], 2 of 16 GPUs; the explicit ids keep all 8 (JAX fills in only what is None).
  kwargs = joined_with(monkeypatch, slurm_env(2, 1, 8, rank))
  assert kwargs["local_device_ids"] == list(range(8))
  assert kwargs["coordinator_address"] is None and kwargs["num_processes"] is None   # JAX reads SLURM's


@pytest.mark.parametrize("rank, expected", [(0, [0]), (3, [3]), (11, [3]), (15, [7])])
def test_one_task_per_gpu_drives_its_own_gpu(monkeypatch, rank, expected):
  # --nodes 2 --tasks_per_node 8 --gpus_per_node 8: every task sees the node's 8 GPUs and takes its own.
  assert joined_with(monkeypatch, slurm_env(2, 8, 8, rank))["local_device_ids"] == expected
  # Bound by SLURM (--gpus-per-task 1 / --gpu-bind): the task sees its one GPU, as device 0.
  bound = slurm_env(2, 8, 8, rank, CUDA_VISIBLE_DEVICES=str(expected[0]))
  assert joined_with(monkeypatch, bound)["local_device_ids"] == [0]
  # Two tasks of a 8-GPU node share it: 4 each.
  assert joined_with(monkeypatch, slurm_env(1, 2, 8, rank % 2))["local_device_ids"] == \
      list(range(4 * (rank % 2), 4 * (rank % 2) + 4))


def test_the_layout_of_open_mpi_tpu_hosts_and_explicit_ids(monkeypatch):
  # mpirun -n 4 over 2 hosts of 4 GPUs: process 3 is local rank 1 of 2 and drives GPUs 2 and 3.
  ompi = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1:34911", "OMPI_COMM_WORLD_SIZE": "4",
          "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
  assert joined_with(monkeypatch, ompi)["local_device_ids"] == [2, 3]
  layout = devices.plan(ompi)
  assert (layout.cluster, layout.local_device_ids, layout.expected) == ("ompi", (2, 3), 2)
  # The driver's list of GPUs where CUDA_VISIBLE_DEVICES is unset.
  driver = {k: v for k, v in ompi.items() if k != "CUDA_VISIBLE_DEVICES"}
  assert devices.plan(driver, driver_dir="/nonexistent").local_device_ids is None
  tpu = devices.plan({"TPU_ACCELERATOR_TYPE": "v4-32", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"})
  assert (tpu.cluster, tpu.local_device_ids, tpu.expected) == ("tpu", None, 4)   # JAX picks TPU devices
  assert devices.plan({"TPU_ACCELERATOR_TYPE": "v3-32", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"}).expected == 8
  (problem,) = devices.mismatches([devices.record(tpu, 0, 4, "tpu"), devices.record(tpu, 1, 8, "tpu")])
  assert problem.startswith("process 1 on ") and "sees 8 tpu devices, but the TPU host has 4 chips" in problem
  explicit = devices.plan({**slurm_env(2, 1, 8, 0), "JAX_LOCAL_DEVICE_IDS": "0,1"})
  assert (explicit.local_device_ids, explicit.expected) == (None, 2)   # JAX reads JAX_LOCAL_DEVICE_IDS itself
  # JAX_PLATFORMS=cpu in a job SLURM gave GPUs: a problem naming the variable (tests/test_preflight.py);
  # no GPU anywhere: nothing.
  assert "JAX_PLATFORMS=cpu" in devices.plan({**slurm_env(2, 1, 8, 0), "JAX_PLATFORMS": "cpu"}).problem
  cpu_job = {k: v for k, v in slurm_env(1, 2, 0, 1).items() if "GPU" not in k and not k.startswith("CUDA")}
  assert devices.plan(cpu_job, driver_dir="/nonexistent") == devices.Layout("slurm")
  # 8 GPUs among 3 tasks cannot be split: a problem the check reports.
  assert "do not divide evenly" in devices.plan(slurm_env(1, 3, 8, 0)).problem


def test_what_differs_from_the_job_is_named_in_one_sentence():
  layout = devices.plan(slurm_env(2, 1, 8, 0))
  ok = [dict(devices.record(layout, p, 8, "gpu"), host=f"gpu0{p + 1}") for p in range(2)]
  assert devices.mismatches(ok) == []
  assert devices.summary(ok) == ("2 processes x 8 local devices = 16 global devices (gpu); "
                                 "per host: gpu01 1 process x 8, gpu02 1 process x 8")
  one_gpu = [ok[0], dict(ok[1], devices=1)]   # what JAX's own detection gives process 1
  (problem,) = devices.mismatches(one_gpu)
  assert problem == ("process 1 on gpu02 sees 1 gpu device, but the job asked for 8 GPUs on the node "
                     "(SLURM_GPUS_ON_NODE=8) over 1 task (SLURM_STEP_TASKS_PER_NODE=1): 8 per process")
  per_gpu = devices.plan(slurm_env(2, 8, 8, 0))
  sixteen = [dict(devices.record(per_gpu, p, 1, "gpu"), host=f"gpu0{p // 8 + 1}") for p in range(16)]
  assert devices.mismatches(sixteen) == [] and devices.summary(sixteen).startswith(
      "16 processes x 1 local device = 16 global devices (gpu); per host: gpu01 8 processes x 1, gpu02 8")
  no_plugin = [dict(r, platform="cpu") for r in ok]   # jax without its CUDA plugin falls back to the CPU
  assert "sees 8 cpu devices, but the job asked for 8 GPUs" in devices.mismatches(no_plugin)[0]
  nothing_asked = [devices.record(devices.Layout("none"), p, n, "cpu") for p, n in enumerate((4, 2))]
  assert "different numbers of local devices" in devices.mismatches(nothing_asked)[0]


def test_a_run_refuses_other_devices_than_the_job_asked_for_in_one_line(monkeypatch, capsys):
  # This process sees 8 CPU devices; one SLURM task whose job asked for 8 GPUs must not train on them.
  from train.__main__ import main
  for name in list(os.environ):
    if name.startswith(("SLURM_", "CUDA_")) or name == "JAX_PLATFORMS":
      monkeypatch.delenv(name)
  for name, value in slurm_env(1, 1, 8, 0, SLURM_NTASKS="1").items():
    monkeypatch.setenv(name, value)
  with pytest.raises(SystemExit) as exit_:
    main(["--check_devices"])
  err = capsys.readouterr().err.strip()
  assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
  assert err.startswith("error: device layout: process 0 on ") and "sees 8 cpu devices, but the job asked " \
      "for 8 GPUs on the node (SLURM_GPUS_ON_NODE=8) over 1 task" in err and "--allow_device_mismatch" in err
  main(["--check_devices", "--allow_device_mismatch"])   # overridden: a warning, and on
  out = capsys.readouterr()
  assert "[devices] 1 process x 8 local devices = 8 global devices (cpu)" in out.out
  assert "running anyway (--allow_device_mismatch)" in out.err


def test_every_job_asks_for_cpus_and_threads_follow_the_cpus_a_process_may_use(tmp_path):
  parser = argparse.ArgumentParser()
  slurm.add_flags(parser)

  def asked(*flags):
    options = slurm.options_from(parser.parse_args(list(flags)))
    return slurm._executor(tmp_path, options, "job").parameters["cpus_per_task"]
  assert asked("--nodes", "2", "--tasks_per_node", "1", "--gpus_per_node", "8") == 8 * devices.CPUS_PER_GPU
  assert asked("--nodes", "2", "--tasks_per_node", "8", "--gpus_per_node", "8") == devices.CPUS_PER_GPU
  assert asked() == devices.CPUS_WITHOUT_GPU and asked("--cpus_per_task", "6") == 6
  with pytest.raises(ValueError, match="--cpus_per_task must be >= 1, got 0"):
    slurm.options_from(parser.parse_args(["--cpus_per_task", "0"]))
  # A task given one core (SLURM binds it, as taskset does here) sizes SentencePiece's encoding threads to it.
  probe = "from data.vocab import threads; from run.devices import usable_cpus as u; print(threads(), u())"
  done = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                        text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
  assert done.stdout.split() == ["1", "1"], done.stdout + done.stderr
