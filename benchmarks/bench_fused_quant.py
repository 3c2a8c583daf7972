"""The per-token fp8 quantization of the fp8 products' inputs on the GPU: fused into the RMSNorm
(+ residual) and the SiLU-and-mul that compute them (kernels/triton_fused_quant.py) against the
two launches it replaces (triton_ops' kernel, then triton_fp8.quantize_rows), on one model's
shapes and several row counts.

For each op and row count, a chain of `--layers` calls, each on inputs of its own, captured in one
CUDA graph and replayed (bench_skinny_gemm.time_chain): microseconds per call. Each row of the
output also says whether the fused fp8 values and scales equal the unfused ones bit for bit.

    python benchmarks/bench_fused_quant.py                       # Qwen3-8B: hidden 4096, intermediate 12288
    python benchmarks/bench_fused_quant.py --model 0.6b --rows 1,64
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_skinny_gemm import time_chain  # noqa: E402
from nanovllm.kernels import triton_fp8, triton_fused_quant, triton_ops  # noqa: E402
from nanovllm.layers.quantization import fp8  # noqa: E402

MODELS = {"8b": (4096, 12288), "0.6b": (1024, 3072)}  # (hidden size, intermediate size)
EPS = 1e-6


def _norm_variants(weight):
    """x is an (input, residual) pair."""
    def unfused(x, _):
        out, residual = triton_ops.rms_norm(x[0], weight, EPS, x[1])
        return (*triton_fp8.quantize_rows(out, fp8.FP8_DTYPE, fp8.MIN_SCALE), residual)

    def fused(x, _):
        return triton_fused_quant.rms_norm_per_token_quant(x[0], weight, EPS, x[1], fp8.FP8_DTYPE, fp8.MIN_SCALE)
    return {"unfused": unfused, "fused": fused}


def _silu_variants():
    def unfused(x, _):
        return triton_fp8.quantize_rows(triton_ops.silu_and_mul(x), fp8.FP8_DTYPE, fp8.MIN_SCALE)

    def fused(x, _):
        return triton_fused_quant.silu_and_mul_per_token_quant(x, fp8.FP8_DTYPE, fp8.MIN_SCALE)
    return {"unfused": unfused, "fused": fused}


def _same_bits(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x.view(torch.uint8) if x.dtype == fp8.FP8_DTYPE else x,
                           y.view(torch.uint8) if y.dtype == fp8.FP8_DTYPE else y) for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="8b")
    ap.add_argument("--rows", default="1,8,64,256,1024")
    ap.add_argument("--layers", type=int, default=36, help="calls (each on inputs of its own) a chain runs")
    args = ap.parse_args()
    hidden, intermediate = MODELS[args.model]
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = randn(hidden)
    for rows in map(int, args.rows.split(",")):
        cases = {"rms_norm": (_norm_variants(weight), [(randn(rows, hidden) * 3, randn(rows, hidden))
                                                       for _ in range(args.layers)]),
                 "silu_and_mul": (_silu_variants(), [randn(rows, 2 * intermediate) * 3 for _ in range(args.layers)])}
        for op, (variants, xs) in cases.items():
            us = {name: round(time_chain(fn, xs, [None] * len(xs)), 2) for name, fn in variants.items()}
            same = _same_bits(variants["fused"](xs[0], None), variants["unfused"](xs[0], None))
            print(json.dumps(dict(bench="fused_quant", model=args.model, op=op, rows=rows, us_per_call=us,
                                  fused_over_unfused=round(us["fused"] / us["unfused"], 3), same_bits=same)),
                  flush=True)


if __name__ == "__main__":
    main()
