"""Decode products with and without an L2 prefetch of their weights (l2_prefetch.py): an experiment.

Result (RESULTS.md "B1"): no gain. Even with every weight already in L2 (`--extra`,
variant `hot`) the products take 84-96% of their cold time: their cost is per launch,
not the memory latency a prefetch hides.

A chain of 28 Qwen3-0.6B layers' decode products, replayed from a CUDA graph: per layer
the q/k/v product, a streaming copy standing in for attention (it evicts L2, as
attention's K/V reads do), then o, gate_up, SiLU-and-mul and down. Variants insert
`WeightPrefetch` launches at the points the engine can use (after attention, after
gate_up). Prints microseconds per layer, and the same chain without the stand-in.

    python benchmarks/bench_l2_prefetch.py [--batches 32,96,256] [--standin-mib 64] [--extra]
"""
import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from bench_decode_gemm import HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS
from l2_prefetch import CHUNK_BYTES, WeightPrefetch
from nanovllm.kernels import triton_ops

REP_MS = 50
# variant -> (weights prefetched after attention, weights prefetched after gate_up);
# names: o, gu (gate_up), down, next (the next layer's q/k/v)
PLANS = {
    "none": ((), ()),
    "attn": (("o", "gu", "down", "next"), ()),
    "attn3": (("o", "gu", "down"), ()),
    "split": (("o", "gu"), ("down", "next")),
    "attn_mlp": (("o", "gu", "down"), ("next",)),
}


def make_layers():
    def w(n, k):
        return torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
    return [dict(qkv=w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), o=w(HIDDEN, HEADS * HEAD_DIM),
                 gu=w(2 * INTERMEDIATE, HIDDEN), down=w(HIDDEN, INTERMEDIATE)) for _ in range(LAYERS)]


def chain(layers, x, attn_out, standin, plan, chunk):
    """Returns a function running the 28-layer chain with `plan`'s prefetches."""
    after_attn, after_gu = PLANS[plan]
    hooks = []
    for i, lw in enumerate(layers):
        named = dict(lw, next=layers[i + 1]["qkv"] if i + 1 < len(layers) else None)
        make = lambda names: WeightPrefetch([named[n] for n in names if named[n] is not None], chunk) \
            if any(named[n] is not None for n in names) else None  # noqa: E731
        hooks.append((make(after_attn), make(after_gu)))

    def run():
        h = x
        for lw, (pre_o, pre_down) in zip(layers, hooks):
            F.linear(h, lw["qkv"])
            if standin is not None:
                torch.mul(standin[0], 1, out=standin[1])
            if pre_o is not None:
                pre_o()
            h = F.linear(attn_out, lw["o"])
            gu = F.linear(h, lw["gu"])
            if pre_down is not None:
                pre_down()
            h = F.linear(triton_ops.silu_and_mul(gu), lw["down"])
        return h
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="32,96,256")
    ap.add_argument("--standin-mib", type=int, default=64, help="bytes the attention stand-in copies")
    ap.add_argument("--extra", action="store_true",
                    help="instead: weights already in L2 (hot), and cuBLASLt as torch's BLAS")
    ap.add_argument("--chunks", default=f"4096,{CHUNK_BYTES},65536", help="chunk sizes tried for plan 'attn'")
    args = ap.parse_args()
    layers = make_layers()
    n = args.standin_mib << 19
    standin = (torch.randn(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda"))
    alone = triton.testing.do_bench_cudagraph(lambda: [torch.mul(standin[0], 1, out=standin[1])
                                                       for _ in range(LAYERS)], rep=REP_MS) * 1e3 / LAYERS
    print(json.dumps({"standin_us_per_layer": round(alone, 2)}))
    variants = [(p, CHUNK_BYTES) for p in PLANS] + [("attn", int(c)) for c in args.chunks.split(",")
                                                    if int(c) != CHUNK_BYTES]
    if args.extra:  # hot: one layer's weights for all 28 (they stay in L2); cublaslt*: torch on cuBLASLt
        variants = [("none", CHUNK_BYTES), ("attn", CHUNK_BYTES), ("hot", 0), ("cublaslt", 0),
                    ("cublaslt_attn", CHUNK_BYTES)]
    for m in (int(b) for b in args.batches.split(",")):
        x = torch.randn(m, HIDDEN, dtype=torch.bfloat16, device="cuda")
        attn_out = torch.randn(m, HEADS * HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        ref = chain(layers, x, attn_out, None, "none", CHUNK_BYTES)()
        for plan, chunk in variants:
            row = {"batch": m, "plan": plan, "chunk": chunk}
            torch.backends.cuda.preferred_blas_library("cublaslt" if plan.startswith("cublaslt") else "cublas")
            lw = [layers[0]] * LAYERS if plan == "hot" else layers
            p = {"hot": "none", "cublaslt": "none", "cublaslt_attn": "attn"}.get(plan, plan)
            for label, s in (("with_standin", standin), ("products_only", None)):
                fn = chain(lw, x, attn_out, s, p, chunk)
                if plan not in ("hot", "cublaslt", "cublaslt_attn"):
                    assert torch.equal(fn(), ref)  # a prefetch is only a hint: same numbers
                us = triton.testing.do_bench_cudagraph(fn, rep=REP_MS) * 1e3 / LAYERS
                row[label + "_us"] = round(us, 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
