"""The Q8_0 kernel (kernels/cpu_q8_0.py) against the dense product, per row count and shape.

For each shape (default: SmolLM2-135M's tied LM head 49152x576, its gate_up-like 1536x576 and
down 576x1536 layers) and each row count M, the time of one product by:

- q8: `cpu_q8_0.q8_0_linear` on the weight (int8 values + fp32 scales; Q5_K: + fp32 offsets),
  bf16 activations (`--dtype float32`: fp32)
- dnnbf: oneDNN's packed bf16 product of the dequantized weight (kernels/cpu_gemm.py), what the
  engine's dense products run where bf16 is fast (and for batches above the Q8_0 crossover)
- dense32 (with `--dtype float32`, the AVX2 kind's engine dtype): the fp32 dense product as the
  engine runs it (`cpu_gemm.dense_linear`: the column-major weight for 1 and 2 rows, oneDNN's
  packed copy from 3)

The weight: Q8_0-like (`--block 32`, the default), Q6_K-like (`--block 16`), or, with `--type`, one
of the GGUF types the kernel reads (`--type Q5_K`: random Q5_K blocks read by `from_gguf`).

Each shape has `--copies` random weights used in turn, so that the small shapes stream from memory
as the 30 layers of a real step do rather than sit in cache. The kernels alternate within each
repeat, so a busy machine slows both alike; medians are printed.

    python benchmarks/bench_cpu_q8_0.py --threads 2 --rows 1 2 4 8 16
    python benchmarks/bench_cpu_q8_0.py --threads 2 --block 16 --shapes 2048x2048 8192x2048 2048x8192 --rows 1 2 4
    python benchmarks/bench_cpu_q8_0.py --threads 2 --type Q5_K --shapes 960x576 576x576 3072x576 576x1536 49152x576
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_cpu_q8_0.py --threads 2 --type Q5_K \
        --dtype float32 --shapes 960x576 576x576 3072x576 576x1536 49152x576

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
from nanovllm.utils import dequant  # noqa: E402

F16_SCALE = 1e-3  # the size of the random Q5_K blocks' fp16 d and dmin


def _q5_k_weight(n: int, k: int) -> cpu_q8_0.Q8Weight:
    """A Q5_K weight [n, k] of random blocks (random bytes, then d and dmin set to small fp16 values).
    A k that is not whole super-blocks of 256 (SmolLM2's 576) takes the first k columns of the next
    size that is: the kernel reads blocks of 32, so it runs as on a real Q5_K row of that many."""
    _, block_bytes, _ = dequant.QUANT_TYPES["Q5_K"]
    blocks = -(-k // dequant.QK_K)
    raw = torch.randint(0, 256, (n, blocks, block_bytes), dtype=torch.uint8)            # [n, blocks, 176]
    raw[..., :4] = (torch.rand(n, blocks, 2) * F16_SCALE).half().view(torch.uint8)      # d, dmin
    whole = cpu_q8_0.from_gguf(raw.view(n, -1), "Q5_K")
    cols = k // cpu_q8_0.BLOCK_OF["Q5_K"]
    return cpu_q8_0.Q8Weight(whole.values[:, :k], whole.scales[:, :cols], whole.offsets[:, :cols])


def _weights(n: int, k: int, copies: int, block: int, type_name: str | None, dtype: torch.dtype):
    """`copies` of (the kernel's weight, the dense product's weights: (column-major or None, packed))."""
    out = []
    for _ in range(copies):
        if type_name == "Q5_K":
            q8 = _q5_k_weight(n, k)
        elif block == cpu_q8_0.BLOCK:
            q8 = cpu_q8_0.quantize(torch.randn(n, k) * 0.05)
        else:  # a Q6_K-like weight: 6-bit values, one scale per `block`
            q8 = cpu_q8_0.Q8Weight(torch.randint(-32, 32, (n, k), dtype=torch.int8), torch.rand(n, k // block) * 1e-3)
        dense = q8.dequantize().to(dtype)                                    # [n, k]
        column_major = dense.t().contiguous().t() if dtype == torch.float32 else None
        out.append((q8, (column_major, cpu_gemm.pack(dense))))
    return out


def time_once(fn) -> float:
    """Seconds one call of `fn` takes (also used by ab_cpu_q8_0_source.py and bench_cpu_q4_k_forms.py)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_shape(n: int, k: int, rows: list[int], copies: int, repeats: int, block: int, type_name: str | None,
                dtype: torch.dtype) -> list[dict]:
    weights = _weights(n, k, copies, block, type_name, dtype)
    dense = "dnnbf" if dtype == torch.bfloat16 else "dense32"
    results = []
    for m in rows:
        x = torch.randn(m, k).to(dtype)
        times = {"q8": [], dense: []}
        for r in range(repeats + 1):
            q8, (column_major, packed) = weights[r % copies]
            t_q8 = time_once(lambda: cpu_q8_0.q8_0_linear(x, q8))
            t_dense = time_once(lambda: cpu_gemm.dense_linear(x, column_major, None, packed))
            if r:  # the first repeat warms up
                times["q8"].append(t_q8)
                times[dense].append(t_dense)
        med = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
        q8_bytes = weights[0][0].nbytes
        row = {"shape": [n, k], "block": block, "type": type_name, "rows": m, "q8_ms": round(med["q8"], 4),
               f"{dense}_ms": round(med[dense], 4), "q8_GBps": round(q8_bytes / med["q8"] / 1e6, 1),
               f"{dense}_GBps": round(dtype.itemsize * n * k / med[dense] / 1e6, 1)}
        print(f"{n}x{k} M={m}: q8 {row['q8_ms']:.3f} ms ({row['q8_GBps']} GB/s)  {dense} {row[dense + '_ms']:.3f} ms "
              f"({row[dense + '_GBps']} GB/s)", flush=True)
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
    parser.add_argument("--type", choices=["Q5_K"], default=None,
                        help="a GGUF type's random blocks instead (sets the block size)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the activations'")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    block = cpu_q8_0.BLOCK_OF[args.type] if args.type else args.block
    if not cpu_q8_0.built(dtype, block, args.type in cpu_q8_0.OFFSET_TYPES):
        raise SystemExit("the Q8_0 kernel could not be built here (no C++ compiler?)")
    results = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        copies = 2 if n * k > 8_000_000 else args.copies  # the head alone is larger than the L3
        results += bench_shape(n, k, args.rows, copies, args.repeats, block, args.type, dtype)
    print(json.dumps({"threads": args.threads, "dtype": args.dtype, "results": results}))


if __name__ == "__main__":
    main()
