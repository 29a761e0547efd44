"""The install: pyproject.toml gives ranges, constraints.txt the exact versions CI tests and
constraints-lowest.txt the lowest ones; the code keeps to the public APIs of JAX, Flax, Optax and Orbax,
which is what carries it across their releases; the lowest versions pass a subset of the suite (slow)."""
import ast
import hashlib
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _canonical(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: pathlib.Path) -> dict[str, Version]:
  """name -> version of every `name==version` line of a constraints file."""
  pins = {}
  for line in path.read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      requirement = Requirement(line)
      (spec,) = requirement.specifier
      assert spec.operator == "==", line
      pins[_canonical(requirement.name)] = Version(spec.version)
  return pins


def _requirements(extras=("test", "interop")) -> list[Requirement]:
  texts = PYPROJECT["dependencies"] + [r for e in extras for r in PYPROJECT["optional-dependencies"][e]]
  return [Requirement(text) for text in texts]


def test_every_dependency_is_a_range_with_a_lower_bound_and_no_exact_pin():
  for requirement in _requirements():
    operators = {spec.operator for spec in requirement.specifier}
    assert "==" not in operators and "~=" not in operators, requirement
    if requirement.name != "importlib_resources":   # any version: tfds imports it without declaring it
      assert ">=" in operators, f"{requirement} has no lower bound"


def test_constraints_pin_every_dependency_inside_its_range():
  for path in ("constraints.txt", "constraints-lowest.txt"):
    pins = _pins(ROOT / path)
    for requirement in _requirements(extras=("test", "interop") if path == "constraints.txt" else ("test",)):
      version = pins.get(_canonical(requirement.name))
      assert version is not None, f"{path} does not pin {requirement.name}"
      assert requirement.specifier.contains(version), f"{path}: {requirement.name} {version} outside {requirement}"


def test_the_lowest_constraints_are_the_lower_bounds():
  pins = _pins(ROOT / "constraints-lowest.txt")
  for requirement in _requirements(extras=("test",)):
    lower = [Version(spec.version) for spec in requirement.specifier if spec.operator == ">="]
    if lower:
      assert pins[_canonical(requirement.name)] == lower[0], requirement


def test_the_gpu_constraints_are_the_versions_a_gpu_measurement_used_with_cis_interop():
  # constraints-gpu.txt: what the lent GPUs ran (scripts/device_check.sh logs `pip list` of the jax family,
  # flax, optax, orbax and numpy), every default dependency and the test extra inside its range, one
  # version for jax, jaxlib and the CUDA 13 plugin, and the interop extra as CI tests it (torch's version,
  # which its CPU build, installed first, meets: no CUDA torch).
  pins = _pins(ROOT / "constraints-gpu.txt")
  for requirement in _requirements(extras=("test",)):
    version = pins.get(_canonical(requirement.name))
    assert version is not None and requirement.specifier.contains(version), (requirement, version)
  jax_family = {pins[name] for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt")}
  assert len(jax_family) == 1, jax_family
  interop = {_canonical(Requirement(r).name) for r in PYPROJECT["optional-dependencies"]["interop"]}
  tested = _pins(ROOT / "constraints.txt")
  assert {name: pins.get(name) for name in interop} == {name: tested[name] for name in interop}
  log = (ROOT / "benchmarks/results/accelerators/h200-2026-11-27-device_check.log").read_text()
  measured = dict(re.findall(r"^([a-z][a-z0-9_-]+) +(\d[\w.]*)$", log, re.M))
  assert {"jax", "jax-cuda13-plugin", "flax"} <= set(measured), measured
  assert {name: str(pins[_canonical(name)]) for name in measured} == measured
  # The documented GPU line is the one this file is for.
  for doc in ("README.md", "REPRODUCING.md", "docs/accelerators.md"):
    assert "pip install -e '.[cuda13]' -c constraints-gpu.txt" in (ROOT / doc).read_text(), doc


def test_accelerator_extras_take_jaxs_own_extras_without_fixing_its_version():
  extras = PYPROJECT["optional-dependencies"]
  for extra in ("cuda12", "cuda13", "tpu"):
    (requirement,) = (Requirement(text) for text in extras[extra])
    assert requirement.name == "jax" and requirement.extras == {extra} and not requirement.specifier, requirement


# --- public APIs only ----------------------------------------------------------------------------------

_ROOTS = ("jax", "jaxlib", "flax", "optax", "orbax")
# Modules that are importable but are not the libraries' public API (their docs name other homes).
_INTERNAL = ("jax.interpreters", "jax.core", "jax.lib.xla_bridge", "jax.lib.xla_client", "jax.lib.xla_extension",
             "jaxlib.xla_client", "jaxlib.xla_extension", "jaxlib.mlir", "flax.core.scope", "flax.core.lift",
             "flax.core.tracers")
# Flax's public linen modules; the rest of flax.linen.* (module, linear, attention, ...) is reached through
# flax.linen itself.
_PUBLIC_LINEN = ("flax.linen.initializers", "flax.linen.partitioning", "flax.linen.dtypes")


def _private(path: str, imported: bool) -> bool:
  parts = path.split(".")
  if parts[0] not in _ROOTS:
    return False
  if any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts):
    return True
  if any(path == m or path.startswith(m + ".") for m in _INTERNAL):
    return True
  return imported and len(parts) > 2 and parts[:2] == ["flax", "linen"] and \
      not any(path == m or path.startswith(m + ".") for m in _PUBLIC_LINEN)


def private_uses(source: str) -> list[str]:
  """The dotted names of JAX, Flax, Optax and Orbax that `source` imports or reaches and that are not public."""
  tree, found, alias = ast.parse(source), [], {}   # alias: local name -> the dotted name it stands for
  for node in ast.walk(tree):
    for child in ast.iter_child_nodes(node):
      child.parent = node
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.asname:
          alias[a.asname] = a.name
        else:
          alias[a.name.split(".")[0]] = a.name.split(".")[0]
        if _private(a.name, imported=True):
          found.append(a.name)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for a in node.names:
        full = f"{node.module}.{a.name}"
        alias[a.asname or a.name] = full
        if _private(node.module, imported=True) or _private(full, imported=False):
          found.append(full)
  for node in ast.walk(tree):   # the longest attribute chains, e.g. jax._src.dtypes.canonicalize_dtype
    if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
      chain, inner = [], node
      while isinstance(inner, ast.Attribute):
        chain.append(inner.attr)
        inner = inner.value
      if isinstance(inner, ast.Name) and inner.id in alias:
        full = ".".join([alias[inner.id], *reversed(chain)])
        if _private(full, imported=False):
          found.append(full)
  return sorted(set(found))


def test_the_checker_finds_private_uses():
  source = """
import jax
import flax.linen as nn
from jax._src import core
from flax.linen.module import Module
from flax.core.scope import Scope
import orbax.checkpoint as ocp
x = jax._src.dtypes.canonicalize_dtype
y = ocp._src.path
z = nn.initializers.normal(1.0)
w = jax.lib.__version__
from flax.linen import initializers
from jax.interpreters import mlir
"""
  assert private_uses(source) == ["flax.core.scope.Scope", "flax.linen.module.Module", "jax._src.core",
                                   "jax._src.dtypes.canonicalize_dtype", "jax.interpreters.mlir",
                                   "orbax.checkpoint._src.path"]


# The private uses a test may make, each with its reason; the code itself has none.
ALLOWED_PRIVATE = {
    # jax's cuDNN check asks the CUDA plugin for its version, the one step of lowering cuDNN's attention
    # for cuda that needs a GPU host; the test tells it a version so that the lowering can be read here.
    "tests/test_fast_paths.py": ["jax._src.cudnn.fused_attention_stablehlo"],
}


def test_no_private_jax_flax_optax_or_orbax_api_in_the_code():
  found = {}
  for path in sorted(ROOT.rglob("*.py")):
    if any(part.startswith(".") or part in ("build", "runs") for part in path.relative_to(ROOT).parts):
      continue
    uses = [use for use in private_uses(path.read_text())
            if use not in ALLOWED_PRIVATE.get(str(path.relative_to(ROOT)), [])]
    if uses:
      found[str(path.relative_to(ROOT))] = uses
  assert not found, f"private APIs (use the public ones: jax.*, jax.extend, flax.linen, ...): {found}"


# --- the lowest versions ------------------------------------------------------------------------------

# A subset of the suite that touches every dependency's API: Flax modules, the sharded train step (Optax),
# Orbax checkpoints, the C++ decoding kernels built against jaxlib's FFI headers, sampling under
# shard_map on 8 devices; then python -m train's smoke run (tfds, sentencepiece, sacrebleu, ml_collections).
LOWEST_TESTS = ["tests/test_install.py::test_no_private_jax_flax_optax_or_orbax_api_in_the_code",
                "tests/test_model.py::test_future_target_tokens_never_change_earlier_logits",
                "tests/test_train_step.py::test_one_device_equals_eight_devices",
                "tests/test_checkpoint.py",
                "tests/test_cpu_decoding.py::test_beam_search_with_the_kernel_finds_what_it_finds_with_xla_ops",
                "tests/test_translate.py::test_sampling_draws_the_same_samples_on_any_number_of_devices"]


def _lowest_venv(python: str) -> pathlib.Path:
  """A venv with constraints-lowest.txt installed, kept in ~/.cache/aiayn (keyed by the file and Python)."""
  text = (ROOT / "constraints-lowest.txt").read_text()
  version = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                           text=True, check=True).stdout.strip()
  key = hashlib.sha256(f"{text}\n{version}".encode()).hexdigest()[:12]
  venv = pathlib.Path(os.environ.get("AIAYN_CACHE", pathlib.Path.home() / ".cache" / "aiayn")) / f"venv-lowest-{key}"
  if not (venv / "ok").exists():
    subprocess.run([python, "-m", "venv", "--clear", str(venv)], check=True)
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-r",
                           str(ROOT / "constraints-lowest.txt")], capture_output=True, text=True)
    if done.returncode:
      pytest.fail(f"installing constraints-lowest.txt failed:\n{done.stderr[-3000:]}")
    (venv / "ok").write_text(text)
  return venv


def test_the_lowest_versions_venv_is_made_once_and_then_reused(tmp_path, monkeypatch):
  # CI's slow suite installs constraints-lowest.txt from the registry only the first time on a machine.
  monkeypatch.setenv("AIAYN_CACHE", str(tmp_path))
  run, made = subprocess.run, []

  def recording(command, *args, **kwargs):
    if command[1] == "-c":   # the Python version, part of the venv's key
      return run(command, *args, **kwargs)
    made.append(command[1:3])
    if command[1:3] == ["-m", "venv"]:
      pathlib.Path(command[-1]).mkdir()
    return subprocess.CompletedProcess(command, 0, "", "")
  monkeypatch.setattr(subprocess, "run", recording)
  venv = _lowest_venv(sys.executable)
  assert made == [["-m", "venv"], ["-m", "pip"]] and (venv / "ok").exists()
  assert venv.parent == tmp_path and venv.name.startswith("venv-lowest-")
  made.clear()
  assert _lowest_venv(sys.executable) == venv and made == []


@pytest.mark.slow
def test_the_lowest_versions_pass_a_subset_of_the_suite(tmp_path):
  python = os.environ.get("AIAYN_LOWEST_PYTHON", sys.executable)
  venv = _lowest_venv(python)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "PYTEST_"))}
  env["AIAYN_TEST_JAX_CACHE"] = str(venv / "jax_cache")   # another jaxlib: its own compilation cache
  pytest_run = subprocess.run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *LOWEST_TESTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert pytest_run.returncode == 0, pytest_run.stdout[-5000:]
  smoke = subprocess.run([str(venv / "bin" / "python"), "-m", "train", "--config=experiments/default.py:smoke",
                          f"--workdir={tmp_path / 'smoke'}", "--config.train.progress=False"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert smoke.returncode == 0 and "test sacreBLEU" in smoke.stdout, (smoke.stdout + smoke.stderr)[-5000:]
