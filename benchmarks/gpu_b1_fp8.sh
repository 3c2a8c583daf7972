#!/usr/bin/env bash
# B1 with an fp8 KV cache beside bf16, in one call on one GPU (a fresh machine: every Triton
# kernel compiles in it). One log per step under $OUT. Steps (STEPS, in order):
#   tests      the fp8/bf16 attention kernels natively against the torch reference, the fp8
#              engine tests, no Triton variant compiled after start-up
#   attn_fp8   B1's decode attention replayed over an fp8 cache (bench_b1_attention.py): the
#              engine's default decode tile and the FP8_VARIANTS; OLD_KERNELS=FILE adds a copy
#              of kernels/triton_attn.py (an A/B of a kernel change)
#   attn_bf16  the same over a bf16 cache, BF16_VARIANTS
#   b1_fp8_best / b1_bf16_best   B1 (bench_offline.py, the first timed call) with the decode tile
#              that replayed fastest above (--attn-constants), with a per-kernel profile
#   b1_fp8 / b1_bf16   B1 with the engine's defaults (skipped where the best is the default)
#   b8         the Qwen3-8B shape, bf16 against fp8 weights + fp8 KV (bench_fp8.py b1-8b)
#
#   OLD_KERNELS=/path/to/triton_attn_before.py bash benchmarks/gpu_b1_fp8.sh
#   STEPS="b1_fp8 b1_bf16" bash benchmarks/gpu_b1_fp8.sh
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_b1_fp8}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"tests attn_fp8 b1_fp8_best b1_fp8 attn_bf16 b1_bf16_best b1_bf16 b8"}
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

for step in $STEPS; do
  case $step in
    tests) run_step tests 90 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_fp8_kv_kernels.py \
           tests/test_fp8_gpu.py tests/test_warmup_gpu.py ;;
    attn_fp8) run_step attn_fp8 90 python3 benchmarks/bench_b1_attention.py --every 64 --kv-cache-dtype fp8 \
              --variants "$FP8_VARIANTS" $KERNELS ;;
    attn_bf16) run_step attn_bf16 60 python3 benchmarks/bench_b1_attention.py --every 64 --kv-cache-dtype auto \
               --variants "$BF16_VARIANTS" ;;
    b1_fp8_best) run_step b1_fp8_best 90 python3 benchmarks/bench_offline.py --kv-cache-dtype fp8 --profile \
                 --attn-constants "$(best fp8 fp8)" ;;
    b1_bf16_best) run_step b1_bf16_best 90 python3 benchmarks/bench_offline.py --profile \
                  --attn-constants "$(best bf16 auto)" ;;
    b1_fp8) [ "$(best fp8 fp8)" = "{}" ] && echo "=== b1_fp8: the default is the best (b1_fp8_best)" \
            || run_step b1_fp8 80 python3 benchmarks/bench_offline.py --kv-cache-dtype fp8 ;;
    b1_bf16) [ "$(best bf16 auto)" = "{}" ] && echo "=== b1_bf16: the default is the best (b1_bf16_best)" \
             || run_step b1_bf16 80 python3 benchmarks/bench_offline.py ;;
    b8) run_step b8 "${B8_LIMIT:-150}" python3 benchmarks/bench_fp8.py b1-8b ;;
    *) echo "unknown step $step" ;;
  esac
done
