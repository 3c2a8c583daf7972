"""Triton kernels of the fp8 linear path: per-token (row) quantization of activations,
and the product with a block-scaled fp8 weight (HF fine-grained FP8 checkpoints).

`quantize_rows(x)` is `layers/quantization/fp8.quantize_rows` in one launch (the torch
version is five elementwise kernels and a reduction per linear layer, which a decode step
of a 36-layer model pays 144 times): one program per row computes its amax, its scale
(amax / 448, at least MIN_SCALE) and the clamped e4m3 values (`quantize_row`, which the
RMSNorm and SiLU-and-mul of kernels/triton_fused_quant.py share, quantizing what they compute).

(The rowwise-scaled product of decode-sized batches: kernels/triton_batch_gemm.py.)

`block_fp8_linear(x, w, scale, block)`: y = x @ (w * scale)^T for an e4m3 weight [N, K]
with one float32 scale per `block` = (bn, bk) tile (`weight_scale_inv` [ceil(N/bn),
ceil(K/bk)]). Each program owns a BLOCK_M x BLOCK_N tile of y; its K loop steps one scale
block (BLOCK_K = bk) at a time, multiplies the bf16/fp16 activations by the fp8 tile cast
to their dtype, and adds the fp32 partial product times that block's scale (BLOCK_N divides
bn, so one scale per step): the weight moves once, at one byte an element.

Variants: quantize_rows: BLOCK = the row length rounded up to a power of two (one per
distinct input size of the model's linear layers, a bounded set fixed by the model
config). block_fp8_linear: BLOCK_K = bk and BLOCK_N = min(bn, 64) from the checkpoint's
block size, BLOCK_M from BLOCK_M_BY_ROWS (two entries: decode-sized and larger batches),
and the dtype. Row counts are grid sizes and `do_not_specialize` arguments, never constexprs.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.triton_pdl import launch_dependents, launch_options, wait_for_prior_grid

NUM_WARPS = 8


@triton.jit
def quantize_row(x, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """One row x [BLOCK] (lanes past the row zero) quantized with a scale of its own: (the clamped
    values x / scale in float32, to be cast to e4m3 as they are stored; the float32 scale, amax /
    FP8_MAX, at least MIN_SCALE). The one definition of this rounding: the RMSNorm and SiLU-and-mul
    that quantize what they compute (kernels/triton_fused_quant.py) call it too."""
    xf = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(xf), 0) / FP8_MAX, MIN_SCALE)
    return tl.minimum(tl.maximum(xf / scale, -FP8_MAX), FP8_MAX), scale


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, cols,
                          FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    launch_dependents(PDL)
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)  # [BLOCK]
    q, scale = quantize_row(x, FP8_MAX, MIN_SCALE)
    tl.store(out_ptr + row * stride_o + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor, fp8_dtype: torch.dtype, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (last dim contiguous) -> (fp8 [rows, cols], float32 scales [rows, 1])."""
    rows, cols = x.shape
    assert x.stride(1) == 1
    out = torch.empty((rows, cols), dtype=fp8_dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, out, scale, x.stride(0), out.stride(0), cols,
                                       FP8_MAX=torch.finfo(fp8_dtype).max, MIN_SCALE=min_scale,
                                       BLOCK=triton.next_power_of_2(cols), num_warps=NUM_WARPS,
                                       **launch_options(x.device))
    return out, scale


# (most rows, BLOCK_M): decode-sized batches take 16-row tiles, everything larger 64
BLOCK_M_BY_ROWS = ((16, 16), (None, 64))
MAX_BLOCK_N = 64


@triton.jit(do_not_specialize=["M"])
def _block_fp8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                             stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of y = x @ (w * scale)^T; K in steps of one scale block."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                 # [BLOCK_M]
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BLOCK_N]
    rk = tl.arange(0, BLOCK_K)
    scale_row = s_ptr + (tl.program_id(1) * BLOCK_N // SCALE_N) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)   # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0)   # [BLOCK_N, BLOCK_K] fp8
        acc += tl.dot(x, tl.trans(w.to(x.dtype))) * tl.load(scale_row + kb)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] bf16/fp16 (last dim contiguous); weight [N, K] e4m3; scale [ceil(N/bn), ceil(K/bk)]
    float32 -> [M, N] in x's dtype."""
    (m, k), n = x.shape, weight.shape[0]
    bn, bk = block
    assert x.stride(1) == 1 and weight.is_contiguous() and scale.stride(1) == 1 and weight.shape[1] == k
    block_n = min(bn, MAX_BLOCK_N)
    assert bn % block_n == 0 and bk >= 16 and block_n >= 16, (bn, bk)
    block_m = next(b for rows, b in BLOCK_M_BY_ROWS if rows is None or m <= rows)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        _block_fp8_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            x, weight, scale, out, m, n, k, x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, SCALE_N=bn)
    return out
