"""The Q8_0 kernel (kernels/cpu_q8_0.py) against the dense product, per row count and shape.

For each shape (default: SmolLM2-135M's tied LM head 49152x576, its gate_up-like 1536x576 and
down 576x1536 layers) and each row count M, the time of one product by:

- q8: `cpu_q8_0.q8_0_linear` on the Q8_0 weight (int8 values + fp32 scales), bf16 activations
- dnnbf: oneDNN's packed bf16 product of the dequantized weight (kernels/cpu_gemm.py), what the
  engine's dense products run where bf16 is fast (and for batches above the Q8_0 crossover)
- with `--dtype float32` (an fp32 engine's, the AVX2 kind's): q8 with fp32 activations against
  dense, the fp32 engine's dense product (cpu_gemm.dense_linear: the column-major weight's
  `F.linear` below PACKED_MIN_ROWS rows, oneDNN's packed fp32 copy from there)

Each shape has `--copies` random weights used in turn, so that the small shapes stream from memory
as the 30 layers of a real step do rather than sit in cache. The kernels alternate within each
repeat, so a busy machine slows both alike; medians are printed.

    python benchmarks/bench_cpu_q8_0.py --threads 2 --rows 1 2 4 8 16
    python benchmarks/bench_cpu_q8_0.py --threads 2 --block 16 --shapes 2048x2048 8192x2048 2048x8192 --rows 1 2 4
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_cpu_q8_0.py --threads 2 --dtype float32

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


DENSE_KIND = {torch.bfloat16: "dnnbf", torch.float32: "dense"}  # the dense product's name per dtype


def _dense(weight: torch.Tensor, dtype: torch.dtype):
    """The dense product an engine of `dtype` runs on `weight` [n, k]: fn(x) -> [m, n]."""
    if dtype == torch.bfloat16:
        packed = cpu_gemm.pack(weight.bfloat16())
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    column_major, packed = weight.t().contiguous().t(), cpu_gemm.pack(weight)
    return lambda x: cpu_gemm.dense_linear(x, column_major, None, packed)


def _weights(n: int, k: int, copies: int, block: int = cpu_q8_0.BLOCK, dtype: torch.dtype = torch.bfloat16):
    out = []
    for _ in range(copies):
        if block == cpu_q8_0.BLOCK:
            q8 = cpu_q8_0.quantize(torch.randn(n, k) * 0.05)
        else:  # a Q6_K-like weight: 6-bit values, one scale per `block`
            q8 = cpu_q8_0.Q8Weight(torch.randint(-32, 32, (n, k), dtype=torch.int8), torch.rand(n, k // block) * 1e-3)
        out.append((q8, _dense(q8.dequantize().float(), dtype)))
    return out


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_shape(n: int, k: int, rows: list[int], copies: int, repeats: int, block: int,
                dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    weights = _weights(n, k, copies, block, dtype)
    dense = DENSE_KIND[dtype]
    results = []
    for m in rows:
        x = torch.randn(m, k).to(dtype)
        times = {"q8": [], dense: []}
        for r in range(repeats + 1):
            q8, dense_fn = weights[r % copies]
            t_q8 = _time(lambda: cpu_q8_0.q8_0_linear(x, q8))
            t_dense = _time(lambda: dense_fn(x))
            if r:  # the first repeat warms up
                times["q8"].append(t_q8)
                times[dense].append(t_dense)
        med = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
        q8_bytes = weights[0][0].nbytes
        dense_bytes = n * k * torch.finfo(dtype).bits // 8
        row = {"shape": [n, k], "block": block, "rows": m, "q8_ms": round(med["q8"], 4),
               f"{dense}_ms": round(med[dense], 4), "q8_GBps": round(q8_bytes / med["q8"] / 1e6, 1),
               f"{dense}_GBps": round(dense_bytes / med[dense] / 1e6, 1)}
        print(f"{n}x{k} M={m}: q8 {row['q8_ms']:.3f} ms ({row['q8_GBps']} GB/s)  {dense} {row[f'{dense}_ms']:.3f} ms "
              f"({row[f'{dense}_GBps']} GB/s)", flush=True)
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
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the activations' (and the dense product's) dtype")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    if not cpu_q8_0.built(dtype, args.block):
        raise SystemExit("the Q8_0 kernel could not be built here (no C++ compiler?)")
    results = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        copies = 2 if n * k > 8_000_000 else args.copies  # the head alone is larger than the L3
        results += bench_shape(n, k, args.rows, copies, args.repeats, args.block, dtype)
    print(json.dumps({"threads": args.threads, "dtype": args.dtype, "results": results}))


if __name__ == "__main__":
    main()
