"""Run test files as several pytest processes at once, each with a share of the tests.

For the GPU suite's kernel tests: on a fresh GPU machine nearly all their time is Triton
compiling each test's kernel variants, one compile at a time per process (test_triton_attn:
36 tests in 150 s on an H200 machine). Compiles run on the host's CPU cores, so shards
in parallel finish in about a shard's time; Triton's on-disk cache is shared between
them. Only for tests that need little GPU memory: engines size their KV cache from the
free memory and must not run beside each other.

    python3 benchmarks/pytest_shards.py [--workers N] TEST_FILE...

Test ids are dealt round-robin in collection order, so each shard gets some of every
file. Each shard's report goes to ${OUT:-/tmp}/shard_<i>.log; the exit status is 0 only
if every shard passed (or had nothing to run).
"""
import argparse
import os
import subprocess
import sys

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
NO_TESTS_COLLECTED = 5  # pytest's exit status when a shard's ids select nothing


def collect(files: list[str]) -> list[str]:
    """The test ids pytest collects from `files`."""
    proc = subprocess.run(PYTEST + ["--collect-only", *files], capture_output=True, text=True)
    if proc.returncode not in (0, NO_TESTS_COLLECTED):
        sys.exit(f"collection failed:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}")
    return [line for line in proc.stdout.splitlines() if "::" in line]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    ids = collect(args.files)
    shards = [ids[i::args.workers] for i in range(args.workers) if ids[i::args.workers]]
    log_dir = os.environ.get("OUT", "/tmp")
    logs = [open(os.path.join(log_dir, f"shard_{i}.log"), "w") for i in range(len(shards))]
    procs = [subprocess.Popen(PYTEST + shard, stdout=log, stderr=subprocess.STDOUT)
             for shard, log in zip(shards, logs)]
    failed = 0
    for i, (proc, log) in enumerate(zip(procs, logs)):
        status = proc.wait()
        log.close()
        with open(log.name) as f:
            summary = f.read().strip().splitlines()[-1:]
        print(f"shard {i} ({len(shards[i])} tests): {' '.join(summary)}")
        failed |= status not in (0, NO_TESTS_COLLECTED)
    print(f"{len(ids)} tests in {len(shards)} shards: {'FAILED' if failed else 'passed'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
