#!/usr/bin/env bash
# aiayn on an offline node whose image already has JAX: carry wheels of what the image lacks, install
# them without an index, and check the node (docs/install.md, "An offline node with an image").
#
#   # 1. on the node, or in its image: what it has
#   python -m pip freeze > image.txt
#   # 2. on a machine that reaches the registry, from this clone, with a Python of the node's version:
#   PYTHON=python3.12 bash scripts/offline_node.sh wheels image.txt wheelhouse
#   # 3. carry the clone and wheelhouse/ to the node; there, from the clone:
#   bash scripts/offline_node.sh install wheelhouse     # pip install --no-index --find-links wheelhouse
#   bash scripts/offline_node.sh smoke                  # backend, devices, the smoke experiment, the check
#                                                       # (AIAYN_CHECK_ARGS: benchmarks.accelerator's flags)
#
# `wheels` downloads (or builds, for the few that ship no wheel) every dependency of pyproject.toml
# that image.txt does not list, with their own dependencies pinned to the image's versions, and then
# drops the wheels of what the image has: what remains is what the node lacks. The clone itself is not
# installed: the commands run from its root.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}

usage() { sed -n '2,17p' "$0" >&2; exit 2; }

# The requirements of pyproject.toml's [project.dependencies] whose project the freeze in $1 lacks.
missing_requirements() {
  "$PYTHON" - "$1" <<'EOF'
import re, sys, tomllib
def name(text):
  return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", text).group(1)).lower()
have = {name(line) for line in open(sys.argv[1]) if re.match(r"\s*[A-Za-z0-9]", line)}
for requirement in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
  if name(requirement) not in have:
    print(requirement)
EOF
}

case "${1:-}" in
  wheels)
    [ $# -eq 3 ] || usage
    image=$2 out=$3
    mkdir -p "$out"
    pins=$(mktemp)
    grep -E '^[A-Za-z0-9][A-Za-z0-9._-]*==' "$image" > "$pins" || true   # `name @ url` lines cannot pin
    mapfile -t wanted < <(missing_requirements "$image")
    echo "[wheels] the image lacks: ${wanted[*]:-nothing}"
    if [ ${#wanted[@]} -gt 0 ]; then
      "$PYTHON" -m pip wheel -q --wheel-dir "$out" -c "$pins" "${wanted[@]}"
    fi
    # Drop what the image has (pulled in as a dependency, at the image's version).
    "$PYTHON" - "$image" "$out" <<'EOF'
import pathlib, re, sys
name = lambda text: re.sub(r"[-_.]+", "-", text).lower()
have = {name(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", l).group(1))
        for l in open(sys.argv[1]) if re.match(r"\s*[A-Za-z0-9]", l)}
for wheel in pathlib.Path(sys.argv[2]).glob("*.whl"):
  if name(wheel.name.split("-")[0]) in have:
    wheel.unlink()
EOF
    rm -f "$pins"
    echo "[wheels] $(ls "$out"/*.whl 2>/dev/null | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out:"
    ls "$out"
    ;;
  install)
    [ $# -eq 2 ] || usage
    shopt -s nullglob
    wheels=("$2"/*.whl)
    if [ ${#wheels[@]} -gt 0 ]; then
      "$PYTHON" -m pip install --no-index --find-links "$2" "${wheels[@]}"
    fi
    # Every dependency of pyproject.toml is now present, in its range (or this names what is not).
    "$PYTHON" - <<'EOF'
import importlib.metadata, sys, tomllib
try:
  from packaging.requirements import Requirement
except ImportError:   # pip carries its own copy
  from pip._vendor.packaging.requirements import Requirement
bad = []
for text in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
  requirement = Requirement(text)
  try:
    version = importlib.metadata.version(requirement.name)
  except importlib.metadata.PackageNotFoundError:
    bad.append(f"{requirement.name} missing")
    continue
  if not requirement.specifier.contains(version, prereleases=True):
    bad.append(f"{requirement.name} {version} is outside {requirement.specifier}")
print("[install] " + ("; ".join(bad) if bad else "every dependency of pyproject.toml is present, in range"))
sys.exit(1 if bad else 0)
EOF
    ;;
  smoke)
    workdir=${AIAYN_SMOKE_WORKDIR:-$(mktemp -d)/smoke}
    "$PYTHON" -c "
import jax
print('[smoke] jax', jax.__version__, 'backend', jax.default_backend())
for device in jax.devices():
  print('[smoke]  ', device.platform, device.device_kind, device)"
    "$PYTHON" -m train --config experiments/default.py:smoke --workdir "$workdir" --config.train.progress=False
    if [ -f benchmarks/accelerator.py ]; then   # at its smallest: one timed step, the base model's search
      # shellcheck disable=SC2086  # AIAYN_CHECK_ARGS is a list of flags
      "$PYTHON" -m benchmarks.accelerator ${AIAYN_CHECK_ARGS:---steps 1 --search_model base --out "$(dirname "$workdir")/check.json"}
    else
      echo "[smoke] benchmarks/accelerator.py is not in this clone: no accelerator check" >&2
      exit 1
    fi
    ;;
  *) usage ;;
esac
