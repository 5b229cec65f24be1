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
#   bash benchmarks/gpu_session.sh serving  # benchmarks/serving.py --models mid: the real server and
#                                           # client over loopback, the engine on the GPU
#                                           # (SERVING_PLATFORMS=cpu: on the host's cores); needs the
#                                           # gRPC family: .whl below; SERVING_ARGS=--native: on the
#                                           # native Forward port, where .native-front is carried)
#   bash benchmarks/gpu_session.sh tiles    # benchmarks/pallas_tiles.py: the Pallas grouped GEMM's
#                                           # tilings per shape (TILES_ARGS=--quick: a short grid)
#   bash benchmarks/gpu_session.sh semantics  # gpu_check.py's semantic families (issue 25; or those in
#                                           # SEMANTICS_FAMILIES), split over SEMANTICS_JOBS (3)
#                                           # processes at once (SEMANTICS_ARGS=--quick: the smaller
#                                           # point); one summary line
#   bash benchmarks/gpu_session.sh floor    # benchmarks/python_floor.py (expertd, bare, bare-batched;
#                                           # the engine on the host's CPU): the thin hop on its cores;
#                                           # expertd-native(-queued) and native-echo too where
#                                           # .native-front is carried (made by
#                                           # benchmarks/native_front_carry.sh);
#                                           # FLOOR_ARGS="--load-processes 4": the 64 callers
#                                           # over four load processes; "--cpu-latency-qos ab"
#                                           # (root): idle CPUs halting and polling
#   bash benchmarks/gpu_session.sh shapes   # benchmarks/batch_shapes.py: how 64 callers are cut into
#                                           # steps on each port, the engine on the GPU
#                                           # (SHAPES_PLATFORMS=cpu: the host's cores), with and
#                                           # without the batcher's queue delay (SHAPES_ARGS)
#   bash benchmarks/gpu_session.sh tokamax  # benchmarks/tokamax_layer.py: the tokamax backend (and
#                                           # FP8 weights through it and pallas) against the oracle,
#                                           # then the layer at issue 52's shapes for tokamax, pallas,
#                                           # ragged_dot and auto beside the dense bf16 matmul and the
#                                           # weight-read floor; needs tokamax's wheels in .whl
#                                           # (benchmarks/tokamax_carry.sh; carry .whl); under 8
#                                           # minutes (TOKAMAX_TIMEOUT 470 s, --budget-s 360 inside)
#   bash benchmarks/gpu_session.sh all      # all four (over 10 minutes: one call does not fit)
#   bash benchmarks/gpu_session.sh brief    # all six, cut to fit one call of a 15-minute lease
#                                           # (check --quick, router --quick, the bf16 layer at
#                                           # T 16 / 4096 with auto, ragged_dot and pallas, 5 engine
#                                           # rounds, serving --duration 1.5, tiles --quick; under
#                                           # 10 minutes by the steps' limits; carry .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/expertd-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

setup() {
  local site
  site=$(mktemp -d)
  # The server's gRPC family is not on the machine's image: carry it as wheels (the device tool's
  # `carry: [".whl"]`), fetched here with pip download for cp312 manylinux (pyproject's pins:
  # grpcio, grpcio-status, grpcio-health-checking, grpcio-reflection, protobuf, googleapis-common-protos;
  # uvloop too, or the server runs on asyncio's own loop: --event-loop auto falls back).
  if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
      || echo "gpu_session: the wheels in .whl did not install for $($PY -V); the server's steps may fail" >&2
  fi
  # The native Forward port cannot be built there (no libgrpc++, no network): carry `.native-front`,
  # its module built for Python 3.12 and Debian's gRPC C++ libraries (benchmarks/native_front_carry.sh).
  if [ -d .native-front/cache/native_front ]; then
    mkdir -p ~/.cache/expertd && cp -r .native-front/cache/native_front ~/.cache/expertd/
    export LD_LIBRARY_PATH="$PWD/.native-front/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  mkdir -p "$site/expertd"
  for pkg in kernels server client; do ln -sfn "$PWD/$pkg" "$site/expertd/$pkg"; done
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  { nvidia-smi; $PY -c 'import sys, jax, expertd.kernels.moe; print(sys.version); print(jax.__version__, jax.devices())'; } \
    > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
}

step() {
  case "$1" in
    check) timeout "${CHECK_TIMEOUT:-420}" $PY benchmarks/gpu_check.py ${GPU_CHECK_ARGS:-} --out "$OUT/gpu_check.json" 2>&1 \
             | tee "$OUT/gpu_check.log" ;;
    router) timeout "${ROUTER_TIMEOUT:-300}" $PY benchmarks/router.py ${ROUTER_ARGS:-} 2>&1 | tee "$OUT/router.log"
            cp benchmarks/results/router.json "$OUT/router_gpu.json" ;;
    layer) timeout "${LAYER_TIMEOUT:-540}" $PY benchmarks/moe_layer.py --no-hf ${LAYER_ARGS:-} --out "$OUT/moe_layer_gpu.json" 2>&1 | tee "$OUT/moe_layer.log" ;;
    engine) timeout "${ENGINE_TIMEOUT:-300}" $PY benchmarks/engine_step.py ${ENGINE_STEP_ARGS:-} --out "$OUT/engine_step_gpu.json" 2>&1 \
              | tee "$OUT/engine_step.log" ;;
    serving) JAX_PLATFORMS=${SERVING_PLATFORMS:-cuda} timeout "${SERVING_TIMEOUT:-300}" $PY benchmarks/serving.py \
               --models mid ${SERVING_ARGS:-} \
               --out "$OUT/serving_gpu.json" 2>&1 | tee "$OUT/serving.log" ;;
    tiles) timeout "${TILES_TIMEOUT:-540}" $PY benchmarks/pallas_tiles.py ${TILES_ARGS:-} --out "$OUT/pallas_tiles.json" \
             2>&1 | tee "$OUT/pallas_tiles.log" ;;
    tokamax) XLA_PYTHON_CLIENT_MEM_FRACTION=${TOKAMAX_MEM_FRACTION:-.9} timeout "${TOKAMAX_TIMEOUT:-470}" \
               $PY benchmarks/tokamax_layer.py ${TOKAMAX_ARGS:---budget-s 360} --out "$OUT/tokamax_layer_gpu.json" 2>&1 \
               | tee "$OUT/tokamax_layer.log" ;;
    semantics) semantics ;;
    shapes) JAX_PLATFORMS=${SHAPES_PLATFORMS:-cuda} timeout "${SHAPES_TIMEOUT:-300}" $PY benchmarks/batch_shapes.py \
              ${SHAPES_ARGS:---ports main,native --max-queue-delay-ms 2,0 --rounds 2 --duration 2} \
              --out "$OUT/batch_shapes_gpu.json" 2>&1 | tee "$OUT/batch_shapes.log" ;;
    floor) local servers=expertd,bare,bare-batched
           [ -d .native-front ] && servers+=,expertd-native,expertd-native-queued,native-echo
           timeout "${FLOOR_TIMEOUT:-420}" $PY benchmarks/python_floor.py --servers "$servers" \
             ${FLOOR_ARGS:-} --out "$OUT/python_floor_gpu_host.json" 2>&1 | tee "$OUT/python_floor.log" ;;
    *) echo "unknown step $1 (check | router | layer | engine | serving | tiles | tokamax | semantics | floor | shapes |"\
            "all | brief)"
       return 2 ;;
  esac
}

# The semantic families' oracle check, SEMANTICS_JOBS processes at once (compiling is the host's
# work; the GPU's memory is allocated as needed, not preallocated by each process).
semantics() {
  local families jobs=${SEMANTICS_JOBS:-3} i pids=() status=0
  families=${SEMANTICS_FAMILIES:-$($PY -c 'from expertd.kernels import moe_reference
print(" ".join(moe_reference.SEMANTIC_FAMILIES))')}
  read -ra families <<< "$families"
  for ((i = 0; i < jobs; i++)); do
    local mine=() j
    for ((j = i; j < ${#families[@]}; j += jobs)); do mine+=("${families[j]}"); done
    [ ${#mine[@]} -eq 0 ] && continue
    (IFS=,; XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${SEMANTICS_TIMEOUT:-420}" $PY benchmarks/gpu_check.py \
       --families "${mine[*]}" ${SEMANTICS_ARGS:-} --out "$OUT/gpu_check_semantics_$i.json" \
       > "$OUT/gpu_check_semantics_$i.log" 2>&1) &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i" || status=1; done
  cat "$OUT"/gpu_check_semantics_*.log
  $PY - "$OUT" <<'PYEOF'
import glob, json, sys
rows = [r for f in sorted(glob.glob(sys.argv[1] + "/gpu_check_semantics_*.json")) for r in json.load(open(f))["rows"]]
bad = [r for r in rows if not r["ok"]]
print(f"semantics: {len(rows) - len(bad)} of {len(rows)} cases within tolerance")
for r in bad:
    print("  failed:", {k: r.get(k) for k in ("kind", "family", "dtype", "backend", "err_per_scale", "error")})
PYEOF
  return $status
}

setup
if [ "${1:-check}" = all ]; then
  for s in check router layer engine serving; do step "$s"; done
elif [ "$1" = brief ]; then  # the step limits add up to 590 s: one device call of at most 10 minutes
  GPU_CHECK_ARGS=--quick CHECK_TIMEOUT=120 step check
  ROUTER_ARGS=--quick ROUTER_TIMEOUT=60 step router
  LAYER_ARGS="--dtypes bfloat16 --tokens 16 4096 --backends auto ragged_dot pallas" LAYER_TIMEOUT=200 step layer
  ENGINE_STEP_ARGS="--rounds 5 --calls 10" ENGINE_TIMEOUT=40 step engine
  SERVING_ARGS="--duration 1.5" SERVING_TIMEOUT=90 step serving
  TILES_ARGS="--quick" TILES_TIMEOUT=80 step tiles
  # thirteen files: one archive, as the device tool brings back eight files at most
  (cd "$OUT" && tar czf gpu_brief.tgz --exclude gpu_brief.tgz ./* && find . -type f ! -name gpu_brief.tgz -delete)
elif [ $# -gt 1 ]; then  # several steps: one archive, as the device tool brings back eight files at most
  for s in "$@"; do step "$s"; done
  (cd "$OUT" && tar czf gpu_steps.tgz --exclude gpu_steps.tgz ./* && find . -type f ! -name gpu_steps.tgz -delete)
else
  step "${1:-check}"
fi
