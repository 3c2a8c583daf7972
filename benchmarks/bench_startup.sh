#!/usr/bin/env bash
# Start-up with an empty Triton cache (a fresh machine) and with a warm one, and B1's first
# call after each: bench_offline.py twice over one private TRITON_CACHE_DIR, empty at first.
# Extra arguments go to bench_offline.py (e.g. --tokenizer DIR). Logs: $OUT/startup_{cold,warm}.log.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG_DIR="${OUT:-/tmp/nanovllm-startup}"
mkdir -p "$LOG_DIR"
PY="${PYTHON:-python3}"
# A user's pip-installed packages come with compiled bytecode. The GPU machines' image keeps none for its
# site-packages, so every process there compiled its imports from source (2.2 s of a warm start in
# RESULTS.md's "Twenty-ninth session"). Both runs read one bytecode cache, filled before the clock.
export PYTHONPYCACHEPREFIX
PYTHONPYCACHEPREFIX="$(mktemp -d -t nanovllm-pycache-XXXXXX)"
"$PY" -m compileall -q -j 0 nanovllm $("$PY" -c 'import os, torch, transformers, triton
print(" ".join(os.path.dirname(m.__file__) for m in (torch, transformers, triton)))') > /dev/null || true
export TRITON_CACHE_DIR
TRITON_CACHE_DIR="$(mktemp -d -t nanovllm-triton-cache-XXXXXX)"
for run in cold warm; do
    echo "=== $run Triton cache ($TRITON_CACHE_DIR: $(find "$TRITON_CACHE_DIR" -name '*.cubin' | wc -l) kernels)"
    PYTHONUNBUFFERED=1 "$PY" benchmarks/bench_offline.py "$@" 2>&1 | tee "$LOG_DIR/startup_$run.log"
done
rm -rf "$TRITON_CACHE_DIR" "$PYTHONPYCACHEPREFIX"
