"""kernels/host_memory.py: with glibc's malloc set to keep freed memory, a step that frees a large
temporary buffer does not fault it back in on the next run. Each case runs in a fresh process, because
the setting is process-wide and must come before JAX is imported."""
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# A jitted step whose 64 MB intermediate (4096 x 4096 float32) is a temporary buffer of the execution.
_PROGRAM = """
import sys
from kernels import host_memory
print(host_memory.keep_freed_memory())
import jax, jax.numpy as jnp
step = jax.jit(lambda x: jnp.sum(jnp.tanh(x @ x.T) @ x))
x = jnp.ones((4096, 256))
for _ in range(3):
  step(x).block_until_ready()
def faults():
  return int(open("/proc/self/stat").read().split(")")[1].split()[7])   # minflt
before = faults()
for _ in range(4):
  step(x).block_until_ready()
print((faults() - before) / 4)
"""


def _faults_per_run(keep: bool) -> tuple[str, float]:
  env = dict(os.environ, AIAYN_KEEP_FREED_MEMORY="1" if keep else "0")
  out = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, check=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.split()
  return out[0], float(out[1])


def test_freed_buffer_is_reused_without_page_faults():
  kept, with_setting = _faults_per_run(keep=True)
  left, without = _faults_per_run(keep=False)
  assert (kept, left) == ("True", "False")
  # 64 MB is 16,384 pages of 4 KiB: without the setting each run maps them afresh.
  assert without > 8000, without
  assert with_setting < 500, with_setting
