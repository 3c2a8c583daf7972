"""The Q8_0 kernel (kernels/cpu_q8_0.py) against the dense bf16 product, per row count and shape.

For each shape (default: SmolLM2-135M's tied LM head 49152x576, its gate_up-like 1536x576 and
down 576x1536 layers) and each row count M, the time of one product by:

- q8: `cpu_q8_0.q8_0_linear` on the Q8_0 weight (int8 values + fp32 scales), bf16 activations
- dnnbf: oneDNN's packed bf16 product of the dequantized weight (kernels/cpu_gemm.py), what the
  engine's dense products run where bf16 is fast (and for batches above the Q8_0 crossover)

Each shape has `--copies` random weights used in turn, so that the small shapes stream from memory
as the 30 layers of a real step do rather than sit in cache. The kernels alternate within each
repeat, so a busy machine slows both alike; medians are printed.

    python benchmarks/bench_cpu_q8_0.py --threads 2 --rows 1 2 4 8 16
    python benchmarks/bench_cpu_q8_0.py --threads 2 --block 16 --shapes 2048x2048 8192x2048 2048x8192 --rows 1 2 4

Prints one line per (shape, rows) and a final JSON line.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels import cpu_gemm, cpu_q8_0  # noqa: E402


def _weights(n: int, k: int, copies: int, block: int = cpu_q8_0.BLOCK):
    out = []
    for _ in range(copies):
        if block == cpu_q8_0.BLOCK:
            q8 = cpu_q8_0.quantize(torch.randn(n, k) * 0.05)
        else:  # a Q6_K-like weight: 6-bit values, one scale per `block`
            q8 = cpu_q8_0.Q8Weight(torch.randint(-32, 32, (n, k), dtype=torch.int8), torch.rand(n, k // block) * 1e-3)
        out.append((q8, cpu_gemm.pack(q8.dequantize().bfloat16())))
    return out


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_shape(n: int, k: int, rows: list[int], copies: int, repeats: int, block: int) -> list[dict]:
    weights = _weights(n, k, copies, block)
    results = []
    for m in rows:
        x = torch.randn(m, k).bfloat16()
        times = {"q8": [], "dnnbf": []}
        for r in range(repeats + 1):
            q8, packed = weights[r % copies]
            t_q8 = _time(lambda: cpu_q8_0.q8_0_linear(x, q8))
            t_dnn = _time(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
            if r:  # the first repeat warms up
                times["q8"].append(t_q8)
                times["dnnbf"].append(t_dnn)
        med = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
        q8_bytes = weights[0][0].nbytes
        row = {"shape": [n, k], "block": block, "rows": m, "q8_ms": round(med["q8"], 4), "dnnbf_ms": round(med["dnnbf"], 4),
               "q8_GBps": round(q8_bytes / med["q8"] / 1e6, 1), "dnnbf_GBps": round(2 * n * k / med["dnnbf"] / 1e6, 1)}
        print(f"{n}x{k} M={m}: q8 {row['q8_ms']:.3f} ms ({row['q8_GBps']} GB/s)  dnnbf {row['dnnbf_ms']:.3f} ms "
              f"({row['dnnbf_GBps']} GB/s)", flush=True)
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--shapes", nargs="+", default=["49152x576", "1536x576", "576x1536"],
                        help="out x in of each weight")
    parser.add_argument("--copies", type=int, default=8, help="weights per shape, used in turn")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--block", type=int, default=cpu_q8_0.BLOCK, choices=sorted(set(cpu_q8_0.BLOCK_OF.values())),
                        help="values per scale: 32 (Q8_0), 16 (Q6_K's groups)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_q8_0.built(torch.bfloat16, args.block):
        raise SystemExit("the Q8_0 kernel could not be built here (no C++ compiler?)")
    results = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        copies = 2 if n * k > 8_000_000 else args.copies  # the head alone is larger than the L3
        results += bench_shape(n, k, args.rows, copies, args.repeats, args.block)
    print(json.dumps({"threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
