#!/usr/bin/env bash
# GPU suite: the checks that only a GPU can run, one python invocation each.
# Each step's log goes to $OUT/<step>.log (or /tmp/nanovllm-gpu-suite/ if OUT is unset);
# the suite runs every step and exits non-zero if any failed.
# Append new steps as `step NAME COMMAND...` lines at the end.
# Extra arguments for bench_kernels.py: BENCH_KERNELS_ARGS (e.g. "--tune").
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR="${OUT:-/tmp/nanovllm-gpu-suite}"
mkdir -p "$LOG_DIR"
export OUT="$LOG_DIR"  # where steps that write logs of their own put them (pytest_shards.py)
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python3}"
failed=0

step() {
    local name=$1; shift
    [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0  # ONLY="a b": run just those steps
    echo "=== $name: $*"
    local start=$SECONDS
    "$@" 2>&1 | tee "$LOG_DIR/$name.log" || { echo "=== $name FAILED"; failed=1; }
    echo "=== $name: $((SECONDS - start)) s (suite so far: $SECONDS s)"
}

# every single-GPU test file, in parallel processes (see pytest_shards.py)
step tests "$PYTHON" benchmarks/pytest_shards.py tests/test_triton_attn.py tests/test_triton_ops.py \
    tests/test_triton_sampling.py tests/test_sampling_exact.py tests/test_sampling.py \
    tests/test_gpu_engine.py tests/test_multi_step.py tests/test_engine_heap.py tests/test_warmup_gpu.py \
    tests/test_skinny_gemm.py tests/test_pdl.py tests/test_fused_rope_gpu.py
step bench_kernels "$PYTHON" benchmarks/bench_kernels.py ${BENCH_KERNELS_ARGS:-}
step bench_offline "$PYTHON" benchmarks/bench_offline.py
step bench_offline_1step "$PYTHON" benchmarks/bench_offline.py --num-scheduler-steps 1
step bench_b1_attention "$PYTHON" benchmarks/bench_b1_attention.py --variants base
step bench_long_context "$PYTHON" benchmarks/bench_long_context.py
# fp8 KV cache and fp8 weights: kernels natively against the torch reference, the engine, B1
step fp8_tests "$PYTHON" -m pytest -q -p no:cacheprovider -n 8 tests/test_fp8_kv_kernels.py tests/test_fp8_gpu.py \
    tests/test_decode_tiles.py tests/test_batch_gemm.py tests/test_fp8_weights.py tests/test_fp8_fused_quant.py \
    tests/test_gluon_decode_mma.py
step bench_offline_fp8 "$PYTHON" benchmarks/bench_offline.py --kv-cache-dtype fp8
if [[ $("$PYTHON" -c 'import torch; print(torch.cuda.device_count())') -ge 2 ]]; then
    step test_tp_gpu "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_tp_gpu.py
    step bench_offline_tp2 "$PYTHON" benchmarks/bench_offline.py --tensor-parallel-size 2
fi

exit $failed
