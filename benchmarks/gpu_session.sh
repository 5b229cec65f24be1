#!/usr/bin/env bash
# What a session with a lent GPU (the `device` tool's H100 / H200) runs, one step per device call
# (each call is capped at 10 minutes, a session at 30): results land in $OUT, which the tool brings
# back. The machine has python3 3.12 with jax 0.11.x (CUDA), numpy and ml_dtypes, and no network:
# nothing is installed; the package is put on PYTHONPATH as links (expertd.kernels -> kernels/,
# expertd.server -> server/, as pyproject.toml maps them), which is all the kernels and these
# benchmarks import.
#
#   bash benchmarks/gpu_session.sh check    # environment, then every backend vs the float64 oracle
#   bash benchmarks/gpu_session.sh router   # benchmarks/router.py (Pallas router compiled)
#   bash benchmarks/gpu_session.sh layer    # benchmarks/moe_layer.py --no-hf (issue 3's GPU targets)
#   bash benchmarks/gpu_session.sh engine   # benchmarks/engine_step.py: the engine's step cycle
#                                           # (host inputs vs device_put, results read back)
#   bash benchmarks/gpu_session.sh all      # all four (over 10 minutes: one call does not fit)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/expertd-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

setup() {
  local site
  site=$(mktemp -d)
  mkdir -p "$site/expertd"
  for pkg in kernels server client; do ln -sfn "$PWD/$pkg" "$site/expertd/$pkg"; done
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  { nvidia-smi; $PY -c 'import sys, jax, expertd.kernels.moe; print(sys.version); print(jax.__version__, jax.devices())'; } \
    > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
}

step() {
  case "$1" in
    check) timeout 420 $PY benchmarks/gpu_check.py ${GPU_CHECK_ARGS:-} --out "$OUT/gpu_check.json" 2>&1 \
             | tee "$OUT/gpu_check.log" ;;
    router) timeout 300 $PY benchmarks/router.py 2>&1 | tee "$OUT/router.log"
            cp benchmarks/results/router.json "$OUT/router_gpu.json" ;;
    layer) timeout 540 $PY benchmarks/moe_layer.py --no-hf ${LAYER_ARGS:-} --out "$OUT/moe_layer_gpu.json" 2>&1 | tee "$OUT/moe_layer.log" ;;
    engine) timeout 300 $PY benchmarks/engine_step.py ${ENGINE_STEP_ARGS:-} --out "$OUT/engine_step_gpu.json" 2>&1 \
              | tee "$OUT/engine_step.log" ;;
    *) echo "unknown step $1 (check | router | layer | engine | all)"; return 2 ;;
  esac
}

setup
if [ "${1:-check}" = all ]; then
  for s in check router layer engine; do step "$s"; done
else
  step "${1:-check}"
fi
