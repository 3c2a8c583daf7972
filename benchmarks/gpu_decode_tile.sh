#!/usr/bin/env bash
# The decode tile's variants on one GPU, in one call (a fresh machine: every kernel compiles in
# it): native kernel tests, B1's decode attention replayed per variant and cache dtype, then B1
# itself (bench_offline.py, the first timed call) with the variant that replayed fastest for each
# dtype (the engine's defaults where those won). One log per step under $OUT. Steps (STEPS):
#   tests       the attention/store kernels natively against the torch reference
#   attn_fp8 / attn_bf16   bench_b1_attention.py over FP8_VARIANTS / BF16_VARIANTS; OLD_KERNELS=FILE
#               adds a copy of kernels/triton_attn.py to both (an A/B of a kernel change)
#   b1_fp8 / b1_bf16       B1 with the fastest replayed variant of this call (--attn-constants);
#               skipped where the engine's default replayed fastest, unless B1_DEFAULTS=1
#   b1_fp8_qq / b1_fp8_default   B1 over an fp8 cache with the fp8 tensor-core tile
#               (DECODE_FP8_QUERY_QUANT) / with the engine's defaults, whatever replayed fastest
#   b8          the Qwen3-8B shape, bf16 against fp8 weights + fp8 KV (bench_fp8.py b1-8b; not in
#               the default STEPS)
#   ncu         Nsight Compute over one warm decode launch of a B1-sized batch per cache dtype
#               (benchmarks/ncu_decode.py): occupancy, warp stall reasons, memory throughput;
#               ncu_fp8 the fp8 cache's alone
#
#   bash benchmarks/gpu_decode_tile.sh
#   STEPS="tests b1_fp8 b1_bf16" bash benchmarks/gpu_decode_tile.sh     # the engine's defaults
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_decode_tile}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"tests attn_fp8 attn_bf16 b1_fp8 b1_bf16"}
EVERY=${EVERY:-128}
FP8_VARIANTS=${FP8_VARIANTS:-base,f8vkm,f8vkm_r168,f8vkm64_r128,f8vkm128w8_r128,f8n64_r128}
BF16_VARIANTS=${BF16_VARIANTS:-base,n64s2_r128,n64s3_r128}
TESTS=${TESTS:-"tests/test_decode_tiles.py tests/test_fp8_kv_kernels.py tests/test_triton_attn.py tests/test_triton_ops.py"}
KERNELS=${OLD_KERNELS:+--kernels old=$OLD_KERNELS}
PROFILE=${PROFILE---profile}  # PROFILE= for B1 without its per-kernel profile run
# shared-memory wavefronts and bank conflicts, instructions, and each stall reason (cycles per instruction)
NCU_METRICS=${NCU_METRICS:-l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__inst_executed.sum,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio}

source benchmarks/gpu_run_step.sh

b1() {  # name, attn log, kv_cache_dtype, bench_offline arguments...
  local name=$1 constants
  constants=$(best "$2" "$3")
  shift 3
  if [ "$constants" = "{}" ] && [ -f "$OUT/$2.log" ] && [ -z "$B1_DEFAULTS" ]; then
    echo "=== $name: skipped (the engine's default replayed fastest)"
  else
    run_step "$name" 90 python3 benchmarks/bench_offline.py "$@" $PROFILE --attn-constants "$constants"
  fi
}

ncu_step() {  # kv_cache_dtype (NCU_CONSTANTS: triton_attn constants for ncu_decode.py, e.g. another tile)
  local ncu
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  run_step "ncu_$1" 60 "$ncu" --clock-control none -k regex:_unified_attention_kernel --launch-skip 1 \
    --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --metrics "$NCU_METRICS" \
    python3 benchmarks/ncu_decode.py --kv-cache-dtype "$1" --attn-constants "${NCU_CONSTANTS:-{\}}"
}

best() {  # attn log, kv_cache_dtype: the constants of the fastest replayed variant ({} if none ran)
  [ -f "$OUT/$1.log" ] && python3 benchmarks/bench_b1_attention.py --best "$OUT/$1.log" \
    --kv-cache-dtype "$2" 2>/dev/null || echo "{}"
}

for step in $STEPS; do
  case $step in
    tests) run_step tests "${TESTS_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -n 8 $TESTS ;;
    attn_fp8) run_step attn_fp8 "${ATTN_LIMIT:-110}" python3 benchmarks/bench_b1_attention.py --every "$EVERY" \
              --kv-cache-dtype fp8 --variants "$FP8_VARIANTS" $KERNELS ;;
    attn_bf16) run_step attn_bf16 60 python3 benchmarks/bench_b1_attention.py --every "$EVERY" \
               --kv-cache-dtype auto --variants "$BF16_VARIANTS" $KERNELS ;;
    b1_fp8) b1 b1_fp8 attn_fp8 fp8 --kv-cache-dtype fp8 ;;
    b1_bf16) b1 b1_bf16 attn_bf16 auto ;;
    b1_fp8_qq) run_step b1_fp8_qq 90 python3 benchmarks/bench_offline.py --kv-cache-dtype fp8 $PROFILE \
               --attn-constants '{"DECODE_FP8_QUERY_QUANT": true}' ;;
    b1_fp8_default) run_step b1_fp8_default 90 python3 benchmarks/bench_offline.py --kv-cache-dtype fp8 $PROFILE ;;
    b8) run_step b8 "${B8_LIMIT:-150}" python3 benchmarks/bench_fp8.py b1-8b ;;
    ncu) ncu_step fp8; ncu_step auto ;;
    ncu_fp8) ncu_step fp8 ;;
    *) echo "unknown step $step" ;;
  esac
done
