"""kernels/host_memory.py: with glibc's malloc set to keep freed memory, a step that frees a large
temporary buffer does not fault it back in on the next run; the setting is made only where JAX will run
on the CPU, by the command line only, and said once. Each case runs in a fresh process, because the
setting is process-wide and must come before JAX is imported."""
import os
import pathlib
import platform
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# A jitted step whose 64 MB intermediate (4096 x 4096 float32) is a temporary buffer of the execution.
_PROGRAM = """
import sys
from kernels import host_memory
print(host_memory.keep_freed_memory_on_cpu("test"))
import jax, jax.numpy as jnp
step = jax.jit(lambda x: jnp.sum(jnp.tanh(x @ x.T) @ x))
x = jnp.ones((4096, 256))
for _ in range(3):
  step(x).block_until_ready()
def faults():
  return int(open("/proc/self/stat").read().split(")")[1].split()[7])   # minflt
runs = []
for _ in range(8):
  before = faults()
  step(x).block_until_ready()
  runs.append(faults() - before)
print(sorted(runs)[len(runs) // 2])   # the median run: a page fault of another thread now and then is not the step's
"""


def _faults_per_run(keep: bool) -> tuple[str, float]:
  env = dict(os.environ, AIAYN_KEEP_FREED_MEMORY="1" if keep else "0")
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, check=True,
                       cwd=ROOT).stdout.splitlines()
  return out[-2], float(out[-1])


def _huge_page_bytes() -> int:
  """The kernel's transparent huge page size (2 MiB on x86-64), the largest page a fault can map."""
  try:
    return int(pathlib.Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
  except (OSError, ValueError):
    return 2 << 20


def test_freed_buffer_is_reused_without_page_faults():
  """The setting's effect as a ratio against the same machine's faults without it: how many pages a fault
  maps depends on the kernel (4 KiB pages: 16,384 faults for the 64 MB buffer; transparent huge pages
  `always`: 32; large folios or fault-around: in between), so no fixed count would hold everywhere."""
  kept, with_setting = _faults_per_run(keep=True)
  left, without = _faults_per_run(keep=False)
  assert (kept, left) == ("True", "False")
  fewest = (64 << 20) // _huge_page_bytes()   # the 64 MB buffer mapped afresh, in the largest pages there are
  if without < fewest:
    pytest.skip(f"without the malloc setting this machine faulted {without:g} pages a run, fewer than the "
                f"{fewest} huge pages of the 64 MB buffer: its malloc or kernel already keeps the freed "
                f"buffer, so there is no effect to show")
  # The freed buffer's faults, gone: at most a tenth of what the same step faulted without the setting.
  assert with_setting <= without / 10, (with_setting, without)


def _expect(tmp_path, env, plugin=None):
  """expected_backend() and keep_freed_memory_on_cpu() in a fresh process that never imports JAX."""
  path = [str(ROOT)]
  if plugin:   # an installed accelerator plugin, as JAX discovers it: a module of the jax_plugins package
    (tmp_path / "site" / "jax_plugins" / plugin).mkdir(parents=True, exist_ok=True)
    (tmp_path / "site" / "jax_plugins" / plugin / "__init__.py").write_text("")
    path.append(str(tmp_path / "site"))
  program = ("import sys; from kernels import host_memory as h\n"
             "print(h.expected_backend(), h.keep_freed_memory_on_cpu('t'), h.keep_freed_memory_on_cpu('t'))\n"
             "assert 'jax' not in sys.modules")
  env = {**{k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")},
         "PYTHONPATH": os.pathsep.join(path), **env}
  return subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True,
                        cwd=ROOT).stdout.splitlines()


def test_malloc_is_set_only_where_jax_will_run_on_the_cpu_and_said_once(tmp_path):
  line = "[t] glibc malloc keeps the memory XLA:CPU frees"
  cpu = _expect(tmp_path, {})   # no plugin installed here: JAX can only run on the CPU
  assert cpu[-1] == "cpu True True" and len(cpu) == 2 and cpu[0].startswith(line), cpu
  assert _expect(tmp_path, {"JAX_PLATFORMS": "cpu"})[-1] == "cpu True True"
  assert _expect(tmp_path, {"JAX_PLATFORMS": "cuda"}) == ["cuda False False"]
  assert _expect(tmp_path, {"JAX_PLATFORMS": "tpu,cpu"}) == ["tpu False False"]
  assert _expect(tmp_path, {}, plugin="xla_cuda13") == ["xla_cuda13 False False"]
  assert _expect(tmp_path, {"JAX_PLATFORMS": "cpu"}, plugin="xla_cuda13")[-1] == "cpu True True"
  assert _expect(tmp_path, {"AIAYN_KEEP_FREED_MEMORY": "0"}) == ["cpu False False"]


def test_train_command_sets_malloc_once_and_keeps_the_users_compilation_cache(tmp_path):
  """`python -m train` up to its first user error (a missing corpus file): JAX has started by then."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
         "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine")}
  program = ("import runpy, sys\n"
             "sys.argv = ['train'] + sys.argv[1:]\n"
             "try:\n  runpy.run_module('train', run_name='__main__')\n"
             "finally:\n  import jax; print('cache', jax.config.jax_compilation_cache_dir)")
  done = subprocess.run([sys.executable, "-c", program, f"--config={ROOT / 'experiments/default.py'}:smoke",
                         f"--workdir={tmp_path / 'run'}", "--config.data.source=files",
                         "--config.data.train_path=missing.tsv"],
                        env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
  assert done.returncode == 2 and "missing.tsv" in done.stderr, done.stderr[-2000:]
  lines = done.stdout.splitlines()
  assert sum("glibc malloc keeps the memory" in line for line in lines) == 1, lines
  assert lines[-1] == f"cache {tmp_path / 'mine'}", lines
