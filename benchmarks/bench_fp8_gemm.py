"""fp8 rowwise products on the GPU at decode batch sizes: cuBLAS's `_scaled_mm` against
kernels/triton_fp8.py's `scaled_fp8_linear` in several tiles.

For each Qwen3-8B decode product (q/k/v, o, gate/up, down) and row count, a chain of
`--layers` products, each on its own e4m3 weight (together far beyond L2, as in a decode
step), captured in one CUDA graph and replayed: microseconds per product (the activations'
per-token quantization is the same for every variant and not timed). Then, per row count,
the fastest Triton tile against cuBLAS (with fast accumulation, the engine's), and the
`ROWWISE_TILES` table that takes Triton where it won by more than MIN_GAIN: printed as a
constants JSON for `bench_fp8.py --attn-constants`.

    python benchmarks/bench_fp8_gemm.py
    python benchmarks/bench_fp8_gemm.py --rows 64,256 --tiles '[[64, 64, 128, 4, 4]]'
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_skinny_gemm import time_chain  # noqa: E402
from nanovllm.kernels import triton_fp8  # noqa: E402
from nanovllm.layers.quantization import fp8  # noqa: E402

SHAPES_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TILES = [(64, 64, 128, 4, 4), (64, 32, 128, 4, 5), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4),
         (64, 64, 256, 4, 3), (128, 128, 128, 8, 3)]
MIN_GAIN = 0.03  # Triton takes a row bucket only where it is this much faster over the four products


def variants(tiles):
    def cublas(fast):
        return lambda x, w: torch._scaled_mm(x[0], w[0].t(), scale_a=x[1], scale_b=w[1], out_dtype=torch.bfloat16,
                                             use_fast_accum=fast)

    def triton_tile(tile):
        return lambda x, w: triton_fp8.scaled_fp8_linear(x[0], x[1], w[0], w[1], tile)
    return {"cublas_fast": cublas(True), "cublas": cublas(False),
            **{"triton_" + "_".join(map(str, t)): triton_tile(tuple(t)) for t in tiles}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,32,64,128,192,256")
    ap.add_argument("--layers", type=int, default=12, help="distinct weights a chain runs through")
    ap.add_argument("--tiles", default=json.dumps(TILES))
    args = ap.parse_args()
    tiles = [tuple(t) for t in json.loads(args.tiles)]
    fns = variants(tiles)
    weights = {}
    for name, n, k in SHAPES_8B:
        ws = []
        for _ in range(args.layers):
            w, s = fp8.quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
            ws.append((w, s.reshape(1, -1).contiguous()))
        weights[name] = ws
    totals = {}  # (rows, variant) -> us over the four products
    for rows in map(int, args.rows.split(",")):
        for name, n, k in SHAPES_8B:
            x = fp8.quantize_rows(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
            xs = [x] * args.layers
            ref = fns["cublas"](x, weights[name][0]).float()
            for vname, fn in fns.items():
                err = ((fn(x, weights[name][0]).float() - ref).norm() / ref.norm()).item()
                us = time_chain(fn, xs, weights[name])
                totals[(rows, vname)] = totals.get((rows, vname), 0.0) + us
                print(json.dumps(dict(bench="fp8_rowwise", rows=rows, product=name, n=n, k=k, variant=vname,
                                      us=round(us, 2), tflops=round(2 * rows * n * k / us / 1e6, 1),
                                      rel_diff_vs_cublas=round(err, 5))), flush=True)
    table = []
    for rows in map(int, args.rows.split(",")):
        best = min((v for v in fns if v.startswith("triton_")), key=lambda v: totals[(rows, v)])
        cublas_us, best_us = totals[(rows, "cublas_fast")], totals[(rows, best)]
        print(json.dumps(dict(bench="fp8_rowwise_layer", rows=rows, cublas_fast_us=round(cublas_us, 1),
                              cublas_us=round(totals[(rows, "cublas")], 1), best_triton=best,
                              best_triton_us=round(best_us, 1), gain=round(cublas_us / best_us - 1, 3))))
        tile = list(map(int, best.split("_")[1:])) if best_us < cublas_us * (1 - MIN_GAIN) else None
        table.append([rows, tile])
    print("ROWWISE_TILES_JSON=" + json.dumps({"triton_fp8.ROWWISE_TILES": table}))


if __name__ == "__main__":
    main()
