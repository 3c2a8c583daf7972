"""Products of decode-sized GPU batches (tens to a few hundred rows) by Triton tiles.

A decode step's products are small: Qwen3-8B's o product at 64 rows reads a 16.8 MB fp8
weight for 0.5 GFLOP of work. cuBLAS runs them in large tiles (128 x 128), so N = 4096 gives
64 programs for 132 multiprocessors, and each product spends much of its few microseconds
starting and draining. Here a program owns a BLOCK_M x BLOCK_N tile of y = x @ w^T (more,
smaller tiles), the M blocks of one N block adjacent in launch order (they share the weight
tile through L2), the reduction in steps of BLOCK_K with no mask (K a multiple of it, else
the caller takes cuBLAS), accumulated in fp32 on the tensor cores.

Two forms, one kernel:
- `scaled_fp8_linear(x, x_scale, w, w_scale, tile)`: e4m3 activations [M, K] with one scale
  per row times an e4m3 weight [N, K] with one scale per output channel (torch's rowwise
  `_scaled_mm`), the fp8 tensor cores; the tile's fp32 sum times both scales is written in
  bf16. Hopper's fp8 products accumulate in the tensor cores' own accumulator by default,
  as `_scaled_mm(use_fast_accum=True)` does.
- `batch_linear(x, w, bias, tile)`: 16-bit x [M, K] times a 16-bit weight [N, K] (+ bias).

Which batches take a tile, and which tile, comes from measured tables (FP8_TILES,
SIXTEEN_BIT_TILES: `tile_for`); the rest run cuBLAS. Variants: one per tile of a table and
dtype (a bounded set, met while CUDA graphs are captured at start-up); the row count is a
grid size and a `do_not_specialize` argument, never a constexpr.
"""
import torch
import triton
import triton.language as tl

# (most rows, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)): a batch takes the tile of the
# first entry whose row bound holds; a batch above the last bound, or an entry whose tile is None,
# runs cuBLAS. fp8: chains of Qwen3-8B's four products from a CUDA graph, us a layer against
# cuBLAS with fast accumulation at 16 / 64 / 128 / 192 / 256 rows: 74.6 / 75.8 / 92.8 / 110.9 /
# 122.2 against 91.1 / 92.5 / 96.2 / 117.0 / 110.4 (benchmarks/bench_fp8_gemm.py, RESULTS.md
# "Fifteenth session").
FP8_TILES: tuple = ((64, (64, 32, 128, 4, 5)), (192, (64, 64, 128, 4, 4)))
SIXTEEN_BIT_TILES: tuple = ()  # (measured in bench_fp8_gemm.py --dtype bf16: not yet chosen)


@triton.jit(do_not_specialize=["M"])
def _batch_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of y = x @ w^T (SCALED: times xs per row and ws per column);
    K a multiple of BLOCK_K."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                 # [BLOCK_M]
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BLOCK_N]
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]    # [BLOCK_M, BLOCK_K]
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]    # [BLOCK_N, BLOCK_K]
    row_ok, col_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_rows + k, mask=row_ok[:, None], other=0.0)            # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + k, mask=col_ok[:, None], other=0.0)            # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc)
    if SCALED:
        acc = acc * tl.load(xs_ptr + rm, mask=row_ok, other=0.0)[:, None]
        acc = acc * tl.load(ws_ptr + rn, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def tile_for(x: torch.Tensor, weight: torch.Tensor) -> tuple | None:
    """The tile this product takes (FP8_TILES for an e4m3 weight, SIXTEEN_BIT_TILES for a
    16-bit one), or None where cuBLAS takes it: not on a GPU, more rows than the table holds,
    a K that is not a multiple of the tile's BLOCK_K, or operands not contiguous along K."""
    rows = x.shape[0]
    if not x.is_cuda or rows == 0 or x.stride(-1) != 1 or not weight.is_contiguous():
        return None
    if weight.dtype == torch.float8_e4m3fn:
        table = FP8_TILES
    elif weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype:
        table = SIXTEEN_BIT_TILES
    else:
        return None
    tile = next((t for most, t in table if rows <= most), None)
    return tile if tile is not None and x.shape[1] % tile[2] == 0 else None


def _launch(x, xs, w, ws, bias, out, tile) -> torch.Tensor:
    (m, k), n = x.shape, w.shape[0]
    block_m, block_n, block_k, num_warps, num_stages = tile
    assert w.shape[1] == k and k % block_k == 0 and x.stride(1) == 1 and w.is_contiguous()
    _batch_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, xs if xs is not None else x, w, ws if ws is not None else w, bias if bias is not None else w, out,
        m, n, k, x.stride(0), w.stride(0), out.stride(0), SCALED=xs is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out


def scaled_fp8_linear(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                      tile: tuple) -> torch.Tensor:
    """x_fp8 [M, K] e4m3, x_scale [M, 1] float32, weight [N, K] e4m3, w_scale [1, N] float32
    -> [M, N] bf16, as `torch._scaled_mm(x_fp8, weight.t(), x_scale, w_scale)`."""
    assert x_scale.is_contiguous() and w_scale.is_contiguous()
    out = torch.empty((x_fp8.shape[0], weight.shape[0]), dtype=torch.bfloat16, device=x_fp8.device)
    return _launch(x_fp8, x_scale, weight, w_scale, None, out, tile)


def batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: tuple) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N], 16-bit, in x's dtype."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return _launch(x, None, weight, None, bias, out, tile)
