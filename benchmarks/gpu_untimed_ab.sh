#!/usr/bin/env bash
# A/Bs of the twenty-fourth and twenty-fifth sessions' prefill and decode changes against the engine's
# defaults, on one GPU: the prefill grid's order (triton_attn.QUERY_TILES_OUTER) and the softmax scale in the
# exponent (SOFTMAX_SCALE_IN_EXP), both off until timed here,
# the TMA prefill kernel (kernels/triton_prefill_tma.py, off), the prefill split target
# (triton_attn.PREFILL_TARGET_PROGRAMS_PER_SM, 1 since its A/B here) and the decode kernels with the q/k norm +
# RoPE + K/V store fused in (triton_attn.DECODE_FUSED_ROPE, on since its A/B here; RESULTS.md "Twenty-fifth
# session"). One command may run 10 minutes on the device: three calls of ~5-7 minutes on a fresh H200,
# STEPS="kernels tests", STEPS=ttft, STEPS=b1. One log per step under $OUT. Steps (STEPS):
#   tests     the TMA kernel's, the fused RoPE's, the grid order's and the scale's kernel tests natively,
#             the fused RoPE through the engine against the separate RoPE kernel (the whole GPU suite:
#             gpu_suite.sh)
#   kernels   bench_prefill_attention.py: one 8k chunk of a 32k prompt (the first and the last), gather
#             kernel at its policy's split count and unsplit, QUERY_TILES_OUTER and SOFTMAX_SCALE_IN_EXP off and on,
#             TMA kernel per tile, pages of 16, 64 and 128
#             (the 128-key TMA tiles, which compile with no spill in their loop, need pages of 128)
#   ttft      bench_long_context.py, the 32k prompt through the public API (TTFT, decode), eight ways:
#             defaults (pages of 16, gather, prefill unsplit, fused RoPE); the prefill's query tiles
#             heaviest first across KV heads (QUERY_TILES_OUTER, off); the scale in the exponent
#             (SOFTMAX_SCALE_IN_EXP, off); both; prefill split by the decode target
#             (PREFILL_TARGET_PROGRAMS_PER_SM 8); pages of 64 with the TMA kernel; pages of 64 without;
#             the RoPE kernel apart (its decode tok/s against the defaults')
#   b1        bench_offline.py (B1, no tokenizer: A/Bs, not the goals' figures): bf16 with the defaults and
#             with the scale in the exponent (the decode tile's loop 634 instructions against 648),
#             with pages of 64 and the TMA kernel (what a larger default page would cost or give) and with
#             the RoPE kernel apart; an fp8 cache with and without the fused RoPE (triton_decode_fma's)
#
# TTFT_VARIANTS and B1_VARIANTS (names apart by spaces) choose a subset of each step's variants.
#
#   STEPS="kernels tests" bash benchmarks/gpu_untimed_ab.sh
#   STEPS=ttft bash benchmarks/gpu_untimed_ab.sh
#   STEPS=b1 bash benchmarks/gpu_untimed_ab.sh
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_untimed_ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"kernels tests ttft b1"}
TMA='"triton_prefill_tma.ENABLED":true'
VARIANTS=(  # name, then arguments
  "default|"
  "split8|--attn-constants {\"PREFILL_TARGET_PROGRAMS_PER_SM\":8}"
  "tma64|--kvcache-block-size 64 --attn-constants {$TMA}"
  "gather64|--kvcache-block-size 64"
  "unfused|--attn-constants {\"DECODE_FUSED_ROPE\":false}"
  "qouter|--attn-constants {\"QUERY_TILES_OUTER\":true}"
  "scaleexp|--attn-constants {\"SOFTMAX_SCALE_IN_EXP\":true}"
  "both|--attn-constants {\"QUERY_TILES_OUTER\":true,\"SOFTMAX_SCALE_IN_EXP\":true}"
  "fp8|--kv-cache-dtype fp8"
  "fp8unfused|--kv-cache-dtype fp8 --attn-constants {\"DECODE_FUSED_ROPE\":false}"
  "fp8scaleexp|--kv-cache-dtype fp8 --attn-constants {\"SOFTMAX_SCALE_IN_EXP\":true}"
)
# shellcheck disable=SC2206  # the variant lists may come from the environment, names apart by spaces
TTFT_VARIANTS=(${TTFT_VARIANTS:-default qouter scaleexp both split8 tma64 gather64 unfused})
# shellcheck disable=SC2206
B1_VARIANTS=(${B1_VARIANTS:-default scaleexp tma64 unfused fp8 fp8unfused fp8scaleexp})

run_step() {  # name, time limit (s), command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit} s): $*"
  timeout "$limit" "$@" 2>&1 | grep -v "Warning\|it/s" | tee "$OUT/$name.log"
}

variant_args() {  # the arguments of variant $1
  local v
  for v in "${VARIANTS[@]}"; do
    [ "${v%%|*}" = "$1" ] && echo "${v#*|}" && return
  done
}

for step in $STEPS; do
  case $step in
    tests) run_step tests 300 python3 -m pytest -q -x -n 8 tests/test_triton_attn.py tests/test_fused_rope_gpu.py \
             -k "tma or fused_rope or last_key or split_target or query_tiles_outer or scale_in_exp" ;;
    kernels) run_step kernels 560 python3 benchmarks/bench_prefill_attention.py --block-sizes 16,64,128 ;;
    ttft)
      for name in "${TTFT_VARIANTS[@]}"; do
        # shellcheck disable=SC2046  # each variant is a list of arguments
        run_step "ttft_$name" 150 python3 benchmarks/bench_long_context.py --splits '' $(variant_args "$name")
      done ;;
    b1)
      for name in "${B1_VARIANTS[@]}"; do
        # shellcheck disable=SC2046
        run_step "b1_$name" 150 python3 benchmarks/bench_offline.py $(variant_args "$name")
      done ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
