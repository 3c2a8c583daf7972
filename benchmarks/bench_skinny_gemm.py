"""Skinny products (a few rows) on the GPU: cuBLAS against kernels/triton_skinny_gemm.py.

For each decode product of a model shape (Qwen3-0.6B and Qwen3-8B: q/k/v, o, gate/up,
down), a chain of `--layers` products, each on its own weight (together far beyond L2,
as in a decode step, where every layer's weights come from HBM), captured in one CUDA
graph and replayed; microseconds per product, and the weight's bytes over that time
against the copy bandwidth measured in the same run. With `--variants`, the skinny
kernel's module constants are set per variant (JSON: name -> constants). The kernel is
timed at every row count asked for (the engine sends it MAX_ROWS rows at most); the fused
norm / SiLU forms (`skinny_norm_linear`) are not timed here (bench_long_context.py
measures them in the engine).

    python benchmarks/bench_skinny_gemm.py
    python benchmarks/bench_skinny_gemm.py --rows 1,2,4,8 --variants '{"k1024": {"BLOCK_K": 1024}}'
    python benchmarks/bench_skinny_gemm.py --rows 1 --variants '{"looped": {"WHOLE_ROW_MAX_BYTES": 0}, "no_pdl": {"PDL": false}}'
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_long_context import tile_constants  # noqa: E402
from bench_offline import copy_bandwidth  # noqa: E402
from nanovllm.kernels import triton_pdl, triton_skinny_gemm  # noqa: E402

# (name, N, K) of each model's decode products
SHAPES = {
    "0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)],
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)],
}
REPLAYS = 50


def time_chain(fn, xs, ws) -> float:
    """Microseconds per product of `fn(x, w)` over the chain of weights, from a CUDA graph."""
    for x, w in zip(xs, ws):
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w in zip(xs, ws):
            fn(x, w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / REPLAYS / len(ws)


def skinny_with(constants: dict):
    """The skinny product with the module's constants set to `constants` for each call
    ("PDL": kernels/triton_pdl.py's ENABLED)."""
    constants = dict(constants)
    pdl = constants.pop("PDL", triton_pdl.ENABLED)

    def fn(x, w):
        with tile_constants(triton_skinny_gemm, **constants), tile_constants(triton_pdl, ENABLED=pdl):
            return triton_skinny_gemm.skinny_linear(x, w, None)
    return fn


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.6b,8b")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--layers", type=int, default=28, help="distinct weights a chain runs through")
    ap.add_argument("--variants", default="{}", help="JSON {name: skinny kernel constants}; 'default' is added")
    args = ap.parse_args()
    bw = copy_bandwidth()
    variants = {"default": {}, **json.loads(args.variants)}
    results = []
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            layers = args.layers if model == "0.6b" else max(4, args.layers // 4)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            floor_us = n * k * 2 / bw * 1e6
            for rows in (int(r) for r in args.rows.split(",")):
                xs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
                ref = F.linear(xs[0], ws[0]).float()
                row = {"model": model, "product": name, "N": n, "K": k, "rows": rows, "floor_us": round(floor_us, 2),
                       "cublas_us": round(time_chain(lambda x, w: F.linear(x, w), xs, ws), 2)}
                for vname, constants in variants.items():
                    fn = skinny_with(constants)
                    err = ((fn(xs[0], ws[0]).float() - ref).abs().max() / ref.abs().max()).item()
                    assert err < 1e-2, f"{vname} {name} rows {rows}: relative error {err}"
                    row[vname + "_us"] = round(time_chain(fn, xs, ws), 2)
                results.append(row)
                best = min((v for v in row if v.endswith("_us") and v != "floor_us"), key=row.get)
                print(f"{model:5} {name:8} N={n:6} K={k:6} rows={rows}: floor {floor_us:6.2f} us, cuBLAS "
                      f"{row['cublas_us']:6.2f}, " + ", ".join(f"{v[:-3]} {row[v]:6.2f}" for v in row
                                                                if v.endswith("_us") and v not in
                                                                ("floor_us", "cublas_us"))
                      + f"  (best {best[:-3]}, {floor_us / row[best]:.2f} of copy bandwidth)", flush=True)
            del ws
    print(json.dumps({"bench": "skinny_gemm", "copy_bandwidth_gbs": round(bw / 1e9, 1), "results": results}))


if __name__ == "__main__":
    main()
