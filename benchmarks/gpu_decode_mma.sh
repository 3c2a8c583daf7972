#!/usr/bin/env bash
# gluon_decode_mma (fp8 decode attention, K and V fed from registers to the tensor cores) on one GPU:
# its tests natively, B1's fp8 decode attention replayed for the Qwen3-0.6B and Qwen3-8B shapes (the
# Gluon kernel's tile and split variants against the kernels it replaces: triton_decode_fma for groups
# of 2, the fp8 decode tile for groups of 4), then B1 end to end through the public API with it on and
# off. One log per step under $OUT. Steps (STEPS, in order):
#   tests     tests/test_gluon_decode_mma.py (the kernel switched on against the torch reference) and its fused
#             RoPE against the separate RoPE kernel (tests/test_triton_attn.py -k gluon)
#   attn      bench_b1_attention.py over VARIANTS (split policies: programs a multiprocessor, keys a split;
#             loads two tiles ahead),
#             --shape 0.6b then 8b
#   b1        B1 with an fp8 cache (bench_offline.py), kernel on, off, on (first timed call each)
#   b8        the Qwen3-8B shape, bf16 against fp8 weights + fp8 KV (bench_fp8.py b1-8b), kernel on
#   attn_bf16 / b1_bf16   the same over a bf16 cache (DECODE_MMA_16BIT against the bf16 decode tile)
#   long      one 32k-token sequence's decode (bench_long_context.py, bf16 cache) with the kernel: its own
#             split sweep under two split policies (1-warp programs want more splits than the tile)
#
# All steps together: about 15 minutes by their time limits (not yet run); split them over calls where one is
# limited (e.g. STEPS="tests attn", then STEPS="b1 b8", then STEPS="attn_bf16 b1_bf16 long").
#
#   bash benchmarks/gpu_decode_mma.sh
#   STEPS="b1 b8" MMA='{"DECODE_MMA_FP8": true, "DECODE_MMA_PREFETCH": 2}' bash benchmarks/gpu_decode_mma.sh
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_decode_mma}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"tests attn b1 b8"}
EVERY=${EVERY:-128}
MMA=${MMA:-'{"DECODE_MMA_FP8": true}'}   # the triton_attn constants B1 runs with "on"
VARIANT_JSON='{"old": {}, "mma": {"DECODE_MMA_FP8": true},
  "mma8": {"DECODE_MMA_FP8": true, "DECODE_MMA_PROGRAMS_PER_SM": 8},
  "mma32": {"DECODE_MMA_FP8": true, "DECODE_MMA_PROGRAMS_PER_SM": 32},
  "mma_k256": {"DECODE_MMA_FP8": true, "MIN_KEYS_PER_SPLIT": 256, "DECODE_MMA_MAX_SPLITS": 64},
  "mma_p2": {"DECODE_MMA_FP8": true, "DECODE_MMA_PREFETCH": 2}, "mma8_p2": {"DECODE_MMA_FP8": true,
  "DECODE_MMA_PREFETCH": 2, "DECODE_MMA_PROGRAMS_PER_SM": 8}}'
VARIANTS=${VARIANTS:-old,mma,mma8,mma32,mma_k256,mma_p2,mma8_p2}
BF16_JSON='{"old": {}, "mma": {"DECODE_MMA_16BIT": true}, "mma8": {"DECODE_MMA_16BIT": true, "DECODE_MMA_PROGRAMS_PER_SM": 8},
  "mma32": {"DECODE_MMA_16BIT": true, "DECODE_MMA_PROGRAMS_PER_SM": 32}}'

source benchmarks/gpu_run_step.sh

for step in $STEPS; do
  case $step in
    tests) run_step tests 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_gluon_decode_mma.py \
             tests/test_triton_attn.py -k gluon ;;
    attn) for shape in 0.6b 8b; do
            run_step "attn_$shape" 170 python3 benchmarks/bench_b1_attention.py --shape "$shape" --every "$EVERY" \
              --kv-cache-dtype fp8 --variants "$VARIANTS" --extra-variants "$VARIANT_JSON"
          done ;;
    b1) run_step b1_on 90 python3 benchmarks/bench_offline.py --kv-cache-dtype fp8 --attn-constants "$MMA"
        run_step b1_off 90 python3 benchmarks/bench_offline.py --kv-cache-dtype fp8
        run_step b1_on2 90 python3 benchmarks/bench_offline.py --kv-cache-dtype fp8 --attn-constants "$MMA" ;;
    b8) run_step b8 200 python3 benchmarks/bench_fp8.py b1-8b --attn-constants "$MMA" ;;
    long) run_step long 240 python3 benchmarks/bench_long_context.py --splits 32,64,128,256,0 --sweep-constants \
            '[{}, {"DECODE_MMA_16BIT": true}, {"DECODE_MMA_16BIT": true, "DECODE_MMA_MAX_SPLITS": 256, "MIN_KEYS_PER_SPLIT": 128}]' \
            --attn-constants '{"DECODE_MMA_16BIT": true, "DECODE_MMA_MAX_SPLITS": 256, "MIN_KEYS_PER_SPLIT": 128}' ;;
    attn_bf16) run_step attn_bf16 170 python3 benchmarks/bench_b1_attention.py --every "$EVERY" \
                 --kv-cache-dtype auto --variants old,mma,mma8,mma32 --extra-variants "$BF16_JSON" ;;
    b1_bf16) run_step b1_bf16_on 90 python3 benchmarks/bench_offline.py --attn-constants '{"DECODE_MMA_16BIT": true}'
             run_step b1_bf16_off 90 python3 benchmarks/bench_offline.py ;;
    *) echo "unknown step $step" ;;
  esac
done
