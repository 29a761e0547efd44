"""Every test sees 8 fake CPU devices and shares a persistent compilation cache, with the processes it starts.

XLA_FLAGS must be set before JAX is imported anywhere, which is why this lives in conftest.py.
"""
import atexit
import os
import pathlib
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One OpenMP/BLAS thread per process (PyTorch's generate in the interop tests, NumPy's BLAS): pytest-xdist
# already runs a worker per core, and a library that starts a thread per core beside it spins its threads
# against the other worker's (tests/test_export_translate.py beside a busy core: 63 s with PyTorch's
# default threads, 42 s with one). The benchmark harness sets its peers' threads itself (--threads).
for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
  os.environ.setdefault(_name, "1")
# The tokenized-corpus cache (data/cache.py) of the tests' throwaway corpora: one folder per session, removed
# at its end.
if "AIAYN_DATA_CACHE" not in os.environ:
  os.environ["AIAYN_DATA_CACHE"] = tempfile.mkdtemp(prefix="aiayn_data_cache_")
  atexit.register(shutil.rmtree, os.environ["AIAYN_DATA_CACHE"], ignore_errors=True)

import jax  # noqa: E402

_CACHE = pathlib.Path(os.environ.get("AIAYN_TEST_JAX_CACHE", pathlib.Path.home() / ".cache" / "aiayn_jax_tests"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
# Every program is cached, however quickly it compiles: the tests run thousands of small ones (the ops of an
# un-jitted model, each a program of its own), and reading one back is faster than compiling it again
# (test_family.py and test_explore.py: 56 s with all cached against 122 s with those under 0.05 s left
# out). A hit is the executable XLA made for the same program, devices and flags, so no test sees another.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
# The processes the tests start (training, decoding, benchmark workers, SLURM tasks) read and fill the same
# cache, unless a test sets its own: a later run then compiles only what changed there too.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# run/programs.py's programs, kept in that cache too, are checked at every load: each is traced again and
# must be the program kept under its key (a key that missed a value the program depends on stops the test).
os.environ.setdefault("AIAYN_PROGRAM_CACHE", "verify")

# What the commands show on the console (run/console.py), also where a test calls the library directly
# and reads the console with capsys.
from run.console import log_to_console  # noqa: E402

log_to_console()
