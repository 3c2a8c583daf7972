"""Triton kernels of the fp8 linear path: per-token (row) quantization of activations,
and the product with a block-scaled fp8 weight (HF fine-grained FP8 checkpoints).

`quantize_rows(x)` is `layers/quantization/fp8.quantize_rows` in one launch (the torch
version is five elementwise kernels and a reduction per linear layer, which a decode step
of a 36-layer model pays 144 times): one program per row computes its amax, its scale
(amax / 448, at least MIN_SCALE) and the clamped e4m3 values.

`scaled_fp8_linear(x, x_scale, w, w_scale)`: y = (x * x_scale) @ (w * w_scale)^T for e4m3
activations [M, K] with one scale per row and an e4m3 weight [N, K] with one scale per output
channel (torch's rowwise `_scaled_mm`) on the fp8 tensor cores, for decode-sized batches
(ROWWISE_TILES says which, and the tile each takes). cuBLAS runs these in 128 x 128 tiles: at B1's 256 rows the
Qwen3-8B o and down products (N = 4096) have 64 such tiles for 132 multiprocessors. Here a
program owns a BLOCK_M x BLOCK_N tile (more, smaller tiles), its M blocks of one N block
adjacent in launch order (they share the weight tile through L2), K in steps of BLOCK_K
with no mask (K a multiple of it, else the caller takes `_scaled_mm`); the fp32 tile times
both scales is written in the output dtype.

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
and the dtype. scaled_fp8_linear: one per tile of ROWWISE_TILES and output dtype. Row counts
are grid sizes and `do_not_specialize` arguments, never constexprs.
"""
import torch
import triton
import triton.language as tl

NUM_WARPS = 8


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, cols,
                          FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    scale = tl.maximum(tl.max(tl.abs(x), 0) / FP8_MAX, MIN_SCALE)
    q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
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
                                       BLOCK=triton.next_power_of_2(cols), num_warps=NUM_WARPS)
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


# scaled_fp8_linear's tiles: (most rows, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)), the
# first entry whose row bound holds; a batch above the last bound, or a bucket whose tile is None,
# runs cuBLAS's `_scaled_mm` (measured on the H200: benchmarks/RESULTS.md "Fifteenth session").
ROWWISE_TILES: tuple = ((256, (64, 64, 128, 4, 4)),)


@triton.jit(do_not_specialize=["M"])
def _scaled_fp8_linear_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of y = (x * xs) @ (w * ws)^T; K a multiple of BLOCK_K."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                 # [BLOCK_M]
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BLOCK_N]
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]    # [BLOCK_M, BLOCK_K]
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]    # [BLOCK_N, BLOCK_K]
    row_ok, col_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_rows + k, mask=row_ok[:, None], other=0.0)            # [BLOCK_M, BLOCK_K] e4m3
        w = tl.load(w_rows + k, mask=col_ok[:, None], other=0.0)            # [BLOCK_N, BLOCK_K] e4m3
        acc = tl.dot(x, tl.trans(w), acc)
    xs = tl.load(xs_ptr + rm, mask=row_ok, other=0.0)                       # [BLOCK_M]
    ws = tl.load(ws_ptr + rn, mask=col_ok, other=0.0)                       # [BLOCK_N]
    y = acc * xs[:, None] * ws[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def rowwise_tile(x_fp8: torch.Tensor, weight: torch.Tensor) -> tuple | None:
    """scaled_fp8_linear's tile for this product (ROWWISE_TILES), or None where cuBLAS takes it:
    not on a GPU, more rows than the table holds, or K not a multiple of the tile's BLOCK_K."""
    rows = x_fp8.shape[0]
    if not x_fp8.is_cuda or rows == 0:
        return None
    tile = next((t for most, t in ROWWISE_TILES if rows <= most), None)
    return tile if tile is not None and x_fp8.shape[1] % tile[2] == 0 else None


def scaled_fp8_linear(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                      tile: tuple, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x_fp8 [M, K] e4m3, x_scale [M, 1] float32, weight [N, K] e4m3, w_scale [1, N] float32
    -> [M, N] out_dtype, as `torch._scaled_mm(x_fp8, weight.t(), x_scale, w_scale)`; `tile`
    from `rowwise_tile`."""
    (m, k), n = x_fp8.shape, weight.shape[0]
    block_m, block_n, block_k, num_warps, num_stages = tile
    assert x_fp8.stride(1) == 1 and weight.is_contiguous() and weight.shape[1] == k and k % block_k == 0
    assert x_scale.is_contiguous() and w_scale.is_contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    _scaled_fp8_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x_fp8, x_scale, weight, w_scale, out, m, n, k, x_fp8.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out
