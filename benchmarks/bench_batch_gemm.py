"""Products of decode-sized batches on the GPU: cuBLAS against Triton tiles, fp8 (rowwise
scales: `_scaled_mm` against kernels/triton_batch_gemm.py) or bf16 (`F.linear` against the
same kernel over bf16 operands with unit scales: it lost, so the engine runs cuBLAS there).

For each decode product of a model (q/k/v, o, gate/up, down) and row count, a chain of
`--layers` products, each on its own weight (together far beyond L2, as in a decode step),
captured in one CUDA graph and replayed: microseconds per product (fp8: the activations'
per-token quantization is the same for every variant and not timed). Then, per row count,
the fastest Triton tile over the model's four products against cuBLAS ("cublas": for fp8
with fast accumulation, the engine's; "cublas_exact_accum" without), and the table that
takes Triton where it won by more than MIN_GAIN: for fp8 printed as the `FP8_TILES`
constants JSON for the benchmarks' `--attn-constants`, and per product (`FP8_TILES_BY_SHAPE`,
keyed by the weight's [N, K]).

    python benchmarks/bench_batch_gemm.py                       # fp8, Qwen3-8B
    python benchmarks/bench_batch_gemm.py --dtype bf16 --model 0.6b
    python benchmarks/bench_batch_gemm.py --rows 64,256 --tiles '[[64, 64, 128, 4, 4]]'
"""
import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch.nn.functional as F  # noqa: E402
from bench_skinny_gemm import SHAPES, time_chain  # noqa: E402
from nanovllm.kernels import triton_batch_gemm  # noqa: E402
from nanovllm.layers.quantization import fp8  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TILES = [(64, 64, 128, 4, 4), (64, 32, 128, 4, 5), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4),
         (64, 64, 256, 4, 3), (128, 128, 128, 8, 3), (64, 32, 256, 4, 4), (64, 16, 256, 4, 4),
         (64, 64, 128, 4, 6), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (64, 256, 128, 8, 3)]
MIN_GAIN = 0.03  # Triton takes a row bucket only where it is this much faster over the four products


def fp8_variants(tiles):
    """fp8: x and w are (e4m3 values, scales) pairs."""
    def cublas(fast):
        return lambda x, w: torch._scaled_mm(x[0], w[0].t(), scale_a=x[1], scale_b=w[1], out_dtype=torch.bfloat16,
                                             use_fast_accum=fast)

    def triton_tile(tile):
        return lambda x, w: triton_batch_gemm.scaled_fp8_linear(x[0], x[1], w[0], w[1], tile)
    return {"cublas": cublas(True), "cublas_exact_accum": cublas(False),
            **{"triton_" + "_".join(map(str, t)): triton_tile(tuple(t)) for t in tiles}}


@functools.cache
def _unit_scales(rows: int, cols: int, device: str) -> torch.Tensor:
    """A [rows, cols] float32 tensor of ones, made once (before a chain is captured: time_chain
    calls each product once first)."""
    return torch.ones(rows, cols, device=device)


def bf16_tile(x, w, tile):
    """The engine's fp8 tile kernel over bf16 operands, with unit scales (its epilogue's two
    multiplies by 1.0 kept: a few loads a tile)."""
    return triton_batch_gemm.scaled_fp8_linear(x, _unit_scales(x.shape[0], 1, str(x.device)), w,
                                               _unit_scales(1, w.shape[0], str(x.device)), tile)


def bf16_variants(tiles):
    def triton_tile(tile):
        return lambda x, w: bf16_tile(x, w, tile)
    return {"cublas": lambda x, w: F.linear(x, w),
            **{"triton_" + "_".join(map(str, t)): triton_tile(tuple(t)) for t in tiles}}


def operand(rows: int, cols: int, dtype: str, scale: float = 1.0):
    """A random operand: bf16, or fp8 as (e4m3 values, scales per row)."""
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * scale
    return x if dtype == "bf16" else fp8.quantize_rows(x)


def per_product_table(each: dict, product: str, row_counts: list[int]) -> list:
    """One product's table in FP8_TILES' form: per row count its fastest Triton tile where that beat
    cuBLAS by more than MIN_GAIN, else None; neighbouring entries with the same choice merged."""
    table = []
    for rows in row_counts:
        times = {v: us for (r, p, v), us in each.items() if r == rows and p == product}
        best = min((v for v in times if v.startswith("triton_")), key=times.get)
        tile = list(map(int, best.split("_")[1:])) if times[best] < times["cublas"] * (1 - MIN_GAIN) else None
        if table and table[-1][1] == tile:
            table[-1][0] = rows
        else:
            table.append([rows, tile])
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--model", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--rows", default="16,32,64,128,192,256")
    ap.add_argument("--layers", type=int, default=12, help="distinct weights a chain runs through")
    ap.add_argument("--tiles", default=json.dumps(TILES))
    args = ap.parse_args()
    tiles = [tuple(t) for t in json.loads(args.tiles)]
    fns = (fp8_variants if args.dtype == "fp8" else bf16_variants)(tiles)
    shapes = SHAPES[args.model]
    weights = {}
    for name, n, k in shapes:
        ws = [operand(n, k, args.dtype, 0.02) for _ in range(args.layers)]
        weights[name] = ws if args.dtype == "bf16" else [(w, s.reshape(1, -1).contiguous()) for w, s in ws]
    totals = {}  # (rows, variant) -> us over the four products
    each = {}  # (rows, product, variant) -> us
    for rows in map(int, args.rows.split(",")):
        for name, n, k in shapes:
            x = operand(rows, k, args.dtype)
            xs = [x] * args.layers
            ref = fns["cublas"](x, weights[name][0]).float()
            for vname, fn in fns.items():
                err = ((fn(x, weights[name][0]).float() - ref).norm() / ref.norm()).item()
                us = time_chain(fn, xs, weights[name])
                totals[(rows, vname)] = totals.get((rows, vname), 0.0) + us
                each[(rows, name, vname)] = us
                print(json.dumps(dict(bench="batch_gemm", dtype=args.dtype, model=args.model, rows=rows,
                                      product=name, n=n, k=k, variant=vname,
                                      us=round(us, 2), tflops=round(2 * rows * n * k / us / 1e6, 1),
                                      rel_diff_vs_cublas=round(err, 5))), flush=True)
    table = []
    for rows in map(int, args.rows.split(",")):
        best = min((v for v in fns if v.startswith("triton_")), key=lambda v: totals[(rows, v)])
        cublas_us, best_us = totals[(rows, "cublas")], totals[(rows, best)]
        print(json.dumps(dict(bench="batch_gemm_layer", dtype=args.dtype, model=args.model, rows=rows,
                              cublas_us=round(cublas_us, 1), best_triton=best,
                              best_triton_us=round(best_us, 1), gain=round(cublas_us / best_us - 1, 3))))
        tile = list(map(int, best.split("_")[1:])) if best_us < cublas_us * (1 - MIN_GAIN) else None
        table.append([rows, tile])
    if args.dtype == "fp8":
        print("TILES_JSON=" + json.dumps({"triton_batch_gemm.FP8_TILES": table}))
        by_shape = [[[n, k], per_product_table(each, name, list(map(int, args.rows.split(","))))]
                    for name, n, k in shapes]
        print("TILES_BY_SHAPE_JSON=" + json.dumps({"triton_batch_gemm.FP8_TILES_BY_SHAPE": by_shape}))
    else:
        print(json.dumps(dict(bench="batch_gemm_table", dtype="bf16", table=table)))


if __name__ == "__main__":
    main()
