"""Run test files as several pytest processes at once, each with a share of the tests.

For the GPU suite: on a fresh GPU machine most of the tests' time is Triton compiling
kernel variants and engines capturing CUDA graphs, both on the host's CPU, one at a time
per process (tests/test_triton_attn.py alone: 36 tests in 150 s on an H200 machine).
Shards in parallel finish in about a shard's time; Triton's on-disk cache is shared
between them.

Engines beside each other are fine while each has a fixed KV cache (`num_kvcache_blocks`);
one that sizes its cache from the GPU's free memory must run alone, or it counts the
other shards' memory as used. Tests that do are marked `exclusive_gpu` (tests/conftest.py):
they run after the shards, one process, nothing beside them.

    python3 benchmarks/pytest_shards.py [--workers N] TEST_FILE...

The other test ids are dealt round-robin in collection order, so each shard gets some of
every file. Each process's report goes to ${OUT:-/tmp}/shard_<i>.log (the exclusive
tests' to exclusive.log); the exit status is 0 only if every process passed (or had
nothing to run).
"""
import argparse
import os
import subprocess
import sys

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
NO_TESTS_COLLECTED = 5  # pytest's exit status when a shard's ids select nothing
EXCLUSIVE = "exclusive_gpu"
# More shards than this add GPU contexts and duplicate module fixtures for little gain.
MAX_DEFAULT_WORKERS = 8


def collect(files: list[str], marker_expr: str) -> list[str]:
    """The ids of the tests in `files` that `-m marker_expr` selects."""
    proc = subprocess.run(PYTEST + ["--collect-only", "-m", marker_expr, *files], capture_output=True, text=True)
    if proc.returncode not in (0, NO_TESTS_COLLECTED):
        sys.exit(f"collection failed:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}")
    return [line for line in proc.stdout.splitlines() if "::" in line]


def run_all(batches: dict[str, list[str]]) -> bool:
    """Run one pytest process per named batch of test ids, all at once; True if all passed."""
    log_dir = os.environ.get("OUT", "/tmp")
    procs = {}
    for name, ids in batches.items():
        log = open(os.path.join(log_dir, f"{name}.log"), "w")
        procs[name] = (subprocess.Popen(PYTEST + ids, stdout=log, stderr=subprocess.STDOUT), log)
    passed = True
    for name, (proc, log) in procs.items():
        status = proc.wait()
        log.close()
        with open(log.name) as f:
            summary = f.read().strip().splitlines()[-1:]
        print(f"{name} ({len(batches[name])} tests): {' '.join(summary)}", flush=True)
        passed &= status in (0, NO_TESTS_COLLECTED)
    return passed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=max(1, min(MAX_DEFAULT_WORKERS, (os.cpu_count() or 2) // 2)))
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    shared, exclusive = collect(args.files, f"not {EXCLUSIVE}"), collect(args.files, EXCLUSIVE)
    shards = {f"shard_{i}": shared[i::args.workers] for i in range(args.workers) if shared[i::args.workers]}
    passed = run_all(shards)
    if exclusive:
        passed &= run_all({"exclusive": exclusive})
    print(f"{len(shared)} tests in {len(shards)} shards, then {len(exclusive)} alone: "
          f"{'passed' if passed else 'FAILED'}")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
