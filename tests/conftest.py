"""Every test sees 8 fake CPU devices and shares a persistent compilation cache.

XLA_FLAGS must be set before JAX is imported anywhere, which is why this lives in conftest.py.
"""
import os
import pathlib
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tokenized-corpus cache (data/cache.py) of the tests' throwaway corpora: one folder per session.
os.environ.setdefault("AIAYN_DATA_CACHE", tempfile.mkdtemp(prefix="aiayn_data_cache_"))

import jax  # noqa: E402

_CACHE = pathlib.Path(os.environ.get("AIAYN_TEST_JAX_CACHE", pathlib.Path.home() / ".cache" / "aiayn_jax_tests"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE))
# Small programs (0.05-0.5 s to compile) are cached too: the tiny test models compile many of them. A hit is
# the executable XLA made for the same program, devices and flags, so no test sees a different program.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.05)

# What the commands show on the console (run/console.py), also where a test calls the library directly
# and reads the console with capsys.
from run.console import log_to_console  # noqa: E402

log_to_console()
