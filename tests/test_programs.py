"""run/programs.py: a program kept by one process is loaded by the next without tracing, computes the same,
and is never served to a call whose function, closure, module-level values or arguments differ."""
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from run import programs
from run.mesh import make_mesh

REPO = pathlib.Path(__file__).resolve().parent.parent
TRACES = []    # one entry per trace of the functions below (Python runs only while tracing)
SCALE = 3.0    # a module-level value the functions read


def scaled(x):
  TRACES.append("scaled")
  return jnp.sin(x) * SCALE


def logs_while_tracing(x):
  TRACES.append("logs")
  logging.getLogger("model.test_programs").warning("traced: this path falls back")
  logging.getLogger("jax.test_programs").warning("a library's words: not said again")
  logging.getLogger("train.test_programs").warning("traced: and the trainer says so")   # propagate off
  return x + 1


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """A program cache of this test's own, on."""
  monkeypatch.setenv("AIAYN_PROGRAM_CACHE", "1")
  monkeypatch.setitem(programs.UNKEYED, (__name__, "TRACES"), "the tests' count of traces, not the program")
  previous = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
  jax.clear_caches()   # JAX's in-memory traces of the functions above: every test traces afresh
  TRACES.clear()
  yield tmp_path / "jax" / "aiayn_programs"
  jax.config.update("jax_compilation_cache_dir", previous)


def kept(cache) -> list:
  return sorted(p.name for p in cache.rglob("*.program"))


def test_a_kept_program_is_loaded_without_tracing_and_computes_the_same(cache):
  x = jnp.arange(6.0)
  first = programs.jit(scaled)(x)
  assert TRACES == ["scaled"] and len(kept(cache)) == 1
  jax.clear_caches()
  again = programs.jit(scaled)   # a new function object, JAX's memory cleared: what a new process has
  np.testing.assert_array_equal(again(x), first)
  np.testing.assert_array_equal(again(x + 1), jax.jit(lambda v: jnp.sin(v) * 3.0)(x + 1))
  assert TRACES == ["scaled"]


def test_a_new_shape_dtype_or_sharding_is_its_own_program(cache):
  fn = programs.jit(scaled)
  fn(jnp.ones(3))
  fn(jnp.ones(4))
  fn(jnp.ones(4, jnp.int32))
  rows = NamedSharding(make_mesh(), P("data"))
  programs.jit(scaled, in_shardings=rows)(jax.device_put(jnp.ones(8), rows))
  assert len(TRACES) == 4 and len(kept(cache)) == 4
  jax.clear_caches()
  programs.jit(scaled)(jnp.ones(4))
  out = programs.jit(scaled, in_shardings=rows)(jax.device_put(jnp.ones(8), rows))
  assert len(TRACES) == 4 and out.sharding == rows


def test_a_program_over_devices_its_caller_picks_is_jitted_as_usual(cache):
  """Without in_shardings, where a multi-device program's arguments go is decided at each call: not kept,
  and a later process knows so without exporting it again."""
  rows = NamedSharding(make_mesh(), P("data"))
  x = jax.device_put(jnp.ones(8), rows)
  np.testing.assert_allclose(programs.jit(scaled)(x), 3 * np.sin(np.ones(8)), rtol=1e-6)
  assert len(TRACES) == 2   # exported (and refused), then jitted
  jax.clear_caches()
  np.testing.assert_allclose(programs.jit(scaled)(x), 3 * np.sin(np.ones(8)), rtol=1e-6)
  assert len(TRACES) == 3   # jitted only


def test_the_closure_and_module_level_values_are_in_the_key(cache, monkeypatch):
  def make(offset):
    return programs.jit(lambda x: scaled(x) + offset)
  x = jnp.ones(3)
  np.testing.assert_allclose(make(1.0)(x), np.sin(1.0) * 3 + 1, rtol=1e-6)
  np.testing.assert_allclose(make(2.0)(x), np.sin(1.0) * 3 + 2, rtol=1e-6)   # another closure value
  monkeypatch.setattr(sys.modules[__name__], "SCALE", 5.0)                   # set at run time
  np.testing.assert_allclose(make(2.0)(x), np.sin(1.0) * 5 + 2, rtol=1e-6)
  assert len(TRACES) == 3 and len(kept(cache)) == 3


def test_a_value_the_key_cannot_hold_leaves_the_function_uncached(cache):
  handle = open(os.devnull)   # a file: not something a key can fingerprint
  fn = programs.jit(lambda x: x * (2.0 if handle else 1.0))
  np.testing.assert_array_equal(fn(jnp.ones(2)), [2.0, 2.0])
  handle.close()
  assert kept(cache) == []
  assert fn.uncached == "its key cannot include fn[0].<handle>: a _io.TextIOWrapper"


def test_what_the_trace_logged_is_said_again_when_its_program_is_loaded(cache, capsys, caplog):
  with caplog.at_level(logging.WARNING):
    programs.jit(logs_while_tracing)(jnp.ones(2))
    programs._said.clear()   # as in a new process
    jax.clear_caches()
    programs.jit(logs_while_tracing)(jnp.ones(2))
  assert TRACES == ["logs"]
  assert [r.getMessage() for r in caplog.records if r.name == "model.test_programs"] == \
      ["traced: this path falls back"] * 2
  assert [r.name for r in caplog.records if r.name == "jax.test_programs"] == ["jax.test_programs"]
  assert capsys.readouterr().err.count("traced: and the trainer says so") == 2   # the console's stream


def test_donation_holds_for_a_loaded_program(cache):
  fn = lambda state: state * 2
  programs.jit(fn, donate_argnums=0)(jnp.ones(4))
  state = jnp.ones(4)
  out = programs.jit(fn, donate_argnums=0)(state)
  np.testing.assert_array_equal(out, 2 * np.ones(4))
  assert state.is_deleted()


def test_an_unreadable_entry_is_traced_again_and_replaced(cache, capsys):
  programs.jit(scaled)(jnp.ones(3))
  [path] = cache.rglob("*.program")
  path.write_bytes(b"torn")
  jax.clear_caches()
  np.testing.assert_allclose(programs.jit(scaled)(jnp.ones(3)), np.sin(1.0) * 3 * np.ones(3), rtol=1e-6)
  out = capsys.readouterr()
  assert f"{path} is unreadable" in out.out + out.err
  assert TRACES == ["scaled", "scaled"] and path.stat().st_size > 100


def test_verify_stops_at_a_program_its_key_does_not_describe(cache, monkeypatch):
  """What a key that missed a value would do: another program under the same key. verify (the suite's mode)
  traces again at every hit and refuses it."""
  programs.jit(scaled)(jnp.ones(3))
  [path] = cache.rglob("*.program")
  other = programs.jit(lambda x: jnp.cos(x))
  other(jnp.ones(3))
  [other_path] = [p for p in cache.rglob("*.program") if p != path]
  path.write_bytes(other_path.read_bytes())
  np.testing.assert_allclose(programs.jit(scaled)(jnp.ones(3)), np.cos(np.ones(3)), rtol=1e-6)  # on: trusted
  monkeypatch.setenv("AIAYN_PROGRAM_CACHE", "verify")
  with pytest.raises(RuntimeError, match="misses a value the program depends on"):
    programs.jit(scaled)(jnp.ones(3))


def test_off_keeps_nothing(cache, monkeypatch):
  monkeypatch.setenv("AIAYN_PROGRAM_CACHE", "0")
  programs.jit(scaled)(jnp.ones(3))
  jax.clear_caches()
  programs.jit(scaled)(jnp.ones(3))
  assert kept(cache) == [] and TRACES == ["scaled", "scaled"]
  monkeypatch.setenv("AIAYN_PROGRAM_CACHE", "sometimes")
  with pytest.raises(ValueError, match="AIAYN_PROGRAM_CACHE='sometimes'"):
    programs.mode()


def test_inside_a_trace_or_an_export_it_is_a_plain_jit(cache):
  fn = programs.jit(scaled)
  np.testing.assert_allclose(jax.jit(lambda x: fn(x) * 2)(jnp.ones(2)), 6 * np.sin(1.0), rtol=1e-6)
  import kernels
  kernels.export(fn, jnp.ones(2), platforms=("cpu", "cuda"))
  assert kept(cache) == []


@pytest.mark.slow   # two smoke trainings in processes of their own: about 30 s
def test_a_new_process_loads_what_this_source_tree_kept(tmp_path):
  """The trainer's programs across processes: the second run traces nothing, and its metrics are the
  first's, value for value."""
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"), "AIAYN_PROGRAM_CACHE": "1",
         "JAX_PLATFORMS": "cpu", "JAX_LOG_COMPILES": "1"}
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
  runs = []
  for name in ("first", "second"):
    done = subprocess.run(
        [sys.executable, "-m", "train", "--config", "experiments/default.py:smoke", f"--workdir={tmp_path / name}",
         "--config.train.progress=False"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs.append(done.stdout + done.stderr)
  traced = [set(re.findall(r"Finished tracing (\w+) for jit", text)) for text in runs]
  steps = {"init_state", "train_step", "eval_step"}
  assert steps <= traced[0] and not steps & traced[1], traced       # the second loads them ...
  assert {"kept_init_state", "kept_train_step", "kept_eval_step"} <= traced[1], traced   # ... and calls them
  first, second = ((tmp_path / n / "metrics.jsonl").read_text().splitlines() for n in ("first", "second"))
  timing = ("time/", "per_sec", "mfu", "seconds", "tok_s")
  strip = lambda line: {k: v for k, v in json.loads(line).items() if not any(t in k for t in timing)}
  assert [strip(l) for l in first] == [strip(l) for l in second]


def test_eval_shape_is_kept_too(cache):
  shapes = programs.eval_shape(scaled, jnp.ones((2, 3)))
  jax.clear_caches()
  again = programs.eval_shape(scaled, jnp.ones((2, 3)))
  assert TRACES == ["scaled"] and again == shapes == jax.ShapeDtypeStruct((2, 3), jnp.float32)
  assert [p.suffix for p in cache.rglob("*.shapes")] == [".shapes"]


def test_environments_unused_for_a_week_are_removed_when_another_starts(cache):
  old, recent = cache / "old", cache / "recent"
  for folder, days in ((old, programs.KEEP_DAYS + 1), (recent, programs.KEEP_DAYS - 1)):
    folder.mkdir(parents=True)
    (folder / "x.program").write_bytes(b"")
    os.utime(folder, (time.time() - days * 86400,) * 2)
  programs.jit(scaled)(jnp.ones(3))   # this environment's folder is new
  assert not old.exists() and recent.exists() and len(kept(cache)) == 2


def test_an_option_or_mesh_the_caller_set_is_in_the_key(cache):
  fn = programs.jit(scaled)
  fn(jnp.ones(3))
  with jax.default_matmul_precision("highest"):
    fn(jnp.ones(3))
  with jax.set_mesh(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))):
    fn(jnp.ones(3))
  assert len(TRACES) == 3 and len(kept(cache)) == 3
