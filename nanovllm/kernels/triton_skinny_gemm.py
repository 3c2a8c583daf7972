"""Skinny products on the GPU: one row times a dense 16-bit weight, streamed from memory.

A decode step of one sequence multiplies one row by each layer's weight: a matrix-vector
product whose time is the weight's bytes over the memory bandwidth. cuBLAS's kernels for
these shapes ran far below it: one 32k-token sequence's decode on an H200 (a profile of
`benchmarks/bench_long_context.py --profile`, RESULTS.md "Thirteenth session") spent 11.9 us
on Qwen3-0.6B's 12.6 MB gate/up product (1.06 TB/s) and 4.9-5.3 us on each of the others:
the layers' products took 0.76 ms a step against the 0.18 ms their weights take at copy
bandwidth.

This kernel gives each program a few output features (`BLOCK_N` rows of the weight, chosen
so the grid has at least `PROGRAMS_PER_SM` programs a multiprocessor) across the whole
reduction dimension: short reductions unrolled, so every load of the program is issued
before the first product, long ones in a loop with a few loads in flight. The weight is
read once, in 16-byte loads. Products and sums are float32 on the CUDA cores (the tensor
cores would idle at one row), rounded once to the output dtype. With it that decode ran at
497 tok/s instead of 417, the layers' products 0.46 ms a step instead of 0.76: each still takes
3.8-5.0 us against a 1-3 us floor, most of it the latency of a kernel this short.

Compiled variants, per model: one per (weight shape's reduction length `K`, `BLOCK_N`,
`BLOCK_M`, dtype, bias or not); `BLOCK_M` is the row count rounded up to a power of two,
1 in the engine (MAX_ROWS), whose one-sequence decode engine/warmup.py runs at start-up; the
row count itself is `do_not_specialize`.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.triton_attn import _num_sms

# Rows up to which a dense 16-bit product on the GPU runs here instead of cuBLAS. At one row
# the kernel beat cuBLAS on all eight decode products of Qwen3-0.6B and Qwen3-8B (0.6B: 3.8-5.0
# against 4.9-6.6 us; 8B: 10.9-49.5 against 12.5-49.7 us); at two rows it lost on six of them
# (each row's sums cost cross-thread reductions), by up to 6.1 us on the 8B's down product
# (benchmarks/bench_skinny_gemm.py, RESULTS.md "Thirteenth session"). The kernel itself takes
# any row count (BLOCK_M, a power of two), for measuring.
MAX_ROWS = 1
BLOCK_K = 512          # reduction elements per load of a weight row
NUM_WARPS = 4
# Reductions of up to UNROLLED_MAX_K elements are unrolled (all loads issued at once); longer
# ones loop with PIPELINE_STAGES loads in flight. One row: unrolled 3.77 / 4.96 us for the
# 0.6B's q/k/v and gate/up (K = 1024) against 4.77 / 5.68 pipelined; pipelined 3.77 / 4.61 us
# for o (K = 2048) and down (K = 3072) against 4.38 / 5.81 unrolled.
UNROLLED_MAX_K = 1024
PIPELINE_STAGES = 3
PROGRAMS_PER_SM = 4    # BLOCK_N is the largest power of two that leaves at least this many
MIN_BLOCK_N = 2        # programs a multiprocessor, within [MIN_BLOCK_N, MAX_BLOCK_N]
MAX_BLOCK_N = 32


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_gemm_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, num_rows, N, stride_xm, stride_wn, stride_ym,
                        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        UNROLL: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for BLOCK_N features n and every row m."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # [features, rows]
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    for k0 in tl.range(0, K, BLOCK_K, loop_unroll_factor=UNROLL, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            x_ok = k_ok & (tl.zeros_like(ks) + m < num_rows)  # a row past num_rows: zeros
            x = tl.load(x_ptr + m * stride_xm + ks, mask=x_ok, other=0.0).to(tl.float32)
            part = tl.sum(w * x[None, :], axis=1)  # [BLOCK_N]
            acc += tl.where(rows[None, :] == m, part[:, None], 0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    out = y_ptr + rows[None, :] * stride_ym + cols[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=col_ok[:, None] & (rows[None, :] < num_rows))


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear` runs x @ weight.T: a GPU batch of at most MAX_ROWS rows and a
    16-bit weight whose rows are contiguous."""
    return (x.is_cuda and 0 < x.shape[0] <= MAX_ROWS and weight.dtype in (torch.float16, torch.bfloat16)
            and x.dtype == weight.dtype and weight.stride(1) == 1 and x.stride(-1) == 1)


def block_n(num_features: int, num_sms: int) -> int:
    """Output features a program computes: the grid fills every multiprocessor PROGRAMS_PER_SM
    times where the weight has the rows for it."""
    n = MAX_BLOCK_N
    while n > MIN_BLOCK_N and triton.cdiv(num_features, n) < PROGRAMS_PER_SM * num_sms:
        n //= 2
    return n


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [num_rows, K] @ weight [N, K].T (+ bias [N]) -> [num_rows, N]; the engine sends
    num_rows <= MAX_ROWS (`applies`), any count computes."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows > 0 and weight.shape[1] == k
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    bn = block_n(n, _num_sms(x.device))
    bk = min(BLOCK_K, triton.next_power_of_2(k))
    unrolled = k <= UNROLLED_MAX_K
    _skinny_gemm_kernel[(triton.cdiv(n, bn),)](
        x, weight, y if bias is None else bias, y, num_rows, n, x.stride(0), weight.stride(0), y.stride(0),
        K=k, BLOCK_M=triton.next_power_of_2(num_rows), BLOCK_N=bn, BLOCK_K=bk,
        UNROLL=triton.cdiv(k, bk) if unrolled else 1, NUM_STAGES=1 if unrolled else PIPELINE_STAGES,
        HAS_BIAS=bias is not None, num_warps=NUM_WARPS)
    return y

