#!/usr/bin/env bash
# A long prompt's prefill on one GPU (two device calls of ~5 minutes each on a fresh H200, one command's
# limit being 10 minutes: STEPS="tests kernels", then STEPS="ttft b1"): the TMA prefill
# kernel (kernels/triton_prefill_tma.py, off by default until this has run) and the prefill split
# target (triton_attn.PREFILL_TARGET_PROGRAMS_PER_SM) against the engine's defaults. One log per
# step under $OUT. Steps (STEPS):
#   tests     the attention kernels natively against the torch reference (the TMA kernel included)
#   kernels   bench_prefill_attention.py: one 8k chunk of a 32k prompt (the first and the last),
#             gather kernel at its policy's split count and unsplit, TMA kernel per tile, page sizes
#             16 / 64
#   ttft      bench_long_context.py, the 32k prompt through the public API (TTFT, decode), four ways:
#             defaults (pages of 16, gather, prefill split by the decode target); prefill unsplit
#             (PREFILL_TARGET_PROGRAMS_PER_SM 1); pages of 64 with the TMA kernel; pages of 64 without
#   b1        bench_offline.py (B1, bf16, no tokenizer: an A/B, not the goal's figure) at pages of 16 and of
#             64 with the TMA kernel: what a larger default page would cost or give the decode
#
#   STEPS="tests kernels" bash benchmarks/gpu_prefill_ab.sh
#   STEPS="ttft b1" bash benchmarks/gpu_prefill_ab.sh
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_prefill_ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"tests kernels ttft b1"}
TTFT_VARIANTS=(
  ""
  "--attn-constants {\"PREFILL_TARGET_PROGRAMS_PER_SM\":1}"
  "--kvcache-block-size 64 --attn-constants {\"triton_prefill_tma.ENABLED\":true}"
  "--kvcache-block-size 64"
)

run_step() {  # name, time limit (s), command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit} s): $*"
  timeout "$limit" "$@" 2>&1 | grep -v "Warning\|it/s" | tee "$OUT/$name.log"
}

for step in $STEPS; do
  case $step in
    tests) run_step tests 240 python3 -m pytest -q -x tests/test_triton_attn.py ;;
    kernels) run_step kernels 420 python3 benchmarks/bench_prefill_attention.py --block-sizes 16,64 ;;
    ttft)
      for i in "${!TTFT_VARIANTS[@]}"; do
        # shellcheck disable=SC2086  # each variant is a list of arguments
        run_step "ttft_$i" 150 python3 benchmarks/bench_long_context.py --splits '' ${TTFT_VARIANTS[$i]}
      done ;;
    b1)
      run_step b1_16 150 python3 benchmarks/bench_offline.py
      run_step b1_64 150 python3 benchmarks/bench_offline.py --kvcache-block-size 64 \
        --attn-constants '{"triton_prefill_tma.ENABLED": true}' ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
