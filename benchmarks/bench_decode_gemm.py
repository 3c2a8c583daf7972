"""B1's decode matrix products: cuBLAS against their floor, and a plain Triton GEMM.

In B1 the matrix products of a decode step (Qwen3-0.6B: four per layer and the LM head)
take ~17% of the GPU time, about 2.5x what reading the weights once needs. This script
times each product at the decode batch sizes B1 runs (torch's `F.linear`, i.e. cuBLAS,
replayed from CUDA graphs), sets it against its floor (the larger of weight bytes at copy
bandwidth and FLOPs at the measured bf16 matrix rate), and tries a plain Triton GEMM over
a small sweep of tiles, to see what a hand kernel could gain.

    python benchmarks/bench_decode_gemm.py [--batches 32,96,256]
    python benchmarks/bench_decode_gemm.py --b1   # B1 with decode products on an autotuned Triton kernel
    python benchmarks/bench_decode_gemm.py --splitk --batches 8,32,96   # split-K kernel vs cuBLAS
"""
import argparse
import json

import torch
import triton
import triton.language as tl
import triton.testing

from bench_offline import copy_bandwidth

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 1024, 3072, 16, 8, 128, 151936, 28
# name -> (in features, out features, times per step)
PRODUCTS = {
    "qkv_proj": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, LAYERS),
    "o_proj": (HEADS * HEAD_DIM, HIDDEN, LAYERS),
    "gate_up_proj": (HIDDEN, 2 * INTERMEDIATE, LAYERS),
    "down_proj": (INTERMEDIATE, HIDDEN, LAYERS),
    "lm_head": (HIDDEN, VOCAB, 1),
}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_M is capped at the padded batch
CONFIGS = [(m, n, k, w, s) for m in (16, 64, 128) for n in (32, 64, 128) for k in (64, 128)
           for w in (4,) for s in (4,)]
REP_MS = 25
MAX_TRITON_ROWS = 512  # --b1: larger products (prefill) stay on cuBLAS


@triton.jit
def _linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out = x @ w.T for x [M, K], w [N, K] (a linear layer's weight); K % BLOCK_K == 0."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k + ks)[None, :], mask=rows[:, None] < M, other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + (k + ks)[None, :], mask=cols[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def triton_linear(x, w, out, block_m, block_n, block_k, num_warps, num_stages):
    m, k = x.shape
    n = w.shape[0]
    assert k % block_k == 0
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _linear_kernel[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         num_warps=num_warps, num_stages=num_stages)
    return out


@triton.autotune(configs=[triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k), num_warps=w, num_stages=st)
                          for m, n, k, w, st in CONFIGS],
                 key=["M_BUCKET", "N", "K"], prune_configs_by={"early_config_prune": lambda configs, args, **kw: [
                     c for c in configs if c.kwargs["BLOCK_M"] <= max(16, args["M_BUCKET"])]},
                 warmup=3, rep=10)
@triton.jit
def _tuned_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, M_BUCKET,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, BLOCK_M, BLOCK_N, BLOCK_K)


def tuned_linear(x, weight, bias=None):
    """F.linear with decode-sized bf16 products on the autotuned Triton kernel (for --b1)."""
    m, k = x.shape if x.dim() == 2 else (0, 0)
    if (bias is not None or not x.is_cuda or x.dim() != 2 or not 0 < m <= MAX_TRITON_ROWS
            or x.stride(1) != 1 or k % 128 or x.dtype != torch.bfloat16):
        return torch.nn.functional.linear(x, weight, bias)
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))  # noqa: E731
    _tuned_linear_kernel[grid](x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                               triton.next_power_of_2(m))
    return out


def run_b1_with_triton_linear(bench_args: list[str]) -> None:
    """B1 (bench_offline.py) with the model's products of <= MAX_TRITON_ROWS rows on the tuned kernel."""
    import runpy
    import sys
    from nanovllm.layers import embed_head, linear

    class Functional:  # torch.nn.functional with `linear` replaced
        def __getattr__(self, name):
            return tuned_linear if name == "linear" else getattr(torch.nn.functional, name)
    linear.F = embed_head.F = Functional()
    sys.argv = ["bench_offline.py", *bench_args]
    runpy.run_path(__file__.replace("bench_decode_gemm.py", "bench_offline.py"), run_name="__main__")


def matmul_rate() -> float:
    """bf16 FLOP/s of a large square product (the compute floor's rate)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = triton.testing.do_bench(lambda: a @ a, rep=200)
    return 2 * 8192 ** 3 / (ms / 1e3)


def operands_and_cublas(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """x [m, k], w [n, k] in bf16, cuBLAS's x @ w.T (float32) and its seconds in a CUDA graph."""
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
    ref = torch.nn.functional.linear(x, w).float()
    cublas_s = triton.testing.do_bench_cudagraph(lambda: torch.nn.functional.linear(x, w), rep=REP_MS) / 1e3
    return x, w, ref, cublas_s


def bench_product(m: int, k: int, n: int, bandwidth: float, rate: float) -> dict:
    x, w, ref, cublas_s = operands_and_cublas(m, k, n)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    best = None
    for bm, bn, bk, warps, stages in CONFIGS:
        if bm > max(16, triton.next_power_of_2(m)):
            continue
        try:
            triton_linear(x, w, out, bm, bn, bk, warps, stages)
        except triton.runtime.errors.OutOfResources:
            continue  # tiles too large for shared memory
        assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2), (bm, bn, bk)
        s = triton.testing.do_bench_cudagraph(
            lambda: triton_linear(x, w, out, bm, bn, bk, warps, stages), rep=REP_MS) / 1e3
        if best is None or s < best[0]:
            best = (s, (bm, bn, bk, warps, stages))
    floor_s = max(n * k * 2 / bandwidth, 2 * m * n * k / rate)
    return {"cublas_us": round(cublas_s * 1e6, 2), "triton_us": round(best[0] * 1e6, 2),
            "triton_config": best[1], "floor_us": round(floor_s * 1e6, 2)}


SPLITK_STAGES = 3
SPLITK_CONFIGS = [(n, k, s, SPLITK_STAGES) for n in (32, 64, 128) for k in (64, 128, 256) for s in (1, 2, 4, 8)]


def splitk_block_ms(m: int) -> list[int]:
    small = max(16, triton.next_power_of_2(m))
    return sorted({min(small, 64), min(small, 128)})


def bench_splitk(m: int, k: int, n: int) -> dict:
    """The split-K kernel (splitk_linear.py) over SPLITK_CONFIGS, against cuBLAS."""
    from splitk_linear import splitk_linear
    x, w, ref, cublas_s = operands_and_cublas(m, k, n)
    results = []
    for bm in splitk_block_ms(m):
        for bn, bk, split, stages in SPLITK_CONFIGS:
            if k % (bk * split):
                continue
            cfg = (bm, bn, bk, split, stages)
            try:
                out = splitk_linear(x, w, bm, bn, bk, split, num_stages=stages)
            except triton.runtime.errors.OutOfResources:
                continue
            assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2), cfg
            assert torch.equal(out, splitk_linear(x, w, bm, bn, bk, split, num_stages=stages)), cfg
            t = triton.testing.do_bench_cudagraph(
                lambda: splitk_linear(x, w, bm, bn, bk, split, num_stages=stages), rep=REP_MS) / 1e3
            results.append((t, cfg))
    results.sort()
    return {"cublas_us": round(cublas_s * 1e6, 2), "splitk_us": round(results[0][0] * 1e6, 2),
            "best": [(round(t * 1e6, 2), c) for t, c in results[:4]]}


def bench_chain(m: int, configs: dict) -> dict:
    """28 layers' four products back to back (distinct, cold weights), cuBLAS vs split-K."""
    from splitk_linear import splitk_linear
    names = [p for p in PRODUCTS if p != "lm_head"]
    layers = [{p: torch.randn(PRODUCTS[p][1], PRODUCTS[p][0], dtype=torch.bfloat16, device="cuda") * 0.02
               for p in names} for _ in range(LAYERS)]
    xs = {p: torch.randn(m, PRODUCTS[p][0], dtype=torch.bfloat16, device="cuda") for p in names}

    def cublas():
        for lw in layers:
            for p in names:
                torch.nn.functional.linear(xs[p], lw[p])

    def splitk():
        for lw in layers:
            for p in names:
                bm, bn, bk, split, stages = configs[p]
                splitk_linear(xs[p], lw[p], bm, bn, bk, split, num_stages=stages)
    return {f: round(triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3 / LAYERS, 2)
            for f, fn in (("cublas_us_per_layer", cublas), ("splitk_us_per_layer", splitk))}


def main_splitk(batches: list[int]) -> None:
    for m in batches:
        configs = {}
        for name, (k, n, _) in PRODUCTS.items():
            if name == "lm_head":  # one large product: cuBLAS reaches its floor
                continue
            r = bench_splitk(m, k, n)
            configs[name] = r["best"][0][1]
            print(json.dumps({"batch": m, "product": name, **r}), flush=True)
        print(json.dumps({"batch": m, "chain": bench_chain(m, configs)}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="32,96,256", help="decode batch sizes (graph sizes)")
    ap.add_argument("--b1", action="store_true",
                    help="instead: run B1 with decode products on the autotuned Triton kernel")
    ap.add_argument("--splitk", action="store_true",
                    help="instead: the split-K kernel (splitk_linear.py) against cuBLAS")
    args, rest = ap.parse_known_args()
    if args.splitk:
        return main_splitk([int(b) for b in args.batches.split(",")])
    if args.b1:
        return run_b1_with_triton_linear(rest)
    bandwidth, rate = copy_bandwidth(), matmul_rate()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matrix rate {rate / 1e12:.0f} TFLOP/s")
    for m in (int(b) for b in args.batches.split(",")):
        step = {"cublas_us": 0.0, "triton_us": 0.0, "floor_us": 0.0}
        for name, (k, n, times) in PRODUCTS.items():
            r = bench_product(m, k, n, bandwidth, rate)
            print(json.dumps({"batch": m, "product": name, **r}))
            for key in step:
                step[key] += times * r[key]
        print(json.dumps({"batch": m, "per_step": {k: round(v, 1) for k, v in step.items()}}))


if __name__ == "__main__":
    main()
