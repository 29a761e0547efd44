"""Dependencies point one way: data, kernels <- model <- run <- decode <- train, export <- experiments <- the
command lines that load experiments (python -m train; jobs/: launch, SLURM, sweeps and searches;
benchmarks); see docs/runs.md. Reads every module's imports (also those inside functions) with ast.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Rank of each top-level package (or module): a module may import its own package and lower ranks only.
# train imports decode (its dev/test BLEU is `translate`); experiments take decode's DEFAULTS; the command
# lines that load experiments (python -m train, jobs, benchmarks) sit on top, and none imports another.
RANK = {"data": 0, "kernels": 0, "model": 1, "run": 2, "decode": 3, "export": 4, "train": 4, "experiments": 5,
        "train.__main__": 6, "jobs": 6, "benchmarks": 6}
PACKAGES = {"data", "kernels", "model", "run", "decode", "export", "train", "experiments", "jobs", "benchmarks"}


def _layer(module: str) -> str:
  """'jobs.sweep_report' -> 'jobs.sweep_report' if ranked on its own, else its top-level package."""
  parts = module.split(".")
  return ".".join(parts[:2]) if ".".join(parts[:2]) in RANK else parts[0]


def _imports(path: pathlib.Path, module: str):
  """(line, imported module) for every import statement in the file, at any depth."""
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for alias in node.names:   # `from run import checkpoint` imports run.checkpoint
        yield node.lineno, f"{node.module}.{alias.name}"


def _modules():
  for package in sorted(PACKAGES):
    for path in sorted((ROOT / package).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      yield path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def edges_against_order():
  bad = []
  for path, module in _modules():
    mine = _layer(module)
    for line, target in _imports(path, module):
      if target.split(".")[0] not in PACKAGES:
        continue
      theirs = _layer(target)
      if theirs.split(".")[0] == mine.split(".")[0] and RANK[theirs] <= RANK[mine]:
        continue   # inside one package (train.__main__ may use train.*, not the other way round)
      if RANK[theirs] >= RANK[mine]:
        bad.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target} "
                   f"({mine} rank {RANK[mine]} -> {theirs} rank {RANK[theirs]})")
  return bad


def test_dependencies_point_one_way():
  assert edges_against_order() == []


def test_the_check_sees_an_edge_against_the_order(tmp_path, monkeypatch):
  # The test itself can fail: a run/ module importing train/ is reported with its line.
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "bad.py").write_text("def f():\n  from train import train\n")
  monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
  assert edges_against_order() == ["run/bad.py:2: run.bad imports train.train (run rank 2 -> train rank 4)"]


def test_the_trainer_and_the_experiments_do_not_import_jobs(tmp_path, monkeypatch):
  # jobs/ runs many trainings of the experiments: an import of it from train/ (even from train/__main__.py,
  # ranked beside it) or experiments/ is an arrow back up, reported with its line.
  for package in ("train", "experiments", "jobs"):
    (tmp_path / package).mkdir()
  (tmp_path / "train" / "__main__.py").write_text("from jobs import sweep\n")
  (tmp_path / "experiments" / "table9.py").write_text("import jobs.sweep_directions\n")
  (tmp_path / "jobs" / "sweep.py").write_text("import experiments\nfrom train import signals\n")
  monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
  assert edges_against_order() == [
      "experiments/table9.py:1: experiments.table9 imports jobs.sweep_directions (experiments rank 5 -> jobs rank 6)",
      "train/__main__.py:1: train.__main__ imports jobs.sweep (train.__main__ rank 6 -> jobs rank 6)"]


# model/ reaches kernels/ through one door: model/ops.py asks kernels/cpu_backend.py for the CPU backend
# and kernels/fused_attention.py for the fused attentions. Besides it, model/ reads only the kernels
# package's own names (the config's choices).
KERNEL_DOOR = {"model.ops": {"kernels", "kernels.cpu_backend", "kernels.fused_attention"},
               "model.config": {"kernels.CHOICES"}}


def kernel_imports_outside_the_door():
  bad = []
  for path, module in _modules():
    if module.split(".")[0] != "model":
      continue
    for line, target in _imports(path, module):
      if target.split(".")[0] == "kernels" and target not in KERNEL_DOOR.get(module, ()):
        bad.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target}")
    if "panel" in path.read_text().lower():
      bad.append(f"{path.relative_to(ROOT)}: mentions panels, the CPU backend's layout")
  return bad


def test_model_reaches_the_kernels_through_one_door():
  assert kernel_imports_outside_the_door() == []


def test_the_door_check_sees_a_layer_that_imports_a_kernel(tmp_path, monkeypatch):
  (tmp_path / "model").mkdir()
  (tmp_path / "model" / "layers.py").write_text("from kernels import flat_matmul\n# laid out as panels\n")
  (tmp_path / "model" / "ops.py").write_text("from kernels import cpu_backend\n")
  monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
  assert kernel_imports_outside_the_door() == [
      "model/layers.py:1: model.layers imports kernels.flat_matmul",
      "model/layers.py: mentions panels, the CPU backend's layout"]
