#!/usr/bin/env bash
# Issue 50's CPU measurements in one prepared run, for the machine its goals are judged on (an Intel
# Xeon with AMX; any x86-64 CPU runs it and says what it lacks). Each step writes its JSON under
# benchmarks/results/ with the tag ($CPU_TAG, default: "amx" where the CPU has AMX-BF16 tiles, else
# "avx512" / "avx2") in the name, and its table to $OUT/<step>.log; one step at a time holds
# /tmp/expertd-bench.lock, so nothing else on the machine runs beside a timed call.
#
#   bash benchmarks/cpu_session.sh env     # the CPU, its flags, the native library's level and AMX probe
#   bash benchmarks/cpu_session.sh kernel  # native_cpu_kernel.py at 1-256 rows, bf16, --isa-ab: the AMX
#                                          # tiles against AVX-512 and AVX2 on the same calls
#   bash benchmarks/cpu_session.sh peers   # cpu_peers.py --rounds 3: expertd against vLLM CPU (AMX),
#                                          # kt-kernel (AMXBF16_MOE), transformers and the floor, Qwen3-30B-A3B
#                                          # and gpt-oss-20b sizes, T 1-1024 (needs make install-vllm
#                                          # install-kt; about 15 minutes on 2 vCPUs)
#   bash benchmarks/cpu_session.sh int8    # moe_layer_int8.py: INT8 against bf16, each against its read floor
#   bash benchmarks/cpu_session.sh load    # load.py --experts 32: FP8 -> INT8 at load against the read
#   bash benchmarks/cpu_session.sh fused   # fused_glu.py: gate, up and the activation in one call against
#                                          # the unfused calls, bf16 and INT8
#   bash benchmarks/cpu_session.sh all     # the six in that order
#   QUICK=1 bash benchmarks/cpu_session.sh all   # each step cut down to prove the script on any machine
#                                                # (its files tagged "_quick")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/expertd-cpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-.venv/bin/python}
QUICK=${QUICK:-}
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
if [[ $flags == *amx_bf16* ]]; then default_tag=amx
elif [[ $flags == *avx512f* ]]; then default_tag=avx512
else default_tag=avx2; fi
TAG=${CPU_TAG:-$default_tag}${QUICK:+_quick}
RESULTS=benchmarks/results

timed() {  # timed NAME COMMAND...: run under the bench lock, the output to $OUT/NAME.log and the terminal
  local name=$1; shift
  echo "== $name: $*"
  flock /tmp/expertd-bench.lock "$@" 2>&1 | tee "$OUT/$name.log"
  return "${PIPESTATUS[0]}"
}

step_env() {
  {
    grep -m1 'model name' /proc/cpuinfo
    echo "vCPUs $(nproc); SIMD flags: $(tr ' ' '\n' <<<"$flags" | grep -E '^(avx2|avx512f|avx512_bf16|amx_bf16|amx_tile|amx_int8)$' | tr '\n' ' ')"
    $PY -m expertd.kernels.cpu
    $PY -c "from expertd.kernels import cpu; print('native CPU kernel:', cpu.describe())"
  } 2>&1 | tee "$OUT/env.log"
}

step_kernel() {
  local rows=(1 4 16 64 256)
  [[ -n $QUICK ]] && rows=(1 16)
  timed kernel "$PY" benchmarks/native_cpu_kernel.py --rows "${rows[@]}" --experts 64 --dtypes bfloat16 --isa-ab \
    --out "$RESULTS/native_cpu_kernel_$TAG.json"
}

step_peers() {
  local args=(--rounds 3)
  [[ -n $QUICK ]] && args=(--rounds 1 --shapes qwen3 --tokens 1,16)
  timed peers "$PY" benchmarks/cpu_peers.py "${args[@]}" --out "$RESULTS/cpu_peers_$TAG.json"
}

step_int8() {
  local args=(--shapes qwen3,gptoss --tokens 1,16,64,256,1024 --rounds 3)
  [[ -n $QUICK ]] && args=(--shapes qwen3 --tokens 1,16 --rounds 1)
  timed int8 "$PY" benchmarks/moe_layer_int8.py "${args[@]}" --out "$RESULTS/moe_layer_int8_$TAG.json"
}

step_load() {
  local args=(--experts 32 --rounds 3)
  [[ -n $QUICK ]] && args=(--quick --rounds 1)
  timed load "$PY" benchmarks/load.py "${args[@]}" --out "$RESULTS/load_$TAG.json"
}

step_fused() {
  local args=(--rounds 3)
  [[ -n $QUICK ]] && args=(--shapes qwen3 --weights bf16 --tokens 1,64 --rounds 1)
  timed fused "$PY" benchmarks/fused_glu.py "${args[@]}" --out "$RESULTS/fused_glu_$TAG.json"
}

case "${1:-all}" in
  env) step_env ;;
  kernel) step_kernel ;;
  peers) step_peers ;;
  int8) step_int8 ;;
  load) step_load ;;
  fused) step_fused ;;
  all)
    rc=0
    for step in env kernel peers int8 load fused; do
      "step_$step" || { echo "step $step failed (rc $?)"; rc=1; }
    done
    echo "logs in $OUT; results in $RESULTS/*_$TAG*.json"
    exit $rc ;;
  *) echo "usage: $0 env|kernel|peers|int8|load|fused|all" >&2; exit 2 ;;
esac
