#!/usr/bin/env bash
# The accelerator check (docs/accelerators.md, "The check"): everything a short loan of one GPU
# should measure, in about 10 minutes, each stage under its own time limit so that one stuck stage
# leaves time for the rest. Compiles of the big model take 35-45 s each on an H200, so the benchmark
# stage gets the most time; what it finishes is written to check-gpu.json part by part.
#
#   bash scripts/device_check.sh [OUT_DIR]        # from the clone's root, on the GPU machine
#
# An offline node whose image lacks some of our dependencies installs them first from wheels in .whl/
# (scripts/offline_node.sh says how to make them). With BASELINE=1, a copy of an earlier commit's
# packages in .base/ is timed on the same device as the baseline (its benchmarks.accelerator Step, 8k
# tokens).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/device_check}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
stage() { echo; echo "=== [${SECONDS} s] $*"; }

stage "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
$PY -m pip list 2>/dev/null | grep -E "^(jax|jaxlib|jax-cuda.*|flax|optax|orbax-checkpoint|numpy) "
$PY -c "import pytest" 2>/dev/null || echo "pytest is not installed: the pytest stage below will fail;" \
  "install the GPU line with the test extra: pip install -e '.[gpu]' -c constraints-gpu.txt (docs/install.md)"

stage "pytest: cuDNN attention (dense mask; lengths and causal flag) against XLA's, forward and gradient"
JAX_PLATFORMS=cuda timeout 60 $PY -m pytest -q -p no:cacheprovider tests/test_fused_attention.py -k cudnn 2>&1 | tail -6

stage "benchmarks.accelerator: batch sweep, fixed cost, variants, profile"
timeout 420 $PY -m benchmarks.accelerator --steps 10 --variants --profile "$OUT/profile" \
  --out "$OUT/check-gpu.json" --note "scripts/device_check.sh" 2>&1 | grep -v "^WARNING\|^I0000\|^E0000"
(cd "$OUT" && tar czf profile.tgz profile 2>/dev/null && rm -rf profile)

if [ -d .base ] && [ "${BASELINE:-0}" = 1 ]; then
  stage "baseline: the earlier commit's step (.base), base and big at 8k tokens, same device"
  (cd .base && timeout 75 $PY - <<'PYEOF'
from benchmarks.accelerator import Step, model_config
for name in ("base", "big"):
  t = Step(model_config(name, "gpu"), 32, 256).time(10)
  print(f"baseline {name} 8k: step {t['step_s'] * 1e3:.1f} ms, MFU {t['mfu']:.1%}, compiled in {t['compile_s']:.0f} s")
PYEOF
  ) 2>&1 | grep -v "^WARNING\|^I0000\|^E0000"
fi

stage "python -m train: the WMT smoke experiment in bfloat16 (30 steps, profiled steps 20-25)"
timeout 75 $PY -m train --config experiments/wmt14_ende.py:smoke --workdir /tmp/ende_smoke \
  --config.train.num_steps=30 --config.train.log_every=10 --config.train.profile_steps=20-25 \
  --config.train.progress=False 2>&1 | grep -v "^WARNING\|^I0000\|^E0000" | tail -25
cp /tmp/ende_smoke/metrics.jsonl "$OUT/ende_smoke_metrics.jsonl" 2>/dev/null
stage "done"
