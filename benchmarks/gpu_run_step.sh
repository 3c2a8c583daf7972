# Sourced by the GPU benchmark scripts (gpu_decode_tile.sh, gpu_decode_mma.sh): `run_step NAME LIMIT
# COMMAND...` runs COMMAND under a time limit in seconds, its output shown and kept in $OUT/NAME.log,
# with its exit status and time.
run_step() {
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== $name (limit ${limit} s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}
