"""fp8 products of decode-sized GPU batches (tens to a few hundred rows) by Triton tiles.

A decode step's products are small: Qwen3-8B's o product at 64 rows reads a 16.8 MB fp8
weight for 0.5 GFLOP of work. cuBLAS runs them in large tiles (128 x 128), so N = 4096 gives
64 programs for 132 multiprocessors, and each product spends much of its few microseconds
starting and draining. Here a program owns a BLOCK_M x BLOCK_N tile of y = x @ w^T (more,
smaller tiles), the M blocks of one N block adjacent in launch order (they share the weight
tile through L2), the reduction in steps of BLOCK_K with no mask (K a multiple of it, else
the caller takes cuBLAS), accumulated in fp32 on the tensor cores.

`scaled_fp8_linear(x, x_scale, w, w_scale, tile)`: e4m3 activations [M, K] with one scale
per row times an e4m3 weight [N, K] with one scale per output channel (torch's rowwise
`_scaled_mm`) on the fp8 tensor cores; the tile's fp32 sum times both scales is written in
bf16. Hopper's fp8 products accumulate in the tensor cores' own accumulator by default, as
`_scaled_mm(use_fast_accum=True)` does. Which batches take a tile, and which tile, comes
from a measured table (FP8_TILES: `tile_for`); the rest run cuBLAS.

The same tiles over bf16 operands lost to cuBLAS at every row count on Qwen3-0.6B's
products (a layer's four: 28.8-43.7 us against 23.6-27.8 at 16-256 rows), so 16-bit batches
stay with cuBLAS (RESULTS.md "Fifteenth session").

Launched with programmatic dependent launch where the GPU has it (kernels/triton_pdl.py), as
the activations' quantization before it (triton_fp8.quantize_rows) and the SiLU-and-mul and
RMSNorm around it are, for one rule over the decode step's Triton kernels: at Qwen3-8B's B1 it
measured no gain (12,312 tok/s with it, 12,368 without; RESULTS.md "Fifteenth session").

Variants: one per tile of the tables (a bounded set: the warm-up runs a batch at each entry's row
bound, `row_bounds`); the row count is a grid size and a `do_not_specialize` argument, never a
constexpr.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.triton_pdl import launch_dependents, launch_options, wait_for_prior_grid

# (most rows, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)): a batch takes the tile of the
# first entry whose row bound holds; a batch above the last bound, or an entry whose tile is None,
# runs cuBLAS. Chains of Qwen3-8B's four products from a CUDA graph, us a layer against
# cuBLAS with fast accumulation at 16 / 64 / 128 / 192 / 256 rows: 74.6 / 75.8 / 92.8 / 110.9 /
# 122.2 against 91.1 / 92.5 / 96.2 / 117.0 / 110.4 (benchmarks/bench_batch_gemm.py, RESULTS.md
# "Fifteenth session").
FP8_TILES: tuple = ((64, (64, 32, 128, 4, 5)), (192, (64, 64, 128, 4, 4)))
# Per weight shape, as vLLM keeps tuned configs per (N, K): ((N, K), table in FP8_TILES' form) pairs;
# a product whose weight is [N, K] reads its own table instead of FP8_TILES. Qwen3-8B's four products,
# each product's fastest tile per row count where it beat cuBLAS by 3% (benchmarks/bench_batch_gemm.py's
# TILES_BY_SHAPE_JSON on an H200): e.g. o at 256 rows 11.6 us against 13.8, down 32.1 against 34.4; B1
# on that shape with fp8 weights and KV 12,993 tok/s against 12,595 with FP8_TILES alone
# (RESULTS.md "Sixteenth session").
_T16_256, _T32_256 = (64, 16, 256, 4, 4), (64, 32, 256, 4, 4)
_T64_6, _T64_4 = (64, 64, 128, 4, 6), (64, 64, 128, 4, 4)
FP8_TILES_BY_SHAPE: tuple = (
    ((6144, 4096), ((64, _T32_256), (128, _T64_6), (256, None))),                                  # q/k/v
    ((4096, 4096), ((32, _T64_6), (64, _T16_256), (128, _T32_256), (256, _T64_6))),               # o
    ((24576, 4096), ((64, _T64_4), (256, None))),                                                  # gate/up
    ((4096, 12288), ((16, _T16_256), (32, _T64_6), (64, _T16_256), (128, _T32_256), (256, _T64_6))),  # down
)


@triton.jit(do_not_specialize=["M"])
def _scaled_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of y = (x * xs) @ (w * ws)^T; K a multiple of BLOCK_K."""
    launch_dependents(PDL)
    wait_for_prior_grid(PDL)
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
    acc = acc * tl.load(xs_ptr + rm, mask=row_ok, other=0.0)[:, None]
    acc = acc * tl.load(ws_ptr + rn, mask=col_ok, other=0.0)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _table(n: int, k: int):
    """The tile table of a weight [n, k]: its own from FP8_TILES_BY_SHAPE, else FP8_TILES."""
    return next((table for shape, table in FP8_TILES_BY_SHAPE if tuple(shape) == (n, k)), FP8_TILES)


def row_bounds() -> list[int]:
    """The row count of each table entry that takes a tile, over every table (the engine's warm-up
    runs a batch of each)."""
    tables = [FP8_TILES] + [table for _, table in FP8_TILES_BY_SHAPE]
    return sorted({most for table in tables for most, tile in table if tile is not None})


def tile_for(x_fp8: torch.Tensor, weight: torch.Tensor) -> tuple | None:
    """The tile this product takes (its weight shape's table, else FP8_TILES), or None where cuBLAS
    takes it: not on a GPU, not e4m3 operands, more rows than the table holds, a K that is not a
    multiple of the tile's BLOCK_K, or operands not contiguous along K."""
    rows = x_fp8.shape[0]
    e4m3 = torch.float8_e4m3fn
    if (not x_fp8.is_cuda or rows == 0 or weight.dtype != e4m3 or x_fp8.dtype != e4m3 or x_fp8.stride(-1) != 1
            or not weight.is_contiguous()):
        return None
    tile = next((t for most, t in _table(*weight.shape) if rows <= most), None)
    return tile if tile is not None and x_fp8.shape[1] % tile[2] == 0 else None


def scaled_fp8_linear(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                      tile: tuple) -> torch.Tensor:
    """x_fp8 [M, K] e4m3, x_scale [M, 1] float32, weight [N, K] e4m3, w_scale [1, N] float32
    -> [M, N] bf16, as `torch._scaled_mm(x_fp8, weight.t(), x_scale, w_scale)`; `tile` from
    `tile_for`."""
    (m, k), n = x_fp8.shape, weight.shape[0]
    block_m, block_n, block_k, num_warps, num_stages = tile
    assert weight.shape[1] == k and k % block_k == 0 and x_fp8.stride(1) == 1 and weight.is_contiguous()
    assert x_scale.is_contiguous() and w_scale.is_contiguous()
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x_fp8.device)
    _scaled_fp8_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x_fp8, x_scale, weight, w_scale, out, m, n, k, x_fp8.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        **launch_options(x_fp8.device))
    return out
