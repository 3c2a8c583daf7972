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
reduction dimension, in one of two forms. Where a program's weight slab is small
(`WHOLE_ROW_MAX_BYTES`: every Qwen3-0.6B layer product), it loads the whole slab at once, before
waiting for the kernel ahead (programmatic dependent launch, kernels/triton_pdl.py: the weights
stream in while that kernel finishes), and sums it over K once. Larger slabs loop over K
(unrolled for short reductions, software-pipelined for long ones), each iteration's sum crossing
the warps through shared memory (sm_90 code of triton 3.6), and let the next kernel start only
after the loop. Products and sums are float32 on the CUDA cores (the tensor cores would idle at
one row), rounded once to the output dtype; the weight is read once, in 16-byte loads. The
0.6B's four products took 3.2 / 2.3 / 4.4 / 2.8 us (q/k/v, o, gate/up, down) against cuBLAS's
4.9 / 12.8 / 6.0 / 6.5 (RESULTS.md "Fourteenth session"). The kernels around them come in too
(`skinny_norm_linear`, for models/decoder.py's one-row layers): the RMSNorm (+ residual add)
before q/k/v and gate/up, recomputed by every program from the row (a few KB, from L2), and
SiLU-and-mul after gate/up (three launches fewer a layer). They round where the kernels they
replace round (triton_ops' RMSNorm and SiLU-and-mul), but the products' float32 sums run in
another order (another BLOCK_N for gate/up as one product or two halves), so the results
match the unfused ones to rounding, not bit for bit.

Compiled variants, per model: one per (weight shape's reduction length `K`, `BLOCK_N`,
`BLOCK_M`, dtype, bias or not, norm with or without a residual, gated or not; the form follows
from these; `PDL` is fixed per device); `BLOCK_M` is the row count rounded up to a power of two,
1 in the engine (MAX_ROWS), whose one-sequence decode engine/warmup.py runs at start-up (its
first layer's norm has no residual, the others do); the row count itself is `do_not_specialize`.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.triton_attn import num_sms
from nanovllm.kernels.triton_ops import inv_rms, rms_scaled, silu_mul
from nanovllm.kernels.triton_pdl import launch_dependents, launch_options, wait_for_prior_grid

# Rows up to which a dense 16-bit product on the GPU runs here instead of cuBLAS. At one row
# the kernel beat cuBLAS on all eight decode products of Qwen3-0.6B and Qwen3-8B (0.6B: 3.8-5.0
# against 4.9-12.8 us; 8B: 10.9-49.5 against 12.5-49.7 us); at two rows it lost on six of them
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
# One row whose program's weight slab ([BLOCK_N, K padded to a power of two], gate and up together)
# takes at most this many bytes loads it whole, before waiting for the kernel ahead (triton_pdl),
# and sums it over K once. 32 registers a thread hold the 16-bit slab (16 KiB at 4 warps: every
# Qwen3-0.6B layer product; the 8B's and the LM head's slabs are larger and loop); its float32
# products and the row come on top (40-64 registers a thread in all, sm_90 code of triton 3.6).
# In the looped form's code each iteration's sum crosses the warps through shared memory and holds
# back the next iteration's loads.
WHOLE_ROW_SLAB_REGISTERS = 32
WHOLE_ROW_MAX_BYTES = WHOLE_ROW_SLAB_REGISTERS * 4 * 32 * NUM_WARPS  # 4-byte registers, 32 threads a warp


@triton.jit
def _row_inv_rms(x_ptr, res_ptr, res_out_ptr, eps, K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
             NORM_BLOCK: tl.constexpr):
    """1 / rms of the row x (+ residual), as triton_ops' RMSNorm kernel computes it; program 0
    writes x + residual to res_out."""
    ks = tl.arange(0, NORM_BLOCK)
    k_ok = ks < K
    x = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + ks, mask=k_ok, other=0.0)
        if tl.program_id(0) == 0:
            tl.store(res_out_ptr + ks, x, mask=k_ok)
    return inv_rms(x.to(tl.float32), K, eps)


@triton.jit
def _load_x(x_ptr, res_ptr, norm_w_ptr, row_inv_rms, row_start, ks, x_ok,
            NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Elements `ks` of a row of x as the product reads them (float32): x itself, or with NORM
    norm_w * (x + residual) / rms, rounded to x's dtype where triton_ops' RMSNorm rounds."""
    x = tl.load(x_ptr + row_start + ks, mask=x_ok, other=0.0)
    if NORM:
        if HAS_RESIDUAL:
            x = x + tl.load(res_ptr + ks, mask=x_ok, other=0.0)
        x = rms_scaled(x, row_inv_rms, tl.load(norm_w_ptr + ks, mask=x_ok, other=0.0))
    return x.to(tl.float32)


@triton.jit
def _whole_row(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_rows, up_rows, col_ok, eps,
               K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
               GATED: tl.constexpr, PDL: tl.constexpr):
    """One row against the program's whole weight slab, loaded before waiting for the kernel
    ahead (triton_pdl) and summed over K once. Returns (acc, acc_up), each [BLOCK_N, 1]."""
    ks = tl.arange(0, K_PAD)
    k_ok = ks < K
    w_ok = col_ok[:, None] & k_ok[None, :]
    w = tl.load(w_rows + ks[None, :], mask=w_ok, other=0.0)  # [BLOCK_N, K_PAD], the weight's dtype
    w_up = w
    if GATED:
        w_up = tl.load(up_rows + ks[None, :], mask=w_ok, other=0.0)
    wait_for_prior_grid(PDL)
    row_inv_rms = 1.0
    if NORM:
        row_inv_rms = _row_inv_rms(x_ptr, res_ptr, res_out_ptr, eps, K, HAS_RESIDUAL, K_PAD)
    x = _load_x(x_ptr, res_ptr, norm_w_ptr, row_inv_rms, 0, ks, k_ok, NORM, HAS_RESIDUAL)  # [K_PAD]
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)[:, None]
    acc_up = acc
    if GATED:
        acc_up = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)[:, None]
    return acc, acc_up


@triton.jit
def _looped(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_rows, up_rows, col_ok, num_rows, stride_xm, eps,
            K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            UNROLL: tl.constexpr, NUM_STAGES: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
            NORM_BLOCK: tl.constexpr, GATED: tl.constexpr):
    """Every row against the program's weight rows, BLOCK_K elements of K at a time, each
    iteration's products summed as it goes. Returns (acc, acc_up), each [BLOCK_N, BLOCK_M]."""
    rows = tl.arange(0, BLOCK_M)
    row_inv_rms = 1.0
    if NORM:
        row_inv_rms = _row_inv_rms(x_ptr, res_ptr, res_out_ptr, eps, K, HAS_RESIDUAL, NORM_BLOCK)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # [features, rows]; the gate's when GATED
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, loop_unroll_factor=UNROLL, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w_ok = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_ok, other=0.0).to(tl.float32)
        if GATED:
            w_up = tl.load(up_rows + ks[None, :], mask=w_ok, other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            x_ok = k_ok & (tl.zeros_like(ks) + m < num_rows)  # a row past num_rows: zeros
            x = _load_x(x_ptr, res_ptr, norm_w_ptr, row_inv_rms, m * stride_xm, ks, x_ok, NORM, HAS_RESIDUAL)
            acc += tl.where(rows[None, :] == m, tl.sum(w * x[None, :], axis=1)[:, None], 0.0)
            if GATED:
                acc_up += tl.where(rows[None, :] == m, tl.sum(w_up * x[None, :], axis=1)[:, None], 0.0)
    return acc, acc_up


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_gemm_kernel(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, bias_ptr, y_ptr,
                        num_rows, N, stride_xm, stride_wn, stride_ym, eps,
                        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        UNROLL: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_BIAS: tl.constexpr,
                        NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM_BLOCK: tl.constexpr,
                        GATED: tl.constexpr, WHOLE_ROW: tl.constexpr, PDL: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for BLOCK_N features n and every row m.

    NORM (one row): x is first RMSNorm(x (+ residual)) with weight norm_w (`_load_x`).
    GATED: w holds gate (rows 0..N-1) and up (rows N..2N-1), and y = silu(x gate^T) * (x up^T),
    each product rounded to y's dtype first, as triton_ops' SiLU-and-mul rounds them.
    WHOLE_ROW (one row, K_PAD = NORM_BLOCK): `_whole_row`; else `_looped`."""
    tl.static_assert(BLOCK_M == 1 or not (NORM or WHOLE_ROW), "the fused RMSNorm and WHOLE_ROW take one row")
    tl.static_assert(NORM_BLOCK >= K, "NORM_BLOCK covers the row")
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    col_ok = cols < N
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    up_rows = w_ptr + (cols + N).to(tl.int64)[:, None] * stride_wn  # GATED: the up half's rows
    if WHOLE_ROW:  # one wave of short programs: the next kernel may start (and load its weights) now
        launch_dependents(PDL)
        acc, acc_up = _whole_row(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_rows, up_rows, col_ok, eps,
                                 K, NORM_BLOCK, NORM, HAS_RESIDUAL, GATED, PDL)
    else:
        wait_for_prior_grid(PDL)
        acc, acc_up = _looped(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_rows, up_rows, col_ok, num_rows,
                              stride_xm, eps, K, BLOCK_M, BLOCK_N, BLOCK_K, UNROLL, NUM_STAGES, NORM,
                              HAS_RESIDUAL, NORM_BLOCK, GATED)
        # only now: started at the kernel's beginning, the next one made the Qwen3-8B's looped
        # one-row products 10-20% slower (RESULTS.md "Fourteenth session"; the cause not profiled)
        launch_dependents(PDL)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    y = acc.to(y_ptr.dtype.element_ty)
    if GATED:
        y = silu_mul(y.to(tl.float32), acc_up.to(y_ptr.dtype.element_ty))
    rows = tl.arange(0, BLOCK_M)
    out = y_ptr + rows[None, :] * stride_ym + cols[:, None]
    tl.store(out, y, mask=col_ok[:, None] & (rows[None, :] < num_rows))


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


def whole_row(num_rows: int, bn: int, k: int, gated: bool, element_size: int) -> bool:
    """Whether a product runs in the whole-row form: one row, and a program's weight slab
    ([bn, k] padded to a power of two, gate and up together) within WHOLE_ROW_MAX_BYTES."""
    return num_rows == 1 and (2 if gated else 1) * bn * triton.next_power_of_2(k) * element_size <= WHOLE_ROW_MAX_BYTES


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [num_rows, K] @ weight [N, K].T (+ bias [N]) -> [num_rows, N]; the engine sends
    num_rows <= MAX_ROWS (`applies`), any count computes."""
    assert x.shape[0] > 0
    return _launch(x, weight, bias, None, 0.0, gated=False)


class FusedNorm(NamedTuple):
    """The RMSNorm a one-row product's input goes through first (`skinny_norm_linear`)."""
    residual: torch.Tensor | None  # [1, K], added to x first; None: x alone
    weight: torch.Tensor           # [K]
    residual_out: torch.Tensor     # [1, K]: where x + residual goes (x itself without a residual)


def skinny_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None,
                       gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: (RMSNorm(x + residual) @ weight.T (+ bias), x + residual), the norm computed
    inside the product (layers/layernorm.py's RMSNorm, then the linear layer, in one launch);
    without a residual, x itself is returned as the new one. `gated`: weight is gate | up and
    the result silu(gate) * up, SiLU-and-mul fused in too.

    x, residual: [1, K]; norm_weight: [K]; weight: [N, K] ([2N, K] gated) -> [1, N], [1, K]
    """
    assert x.shape[0] == 1 and x.is_contiguous() and (residual is None or residual.is_contiguous())
    res_out = torch.empty_like(x) if residual is not None else x
    y = _launch(x, weight, bias, FusedNorm(residual, norm_weight, res_out), eps, gated)
    return y, res_out


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: FusedNorm | None,
            eps: float, gated: bool) -> torch.Tensor:
    """The kernel over x's rows, with `norm` fused in where given."""
    num_rows, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    assert weight.shape[1] == k and not (gated and bias is not None)
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    # pointers the kernel's flags leave unread (no norm, no residual, no bias) get any tensor
    residual, norm_weight, res_out = norm if norm is not None else (None, x, x)
    bn = block_n(n, num_sms(x.device))
    bk = min(BLOCK_K, triton.next_power_of_2(k))
    unrolled = k <= UNROLLED_MAX_K
    k_pad = triton.next_power_of_2(k)
    _skinny_gemm_kernel[(triton.cdiv(n, bn),)](
        x, x if residual is None else residual, norm_weight, res_out, weight, y if bias is None else bias, y,
        num_rows, n, x.stride(0), weight.stride(0), y.stride(0), eps,
        K=k, BLOCK_M=triton.next_power_of_2(num_rows), BLOCK_N=bn, BLOCK_K=bk,
        UNROLL=triton.cdiv(k, bk) if unrolled else 1, NUM_STAGES=1 if unrolled else PIPELINE_STAGES,
        HAS_BIAS=bias is not None, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
        NORM_BLOCK=k_pad, GATED=gated, WHOLE_ROW=whole_row(num_rows, bn, k, gated, weight.element_size()),
        num_warps=NUM_WARPS, **launch_options(x.device))
    return y
