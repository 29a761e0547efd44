"""Programs kept from one process to the next and found without tracing: `programs.jit`.

    step = programs.jit(fn, in_shardings=..., donate_argnums=0)   # as jax.jit(fn, ...)
    state, metrics = step(state, batch, key)
    shapes = programs.eval_shape(init, key)                         # as jax.eval_shape(init, key)

JAX's persistent compilation cache keeps XLA's compile, but to find a program there it must first trace
and lower it, which on a CPU is most of a short run's start (docs/performance.md, "Start-up"). A
`programs.jit` function is `jax.jit(fn, **jit_kwargs)`; where the cache is on, each program it traces
is kept as StableHLO (jax.export, for this host's platform) under a key made without tracing, from:

  - the source of the packages programs are traced through (data, decode, kernels, model, run, train),
    the versions of JAX, its plugins and the libraries it traces through, JAX's options as the calling
    thread sees them and the mesh it set (jax.default_matmul_precision, jax.set_mesh, ...), the
    XLA_*/JAX_*/AIAYN_* environment, the backend and its devices;
  - the function: its code, defaults and closure, and the module-level values its code names, walked
    through partials, dataclasses (a flax Module, a config), containers, arrays (by their bytes), meshes
    and shardings. A value the walk does not know leaves the function uncached (jitted as usual, said
    once at INFO) rather than keyed by a guess. Not in the key: a value set at run time on a module or
    class that the function reaches only through an attribute (`kernels.SOMETHING = ...`);
  - the call's arguments: their tree, shapes, dtypes and shardings.

A later process with the same key loads the StableHLO and compiles it, which JAX's cache answers: nothing
is traced from the model, and the program is the one the first process ran (both run the exported
module). What the trace logged (a kernel's fallback warning) is kept with it and said again at the load.

On where JAX's compilation cache has a directory (`python -m train` sets one; JAX_COMPILATION_CACHE_DIR
for the other commands), in a single process, for calls with array arguments outside a trace or an
export (kernels.lowering_for). Kept in `<jax_compilation_cache_dir>/aiayn_programs/<environment>/`, the
environments used in the last KEEP_DAYS. A program over several devices without in_shardings is not kept
(where its arguments go is decided at each call), nor one jax.export does not take.
AIAYN_PROGRAM_CACHE=0 turns it off; AIAYN_PROGRAM_CACHE=verify traces again at every load and stops with
an error where the program kept differs from the one traced (the test suite runs so: tests/conftest.py);
AIAYN_PROGRAM_CACHE_DEBUG=DIR writes what each function's key was made of.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import logging
import os
import pathlib
import pickle
import re
import shutil
import sys
import time
import types

import jax
import numpy as np

log = logging.getLogger(__name__)

REPO = pathlib.Path(__file__).resolve().parent.parent
# the packages a program is traced through: their source is part of every key
TRACED = ("data", "decode", "kernels", "model", "run", "train")
# an environment's programs unused for this many days are removed (when another environment starts)
KEEP_DAYS = 7
# the libraries whose code a program is traced through; their versions are part of every key
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy", "ml_dtypes", "ml_collections", "chex", "orbax-checkpoint",
             "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")
# module-level values a program's key leaves out, and why
UNKEYED = {("kernels", "_LOWERING"): "the export context, made on the first export: nothing is kept inside it"}
# JAX's options that a thread may set for itself (jax.config's attributes), read at every call; less those
# about logging, caches, tracebacks and guards, which change no program (`with jax.log_compiles():` around
# a call must not make it another program)
_QUIET = ("log", "cache", "traceback", "pprint", "transfer_guard", "thread_guard", "timeout", "share_binary",
          "distributed_debug", "source_url", "captured_constants", "leaked_clients", "preemption",
          "recoverability")
_OPTIONS = tuple(sorted(name for name in jax.config.values
                        if hasattr(jax.config, name) and not any(word in name for word in _QUIET)))
ENV_PREFIXES = ("XLA_", "JAX_", "AIAYN_", "LIBTPU_", "TPU_", "CUDA_VISIBLE_DEVICES", "NVIDIA_TF32")
_EVENT = "/aiayn/program_cache/load_sec"


_DEBUG = [] if os.environ.get("AIAYN_PROGRAM_CACHE_DEBUG") else None


class Unknown(TypeError):
  """A value the key's walk does not know how to fingerprint."""


def mode() -> str:
  """'on', 'off' or 'verify' (AIAYN_PROGRAM_CACHE)."""
  value = os.environ.get("AIAYN_PROGRAM_CACHE", "1").strip().lower()
  if value in ("0", "off", "false", "no"):
    return "off"
  if value == "verify":
    return "verify"
  if value in ("1", "on", "true", "yes", ""):
    return "on"
  raise ValueError(f"AIAYN_PROGRAM_CACHE={value!r}: use 1 (the default), 0, or verify")


def directory() -> pathlib.Path | None:
  """Where this source tree's programs are kept, or None where the cache is off."""
  root = jax.config.jax_compilation_cache_dir
  if mode() == "off" or not root or jax.process_count() > 1:
    return None
  return pathlib.Path(root) / "aiayn_programs" / _environment()[:24]


# ----------------------------------------------------------------------------------------------------
# The key.
# ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _source() -> str:
  digest = hashlib.sha256()
  for package in TRACED:
    for path in sorted((REPO / package).rglob("*")):
      if path.suffix in (".py", ".cc") and path.is_file():
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
  return digest.hexdigest()


def _context() -> tuple:
  """What a call's trace may read from JAX's state besides its arguments: every option's value as the
  calling thread sees it (a `with jax.default_matmul_precision(...)` included) and the mesh a caller set
  (jax.set_mesh). About 13 us; part of the key of every call."""
  return tuple(getattr(jax.config, name) for name in _OPTIONS) + (jax.sharding.get_abstract_mesh(),)


def _version(name: str) -> str:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return "-"


@functools.lru_cache(maxsize=1)
def _environment() -> str:
  """This process's part of every key: source, versions, JAX's configuration, environment, devices."""
  from kernels import cpu_decoding
  backend = jax.devices()[0].client
  parts = (_source(), sys.version, [(name, _version(name)) for name in LIBRARIES],
           sorted((k, repr(v)) for k, v in jax.config.values.items()),
           sorted((k, v) for k, v in os.environ.items()
                  if k.startswith(ENV_PREFIXES) and not k.startswith("AIAYN_PROGRAM_CACHE")),
           backend.platform, backend.platform_version, jax.process_count(),
           [(d.id, d.device_kind, d.platform) for d in jax.devices()], cpu_decoding.find_compiler())
  return hashlib.sha256(repr(parts).encode()).hexdigest()


def _in_repo(module: str | None) -> bool:
  if not module:
    return False
  file = getattr(sys.modules.get(module), "__file__", None)
  return bool(file) and pathlib.Path(file).resolve().is_relative_to(REPO)


def _global_names(code: types.CodeType):
  yield from code.co_names
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      yield from _global_names(const)


class _Walk:
  """A fingerprint of a value: everything a program traced from it could depend on, or Unknown."""

  def __init__(self):
    self.digest = hashlib.sha256()
    self._seen: dict[int, int] = {}
    self._alive = []   # what was seen stays alive, so that its id is not reused during the walk

  def add(self, *parts) -> None:
    self.digest.update(repr(parts).encode() + b"\0")
    if _DEBUG is not None:
      _DEBUG.append(repr(parts)[:300])

  def value(self, x, path: str = "fn") -> None:
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
      return self.add(type(x).__name__, x)
    if id(x) in self._seen:
      return self.add("seen", self._seen[id(x)])
    self._seen[id(x)] = len(self._seen)
    self._alive.append(x)
    from flax import linen as nn
    from jax import sharding as jsh
    if isinstance(x, type):
      return self.add("type", x.__module__, x.__qualname__)
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
      return self._array(x, path)
    if isinstance(x, np.dtype) or type(x).__module__ == "ml_dtypes":
      return self.add("dtype", str(x))
    if isinstance(x, enum.Enum):
      return self.add("enum", type(x).__qualname__, x.name)
    if isinstance(x, (tuple, list)):
      self.add(type(x).__module__, type(x).__qualname__, len(x))
      for i, item in enumerate(x):
        self.value(item, f"{path}[{i}]")
      return None
    if isinstance(x, dict):
      self.add(type(x).__qualname__, len(x))
      for key, item in x.items():
        self.value(key, f"{path} key")
        self.value(item, f"{path}[{key!r}]")
      return None
    if isinstance(x, (set, frozenset)):
      return self.add(type(x).__qualname__, sorted(repr(item) for item in x))
    if isinstance(x, functools.partial):
      self.add("partial")
      self.value(x.func, f"{path}.func")
      self.value(x.args, f"{path}.args")
      return self.value(x.keywords, f"{path}.keywords")
    if isinstance(x, types.FunctionType):
      return self._function(x, path)
    if isinstance(x, functools._lru_cache_wrapper):   # a memo of a function: the function's results
      self.add("lru_cache")
      return self.value(x.__wrapped__, f"{path}.__wrapped__")
    if isinstance(x, types.MethodType):
      self.add("method")
      self.value(x.__func__, f"{path}.__func__")
      return self.value(x.__self__, f"{path}.__self__")
    if isinstance(x, types.ModuleType):
      return self.add("module", x.__name__)
    if isinstance(x, types.CodeType):
      return self._code(x)
    if type(x).__name__ == "PjitFunction":   # jax.jit(f): f, where it is a module's own (jnp's functions)
      f = x.__wrapped__
      if getattr(sys.modules.get(f.__module__), f.__name__, None) is not x:
        raise Unknown(f"{path}: a function jitted at run time (its jit options cannot be read)")
      return self.add("jitted", f.__module__, f.__qualname__)
    if isinstance(x, types.BuiltinFunctionType):   # len, math.exp; or a bound method of a value: its value
      owner = x.__self__
      self.add("builtin", x.__name__, type(owner).__qualname__)
      return None if owner is None or isinstance(owner, types.ModuleType) else self.value(owner, path)
    if isinstance(x, np.ufunc):
      return self.add("ufunc", x.__name__)
    if isinstance(x, jsh.Mesh):
      return self.add("mesh", x.axis_names, x.devices.shape, [d.id for d in x.devices.flat],
                      repr(getattr(x, "axis_types", None)))
    if isinstance(x, jsh.NamedSharding):
      self.add("named", repr(x.spec), x.memory_kind)
      return self.value(x.mesh, f"{path}.mesh")
    if isinstance(x, jsh.SingleDeviceSharding):
      return self.add("single", [d.id for d in x.device_set], x.memory_kind)
    if isinstance(x, jsh.PartitionSpec):
      return self.add("spec", repr(x))
    if isinstance(x, jax.ShapeDtypeStruct):
      self.add("sds", x.shape, str(x.dtype))
      return self.value(x.sharding, f"{path}.sharding")
    if isinstance(x, logging.Logger):
      return self.add("logger", x.name)
    if isinstance(x, pathlib.PurePath):
      return self.add("path", str(x))
    if type(x).__name__ == "UserConfig" and type(x).__module__.startswith("jax"):   # make_user_context
      self.add("user context")
      return self.value(x.value, f"{path}.value")
    if isinstance(x, nn.Module):
      if x.scope is not None:
        raise Unknown(f"{path}: a bound flax Module")
      self.add("module", type(x).__module__, type(x).__qualname__)
      for field in dataclasses.fields(x):
        if field.name != "parent":
          self.value(getattr(x, field.name), f"{path}.{field.name}")
      return None
    if dataclasses.is_dataclass(x):
      self.add("dataclass", type(x).__module__, type(x).__qualname__)
      for field in dataclasses.fields(x):
        self.value(getattr(x, field.name), f"{path}.{field.name}")
      return None
    if type(x).__module__.startswith("ml_collections") and hasattr(x, "to_dict"):
      return self.value(x.to_dict(), path)
    if _in_repo(type(x).__module__) and hasattr(x, "__dict__") and not hasattr(type(x), "__slots__"):
      self.add("object", type(x).__module__, type(x).__qualname__)
      return self.value(dict(vars(x)), f"{path}.__dict__")
    raise Unknown(f"{path}: a {type(x).__module__}.{type(x).__qualname__}")

  def _array(self, x, path: str) -> None:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      self.add("key", str(x.dtype))
      x = jax.random.key_data(x)
    if x.size > (1 << 22):
      raise Unknown(f"{path}: an array of {x.size} elements (a program should take it as an argument)")
    try:
      array = np.asarray(x)
    except Exception as e:   # a traced value, an array on another process's devices, ...
      raise Unknown(f"{path}: an array without a value here ({type(e).__name__})") from None
    if array.dtype == object:
      raise Unknown(f"{path}: an array of Python objects")
    self.add("array", type(x).__name__, array.dtype.str, array.shape,
             hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest())

  def _code(self, code: types.CodeType) -> None:
    self.add("code", code.co_code, code.co_names, code.co_varnames, code.co_freevars)
    for const in code.co_consts:
      if isinstance(const, types.CodeType):
        self._code(const)
      else:
        self.add(type(const).__name__, repr(const))

  def _function(self, fn: types.FunctionType, path: str) -> None:
    """Library functions by name (their versions are in the key) and what their closure holds; this
    repository's also by their code and the module-level values it names (the source is in the key,
    a value set at run time is not)."""
    self.add("function", fn.__module__, fn.__qualname__)
    self.value(fn.__defaults__, f"{path} defaults")
    self.value(fn.__kwdefaults__, f"{path} defaults")
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
      try:
        contents = cell.cell_contents
      except ValueError:   # an empty cell: a name not yet bound when the function was made
        contents = "<empty cell>"
      self.value(contents, f"{path}.<{name}>")
    if fn.__module__ == "__main__" or _in_repo(fn.__module__):
      self._code(fn.__code__)
      for name in sorted(set(_global_names(fn.__code__))):
        if name in fn.__globals__ and (fn.__module__, name) not in UNKEYED:
          self.value(fn.__globals__[name], f"{fn.__module__}.{name}")


def fingerprint(x) -> str:
  """The walk's hex digest of x; Unknown where it meets a value it cannot fingerprint."""
  walk = _Walk()
  walk.value(x)
  return walk.digest.hexdigest()


def _signature(args) -> tuple | None:
  """What a compiled program is specific to in its arguments: their tree, and each leaf's abstract value
  (shape, dtype, weak type) and sharding. None where a leaf is traced, or neither an array nor a number.
  (Run at every call: about 0.4 us a leaf.)"""
  leaves, tree = jax.tree_util.tree_flatten(args)
  parts = []
  for leaf in leaves:
    if isinstance(leaf, jax.Array):
      try:
        parts.append((leaf.aval, leaf.sharding))
      except AttributeError:   # a traced value: it has no sharding
        return None
    elif isinstance(leaf, (np.ndarray, np.generic)):
      parts.append((leaf.shape, leaf.dtype))
    elif isinstance(leaf, (bool, int, float, complex)):
      parts.append(type(leaf))
    else:
      return None
  return tree, tuple(parts)


def _describe(signature: tuple) -> str:
  """The signature's fingerprint, the same in every process."""
  tree, parts = signature
  walk = _Walk()
  walk.add(repr(tree))
  for part in parts:
    if isinstance(part, type):
      walk.add("scalar", part.__name__)
    elif isinstance(part[0], tuple):
      walk.add("numpy", part[0], str(part[1]))
    else:
      aval, sharding = part
      walk.add("array", str(aval))   # e.g. f32[4,8] or key<fry>[], with weak_type where set
      walk.value(sharding)
  return walk.digest.hexdigest()


# ----------------------------------------------------------------------------------------------------
# The jitted function.
# ----------------------------------------------------------------------------------------------------
_said: set = set()


def _say_once(level: int, message: str) -> None:
  if message not in _said:
    _said.add(message)
    log.log(level, message)


class _Capture(logging.Handler):
  """The log records of a trace, to be said again where its program is loaded instead."""

  def __init__(self):
    super().__init__(logging.INFO)
    self.records = []

  def emit(self, record):
    if record.name.split(".")[0] in TRACED:   # this code's words (JAX's own compile log is not replayed)
      self.records.append((record.name, record.levelno, record.getMessage()))


class Jit:
  """jax.jit(fn, **jit_kwargs), its compiled programs kept across processes (the module's docstring)."""

  def __init__(self, fn, **jit_kwargs):
    if {"static_argnums", "static_argnames"} & set(jit_kwargs):
      raise ValueError("programs.jit: static arguments are not keyed; close over them instead")
    self.fn, self.jitted = fn, jax.jit(fn, **jit_kwargs)
    self._jit_kwargs = jit_kwargs
    self._key = None          # the function's fingerprint; "" where it cannot be fingerprinted
    self._programs = {}       # (signature, trace context) -> the jitted call of its program
    self.uncached = None      # why the function is jitted without the cache, where it is
    functools.update_wrapper(self, fn, updated=())

  def __getattr__(self, name):   # lower, trace, eval_shape, ...: the jitted function's
    return getattr(self.jitted, name)

  def __call__(self, *args, **kwargs):
    folder = None if kwargs or self._key == "" or _exporting() else directory()
    signature = _signature(args) if folder is not None else None
    if signature is None:   # the cache off, the function uncached, or a call it cannot key
      return self.jitted(*args, **kwargs)
    context = _context()
    program = self._programs.get((signature, context))
    if program is None:
      if not self._fingerprint():
        return self.jitted(*args)
      program = self._programs[signature, context] = self._program(folder, signature, context, args)
    return program(*args)

  def _fingerprint(self) -> str:
    if self._key is None:
      try:
        self._key = fingerprint((self.fn, self._jit_kwargs))
      except Unknown as e:
        self._uncached(f"its key cannot include {e}")
      if _DEBUG is not None and self._key:   # AIAYN_PROGRAM_CACHE_DEBUG=DIR: what each key was made of
        folder = pathlib.Path(os.environ["AIAYN_PROGRAM_CACHE_DEBUG"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{_name(self.fn)}-{self._key[:12]}.txt").write_text("\n".join(_DEBUG))
      if _DEBUG is not None:
        _DEBUG.clear()
    return self._key

  def _uncached(self, why: str):
    """Jitted as usual from now on; why is kept (`.uncached`) and logged at DEBUG, never on the console,
    where a command's output may be going."""
    self._key, self.uncached = "", why
    _say_once(logging.DEBUG, f"run/programs.py: {_name(self.fn)} is jitted without the program cache ({why})")
    return self.jitted

  def _program(self, folder: pathlib.Path, signature, context, args):
    """The jitted call of this signature's program: the one kept where there is one, else the one traced
    now (and kept). Both go through jax.export, so that a run that keeps a program and one that loads it
    compile the same module (which JAX's compilation cache then holds)."""
    from kernels import cpu_decoding
    start = time.perf_counter()
    key = hashlib.sha256(f"{self._key}|{_describe(signature)}|{context!r}".encode()).hexdigest()
    path = folder / f"{_name(self.fn)[:40]}-{key[:32]}.program"
    entry = _read(path)
    if entry is not None and "uncached" in entry:   # an earlier process found it cannot be kept
      return self._uncached(entry["uncached"])
    kept = entry.get("exported") if entry is not None else None
    exported = _load(entry, path) if entry is not None and mode() != "verify" else None
    if exported is None:
      try:
        exported, said = self._export(args)
        if exported.nr_devices > 1 and "in_shardings" not in self._jit_kwargs:
          raise ValueError(f"it runs on {exported.nr_devices} devices and takes no in_shardings: where its "
                           f"arguments go is decided at each call")
      except Exception as e:   # a custom call jax.export does not take, ...: jitted as usual, here and later
        why = f"{type(e).__name__}: {str(e)[:300]}"
        _write(path, dict(uncached=why))
        return self._uncached(why)
      if mode() == "verify" and isinstance(kept, jax.export.Exported) and _text(kept) != _text(exported):
        raise RuntimeError(
            f"run/programs.py: the program cache holds another program for {_name(self.fn)} under the same "
            f"key ({path}): the key misses a value the program depends on. Please report it; "
            f"AIAYN_PROGRAM_CACHE=0 turns the cache off")
      if not isinstance(kept, jax.export.Exported):   # nothing kept yet, or what was is unusable
        _write(path, dict(exported=dataclasses.replace(exported, _get_vjp=None), said=said))
    else:
      jax.monitoring.record_event_duration_secs(_EVENT, time.perf_counter() - start)   # train/goodput.py
    uses_cpu_kernels = any(t.encode() in exported.mlir_module_serialized for t in cpu_decoding.TARGETS)
    if uses_cpu_kernels and not cpu_decoding.available():   # registers them in this process
      return self._uncached("it calls the C++ decoding kernels, which are not available here")
    call = lambda *args: exported.call(*args)
    call.__name__ = call.__qualname__ = f"kept_{_name(self.fn)}"   # JAX's logs: jit(kept_train_step)
    return jax.jit(call, **self._jit_kwargs)

  def _export(self, args):
    """(this call's program exported for this host, what its trace logged)."""
    import kernels
    from kernels import cpu_decoding
    from run import console
    capture = _Capture()
    loggers = [logging.getLogger(), *map(logging.getLogger, console.LOGGERS)]   # the console's propagate no
    for logger in loggers:
      logger.addHandler(capture)
    try:
      exported = kernels.export(self.jitted, *args, platforms=(kernels._host_platform(),),
                                custom_calls=tuple(cpu_decoding.TARGETS))
    finally:
      for logger in loggers:
        logger.removeHandler(capture)
    return exported, capture.records


def eval_shape(fn, *args):
  """jax.eval_shape(fn, *args), kept beside the programs under the same kind of key (the shapes of a
  train state, which are traced from the model's init otherwise)."""
  folder, signature = directory(), _signature(args)
  if folder is None or signature is None or _exporting():
    return jax.eval_shape(fn, *args)
  try:
    key = hashlib.sha256(f"{fingerprint(fn)}|{_describe(signature)}|{_context()!r}".encode()).hexdigest()
  except Unknown:
    return jax.eval_shape(fn, *args)
  path = folder / f"{_name(fn)[:40]}-{key[:32]}.shapes"
  entry = _read(path)
  if entry is not None and "shapes" in entry and mode() != "verify":
    return entry["shapes"]
  shapes = jax.eval_shape(fn, *args)
  if entry is not None and entry.get("text") != repr(shapes):   # verify
    raise RuntimeError(f"run/programs.py: {path} holds other shapes than {_name(fn)} gives: the key misses a "
                       f"value they depend on. Please report it; AIAYN_PROGRAM_CACHE=0 turns the cache off")
  if entry is None:
    _write(path, dict(shapes=shapes, text=repr(shapes)))
  return shapes


def _text(exported) -> str | None:
  """An exported program's StableHLO less its source locations (which name the caller's lines)."""
  if not isinstance(exported, jax.export.Exported):
    return None
  text = "\n".join(line for line in exported.mlir_module().splitlines() if not line.startswith("#loc"))
  return re.sub(r" loc\((?:[^()]|\([^()]*\))*\)", "", text)


def _name(fn) -> str:
  while isinstance(fn, functools.partial):
    fn = fn.func
  return getattr(fn, "__name__", "fn").replace("<", "").replace(">", "")


def _exporting() -> bool:
  import kernels
  return bool(kernels._LOWERING) and kernels._LOWERING[0].value is not None


def _read(path: pathlib.Path) -> dict | None:
  try:
    with open(path, "rb") as f:
      entry = pickle.load(f)
    if not isinstance(entry, dict):
      raise TypeError(f"a {type(entry).__name__}, not an entry")
    return entry
  except FileNotFoundError:
    return None
  except Exception as e:   # a torn or foreign file: traced again and replaced
    log.warning("run/programs.py: %s is unreadable (%s: %s); tracing the program again", path,
                type(e).__name__, e)
    return None


def _load(entry: dict, path: pathlib.Path):
  """The entry's jax.export.Exported, its trace's log said again (once per process); None where it cannot
  be read."""
  exported = entry.get("exported")
  if not isinstance(exported, jax.export.Exported):
    log.warning("run/programs.py: %s holds no program; tracing it again", path)
    return None
  os.utime(path.parent)   # this source tree's programs were used: kept by _prune
  for name, level, message in entry.get("said", ()):
    if (name, level, message) not in _said:
      _said.add((name, level, message))
      logging.getLogger(name).log(level, "%s", message)
  return exported


def _write(path: pathlib.Path, entry: dict) -> None:
  """Written beside its name and renamed, as run.workdir.write_atomically does, but under a name of this
  process's own: the test suite's workers write the same program at once."""
  try:
    data = pickle.dumps(entry)
  except Exception as e:   # a program whose pieces do not pickle: run, not kept
    _say_once(logging.INFO, f"run/programs.py: {path.name} is not kept ({type(e).__name__}: {e})")
    return
  try:
    fresh = not path.parent.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)
    if fresh:
      _prune(path.parent.parent)
  except OSError as e:
    _say_once(logging.WARNING, f"run/programs.py: cannot keep programs in {path.parent} ({e})")


def _prune(root: pathlib.Path) -> None:
  """Removes the environments unused for KEEP_DAYS (a load or a write marks one used)."""
  for folder in root.iterdir():
    try:
      if folder.is_dir() and time.time() - folder.stat().st_mtime > KEEP_DAYS * 86400:
        shutil.rmtree(folder, ignore_errors=True)
    except OSError:
      pass


def jit(fn, **jit_kwargs) -> Jit:
  """jax.jit(fn, **jit_kwargs), its programs kept across processes where the cache is on."""
  return Jit(fn, **jit_kwargs)
