#!/usr/bin/env bash
# B1 A/B on one machine: bench_offline.py from two source trees, alternating, so that the
# machine-to-machine spread (up to ~2% on the device machines) does not enter the comparison.
#
#   bash benchmarks/ab_offline.sh TREE_A TREE_B [ROUNDS] [bench_offline.py arguments...]
#
# A tree is any checkout or unpacked `git archive` of this repository, e.g. on the device
# machine: `mkdir /tmp/a && tar -xf main.tar -C /tmp/a` with main.tar from
# `git archive main > .notes/main.tar` here, carried along. Each run's log goes to
# ${OUT:-/tmp}/ab_<A|B>_<round>.log; one summary line per run is printed.
set -uo pipefail
[[ $# -ge 2 ]] || { sed -n 2,10p "$0"; exit 2; }
tree_a=$(realpath "$1"); tree_b=$(realpath "$2"); rounds=${3:-2}; shift $(( $# < 3 ? $# : 3 ))
log_dir=${OUT:-/tmp}
for round in $(seq 1 "$rounds"); do
    for side in A B; do
        tree=$tree_a; [[ $side == B ]] && tree=$tree_b
        log="$log_dir/ab_${side}_${round}.log"
        (cd "$tree" && PYTHONPATH="$tree:$tree/benchmarks" python3 benchmarks/bench_offline.py "$@") >"$log" 2>&1
        summary=$(tail -1 "$log" | python3 -c 'import json, sys
d = json.loads(sys.stdin.read())
print("tok/s", d["tok_per_s"], " roofline", d.get("roofline_fraction"), " GPU ms/step", d["gpu_ms_per_step"])' 2>/dev/null) \
            || summary="FAILED (see $log)"
        echo "$side round $round: $summary"
    done
done
