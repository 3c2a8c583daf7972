#!/usr/bin/env bash
# B1 with an fp8 KV cache beside bf16, in one call on one GPU (a fresh machine: every Triton
# kernel compiles in it): the fp8/bf16 attention kernels natively against the torch reference,
# B1's decode attention replayed for both cache dtypes (bench_b1_attention.py: the engine's
# kernels, a second copy of kernels/triton_attn.py for an A/B if OLD_KERNELS names one, and the
# decode tile / split variants in VARIANTS), then B1 itself per dtype with the GPU time of every
# kernel over a profiled second run (bench_offline.py --profile). One log per step under $OUT.
#
#   OLD_KERNELS=/path/to/triton_attn_before.py bash benchmarks/gpu_b1_fp8.sh
#   STEPS="b1_fp8 b1_bf16" bash benchmarks/gpu_b1_fp8.sh      # some steps only
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_b1_fp8}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-"tests_fp8 attn b1_fp8 b1_bf16 tiles tests_attn"}
VARIANTS=${VARIANTS:-n128s2,n128s4,n256s2,n256s3,n64s3,split4,split16}
KERNELS=${OLD_KERNELS:+--kernels old=$OLD_KERNELS}

run_step() {  # name, time limit (s), command...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name (limit ${limit} s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}

for step in $STEPS; do
  case $step in
    tests_fp8) run_step tests_fp8 60 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_fp8_kv_kernels.py ;;
    attn) run_step attn 80 python3 benchmarks/bench_b1_attention.py --every 64 --kv-cache-dtype auto,fp8 \
          --variants base $KERNELS ;;
    b1_fp8) run_step b1_fp8 80 python3 benchmarks/bench_offline.py --kv-cache-dtype fp8 --profile ;;
    b1_bf16) run_step b1_bf16 80 python3 benchmarks/bench_offline.py --profile ;;
    tiles) run_step tiles 100 python3 benchmarks/bench_b1_attention.py --every 64 --kv-cache-dtype fp8,auto \
           --variants "$VARIANTS" ;;
    tests_attn) run_step tests_attn "${TESTS_ATTN_LIMIT:-60}" python3 -m pytest -q -p no:cacheprovider -n 8 \
                tests/test_triton_attn.py ;;
    *) echo "unknown step $step" ;;
  esac
done
