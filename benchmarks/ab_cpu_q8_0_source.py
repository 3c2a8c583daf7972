"""The Q8_0 kernel (kernels/cpu_q8_0.cpp) built from a git revision's source against the working
tree's, alternating in one process: that a change to the source leaves a build as fast as before.

For each shape and row count, both builds (same dtype, block size, no offsets) multiply the same
random Q8_0-like weights (`--copies` of them, used in turn, so that small shapes stream from memory);
each repeat times one call of each, in turn; medians are printed, and a final JSON line.

    python benchmarks/ab_cpu_q8_0_source.py --rev bdaa104 --block 32 --threads 2
    python benchmarks/ab_cpu_q8_0_source.py --rev bdaa104 --block 16 --threads 2
"""
import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nanovllm.kernels import cpu_q8_0  # noqa: E402
from nanovllm.utils import cpp_compiler  # noqa: E402
from bench_cpu_q8_0 import time_once  # noqa: E402 (beside this file)

SOURCE_PATH = Path("nanovllm/kernels/cpu_q8_0.cpp")


def _old_build(rev: str, dtype: torch.dtype, block: int):
    """The kernel (without offsets) built from `rev`'s source and the headers beside it, extracted
    from git and assembled by the engine's own `cpu_q8_0.source_for` (a revision before the offsets
    ignores their HAS_OFFSETS=0)."""
    kernels = SOURCE_PATH.parent.as_posix()
    archive = subprocess.run(["git", "archive", rev, kernels], cwd=ROOT, check=True, capture_output=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        source = cpu_q8_0.source_for(dtype, block, path=Path(tmp) / SOURCE_PATH)
    return cpp_compiler.build(source, cpu_q8_0.arg_types(dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="the git revision whose source is the baseline")
    parser.add_argument("--block", type=int, default=cpu_q8_0.BLOCK, choices=sorted(set(cpu_q8_0.BLOCK_OF.values())))
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--shapes", nargs="+", default=["49152x576", "1536x576", "576x1536"])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    fns = {"old": _old_build(args.rev, dtype, args.block), "new": cpu_q8_0._build(dtype, args.block)}
    assert all(fns.values()), "a build failed"
    results = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        copies = 2 if n * k > 8_000_000 else args.copies
        weights = [cpu_q8_0.Q8Weight(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, k // args.block))
                   for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k).to(dtype)
            times = {name: [] for name in fns}
            for r in range(args.repeats + 1):
                w = weights[r % copies]
                y = torch.empty(m, n, dtype=dtype)
                for name, fn in (list(fns.items()) if r % 2 else list(fns.items())[::-1]):
                    t = time_once(lambda: fn(x, w.values, w.scales, y, m, n, k, args.threads))
                    if r:
                        times[name].append(t)
            med = {name: round(statistics.median(t) * 1e3, 4) for name, t in times.items()}
            ratio = med["new"] / med["old"]
            print(f"{n}x{k} M={m}: old {med['old']:.3f} ms  new {med['new']:.3f} ms  new/old {ratio:.3f}", flush=True)
            results.append({"shape": [n, k], "rows": m, **{f"{k_}_ms": v for k_, v in med.items()}})
    print(json.dumps({"rev": args.rev, "block": args.block, "dtype": args.dtype, "threads": args.threads,
                      "results": results}))


if __name__ == "__main__":
    main()
