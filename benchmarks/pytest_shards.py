"""Run test files as several pytest processes at once, each with a share of the tests.

For the GPU suite: on a fresh GPU machine most of the tests' time is Triton compiling
kernel variants and engines capturing CUDA graphs, both on the host's CPU, one at a time
per process. Shards in parallel finish in about a shard's time; Triton's on-disk cache is
shared between them.

Engines beside each other are fine while each has a fixed KV cache (`num_kvcache_blocks`).
One that sizes its cache from `gpu_memory_utilization` counts all memory in use on the
device, the other shards' too, so it must run alone: tests that build one carry the
`exclusive_gpu` marker (registered in pyproject.toml) and run after the shards, in one
process, with nothing beside them.

    python3 benchmarks/pytest_shards.py [--workers N] TEST_FILE...

The other test ids are dealt round-robin in collection order, so each shard gets some of
every file. Each process's report goes to ${OUT:-/tmp}/shard_<i>.log (the exclusive
tests' to exclusive.log); the exit status is 0 only if every process passed.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
EXCLUSIVE = "exclusive_gpu"
# More shards than this add GPU contexts and duplicate module fixtures for little gain.
MAX_DEFAULT_WORKERS = 8
REPORT_TAIL_CHARS = 4000  # of a failed collection's output, shown


def collect(files: list[str], marker_expr: str) -> list[str]:
    """The ids of the tests in `files` that `-m marker_expr` selects."""
    proc = subprocess.run(PYTEST + ["--collect-only", "-m", marker_expr, *files], capture_output=True, text=True)
    if proc.returncode not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        sys.exit(f"collection failed:\n{(proc.stdout + proc.stderr)[-REPORT_TAIL_CHARS:]}")
    return [line for line in proc.stdout.splitlines() if "::" in line and not line[:1].isspace()]


def run_all(batches: dict[str, list[str]], log_dir: str) -> bool:
    """Run one pytest process per named batch of test ids, all at once; True if all passed.

    Each gets its own base temporary directory (pytest's clean-up of old ones must not
    reach into another process's), removed once it passed.
    """
    procs = {}
    for name, ids in batches.items():
        log_path = os.path.join(log_dir, f"{name}.log")
        basetemp = tempfile.mkdtemp(prefix=f"pytest-{name}-")
        with open(log_path, "w") as log:  # the child has its own descriptor
            proc = subprocess.Popen(PYTEST + ["--basetemp", basetemp] + ids, stdout=log, stderr=subprocess.STDOUT)
        procs[name] = proc, log_path, basetemp
    passed = True
    for name, (proc, log_path, basetemp) in procs.items():
        ok = proc.wait() == pytest.ExitCode.OK
        with open(log_path) as f:
            summary = f.read().strip().splitlines()[-1:]
        print(f"{name} ({len(batches[name])} tests): {' '.join(summary)}", flush=True)
        if ok:
            shutil.rmtree(basetemp, ignore_errors=True)
        passed &= ok
    return passed


def main():
    default_workers = max(1, min(MAX_DEFAULT_WORKERS, len(os.sched_getaffinity(0)) // 2))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=default_workers)
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    log_dir = os.environ.get("OUT") or "/tmp"
    shared, exclusive = collect(args.files, f"not {EXCLUSIVE}"), collect(args.files, EXCLUSIVE)
    if not shared and not exclusive:
        sys.exit(f"no tests collected from {args.files}")
    shards = {f"shard_{i}": shared[i::args.workers] for i in range(args.workers) if shared[i::args.workers]}
    passed = run_all(shards, log_dir)
    if exclusive:
        passed &= run_all({"exclusive": exclusive}, log_dir)
    print(f"{len(shared)} tests in {len(shards)} shards, then {len(exclusive)} alone: "
          f"{'passed' if passed else 'FAILED'}")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
