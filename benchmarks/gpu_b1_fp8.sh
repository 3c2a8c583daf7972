#!/usr/bin/env bash
# B1 with an fp8 KV cache beside bf16, in one call on one GPU (a fresh machine: every Triton
# kernel compiles in it). One log per step under $OUT. Steps (STEPS, in order):
#   tests      the fp8/bf16 attention kernels natively against the torch reference, the fp8
#              engine tests, no Triton variant compiled after start-up
#   attn_fp8   B1's decode attention replayed over an fp8 cache (bench_b1_attention.py): the
#              engine's default decode tile and the FP8_VARIANTS; OLD_KERNELS=FILE adds a copy
#              of kernels/triton_attn.py (an A/B of a kernel change)
#   attn_bf16  the same over a bf16 cache, BF16_VARIANTS
#   b1_fp8 / b1_bf16   B1 (bench_offline.py, the first timed call) with the engine's defaults,
#              with a per-kernel profile of a later run
#   b1_fp8_best / b1_bf16_best   B1 with the decode tile that replayed fastest in attn_* of this
#              call (--attn-constants); skipped where that is the default or attn_* did not run
#   b8         the Qwen3-8B shape, bf16 against fp8 weights + fp8 KV (bench_fp8.py b1-8b)
#
#   OLD_KERNELS=/path/to/triton_attn_before.py bash benchmarks/gpu_b1_fp8.sh
#   STEPS="tests b1_fp8 b1_bf16 b8" bash benchmarks/gpu_b1_fp8.sh     # the engine's defaults only
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_b1_fp8}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"tests attn_fp8 b1_fp8 b1_fp8_best attn_bf16 b1_bf16 b1_bf16_best b8"}
FP8_VARIANTS=${FP8_VARIANTS:-base,f8n64s5,f8n64s7,f8n128s5,f8n64w2s5,f8n32w2s8}
BF16_VARIANTS=${BF16_VARIANTS:-base,n128s2}
KERNELS=${OLD_KERNELS:+--kernels old=$OLD_KERNELS}

run_step() {  # name, time limit (s), command...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name (limit ${limit} s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}

best() {  # the constants of the fastest replayed variant for a cache dtype ({} if none ran)
  [ -f "$OUT/attn_$1.log" ] && python3 benchmarks/bench_b1_attention.py --best "$OUT/attn_$1.log" \
    --kv-cache-dtype "$2" 2>/dev/null || echo "{}"
}

b1_best() {  # name, cache dtype option, bench_offline arguments...
  local name=$1 dtype=$2 constants
  shift 2
  constants=$(best "$dtype" "$([ "$dtype" = bf16 ] && echo auto || echo "$dtype")")
  if [ "$constants" = "{}" ]; then
    echo "=== $name: skipped (the default tile replayed fastest, or attn_$dtype did not run)"
  else
    run_step "$name" 80 python3 benchmarks/bench_offline.py "$@" --attn-constants "$constants"
  fi
}

for step in $STEPS; do
  case $step in
    tests) run_step tests 90 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_fp8_kv_kernels.py \
           tests/test_fp8_gpu.py tests/test_warmup_gpu.py ;;
    attn_fp8) run_step attn_fp8 90 python3 benchmarks/bench_b1_attention.py --every 64 --kv-cache-dtype fp8 \
              --variants "$FP8_VARIANTS" $KERNELS ;;
    attn_bf16) run_step attn_bf16 60 python3 benchmarks/bench_b1_attention.py --every 64 --kv-cache-dtype auto \
               --variants "$BF16_VARIANTS" ;;
    b1_fp8) run_step b1_fp8 90 python3 benchmarks/bench_offline.py --kv-cache-dtype fp8 --profile ;;
    b1_bf16) run_step b1_bf16 90 python3 benchmarks/bench_offline.py --profile ;;
    b1_fp8_best) b1_best b1_fp8_best fp8 --kv-cache-dtype fp8 ;;
    b1_bf16_best) b1_best b1_bf16_best bf16 ;;
    b8) run_step b8 "${B8_LIMIT:-150}" python3 benchmarks/bench_fp8.py b1-8b ;;
    *) echo "unknown step $step" ;;
  esac
done
