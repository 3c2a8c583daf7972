"""Q4_K's two CPU forms, per shape and row count: torch's int4 kernel (kernels/cpu_int4.py, what the
engine runs for Q4_K layers: bf16 scales and activations) against the Q8_0 kernel with offsets
(kernels/cpu_q8_0.py: the 4-bit values as int8, one fp32 scale and one fp32 offset per 32 values, as
Q5_K layers run; exact in fp32, 1.25 bytes a weight against int4's ~0.56).

The same random 4-bit weights (values 0..15, a scale and a zero per group of 32) in both forms,
`--copies` of them used in turn (the head: 2); the two kernels alternate within each repeat; medians.

    python benchmarks/bench_cpu_q4_k_forms.py --threads 2
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_cpu_q4_k_forms.py --threads 2 \
        --dtype float32

Prints one line per (shape, rows) and a final JSON line.
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels import cpu_int4, cpu_q8_0  # noqa: E402
from bench_cpu_q8_0 import time_once  # noqa: E402 (beside this file)

Q4_LEVELS = 16        # 4-bit values 0..15
Q4_MIDDLE = 8         # the int4 kernel's values are (q - 8) * scale + zero
WEIGHT_SIZE = 1e-2    # the random scales' and zeros' size


def _weights(n: int, k: int):
    """One random 4-bit weight [n, k] as (the int4 kernel's operands, the Q8_0 kernel's Q8Weight)."""
    group = cpu_int4.GROUP_SIZE
    q = torch.randint(0, Q4_LEVELS, (n, k), dtype=torch.int32)
    scale = torch.rand(n, k // group) * WEIGHT_SIZE                          # [n, k / 32]
    zero = torch.randn(n, k // group) * WEIGHT_SIZE
    return (cpu_int4.pack_int4(q, scale, zero, torch.bfloat16),
            cpu_q8_0.Q8Weight(q.to(torch.int8), scale, zero - Q4_MIDDLE * scale))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--shapes", nargs="+", default=["960x576", "576x576", "3072x576", "576x1536", "49152x576"])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the activations'")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not cpu_q8_0.built(dtype, cpu_int4.GROUP_SIZE, offsets=True):
        raise SystemExit("the Q8_0 kernel could not be built here (no C++ compiler?)")
    results = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        copies = 2 if n * k > 8_000_000 else args.copies  # the head alone is larger than the L3
        weights = [_weights(n, k) for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k).to(dtype)
            times = {"int4": [], "q8": []}
            for r in range(args.repeats + 1):
                packed, q8 = weights[r % copies]
                t_int4 = time_once(lambda: cpu_int4.int4_linear(x, *packed))
                t_q8 = time_once(lambda: cpu_q8_0.q8_0_linear(x, q8))
                if r:  # the first repeat warms up
                    times["int4"].append(t_int4)
                    times["q8"].append(t_q8)
            med = {kind: round(statistics.median(t) * 1e3, 4) for kind, t in times.items()}
            print(f"{n}x{k} M={m}: int4 {med['int4']:.3f} ms  q8+offsets {med['q8']:.3f} ms  "
                  f"q8/int4 {med['q8'] / med['int4']:.2f}", flush=True)
            results.append({"shape": [n, k], "rows": m, "int4_ms": med["int4"], "q8_ms": med["q8"]})
    print(json.dumps({"threads": args.threads, "dtype": args.dtype, "results": results}))


if __name__ == "__main__":
    main()
