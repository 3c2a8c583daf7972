"""Split-K matrix products for decode-sized batches, in Triton, deterministic: an experiment.

Measured against cuBLAS by `bench_decode_gemm.py --splitk` (RESULTS.md "B1"): no faster,
so the engine keeps cuBLAS; kept here as the record of what was tried.

A decode step multiplies a few rows (one per running sequence) by each weight matrix.
cuBLAS's kernels for such shapes give each program a long serial walk over K, so a
small product ends before it has enough loads in flight to use the memory bandwidth.
Here the K dimension is cut into SPLIT_K segments, so SPLIT_K times more programs each
walk a short segment. Each program writes its float32 partial tile to a workspace; the
last program of a tile to finish (a per-tile counter, atomically incremented) adds the
partials in split order and writes the output. The sum order is fixed, so results do
not depend on which program finishes last: the same inputs give the same bits.

The per-tile counters live in a buffer that `reserve` allocates before CUDA graphs are
captured; the last program of each tile resets its counter for the next launch.
"""
import torch
import triton
import triton.language as tl

MAX_TILES = 1 << 16  # counters reserved per device: (row tiles) x (column tiles) of one product


@triton.jit
def _splitk_linear_kernel(x_ptr, w_ptr, out_ptr, part_ptr, counter_ptr, M, N, K,
                          stride_xm, stride_wn, stride_om,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K].T; program (column tile, split, row tile).

    K % (SPLIT_K * BLOCK_K) == 0 (the host checks it)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    seg = K // SPLIT_K
    ks = split * seg + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, seg, BLOCK_K):
        x = tl.load(x_ptrs, mask=rows[:, None] < M, other=0.0)
        w = tl.load(w_ptrs, mask=cols[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_mask = (rows[:, None] < M) & (cols[None, :] < N)
    out_offs = rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part_offs = rows[:, None].to(tl.int64) * N + cols[None, :]  # [BLOCK_M, BLOCK_N] in one [M, N] slab
        tl.store(part_ptr + split * M * N + part_offs, acc, mask=out_mask)
        tl.debug_barrier()  # every lane's partial is written before the counter moves
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last of the tile's programs: sum in split order
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * M * N + part_offs, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter_ptr + tile, 0)


_counters: dict[torch.device, torch.Tensor] = {}


def reserve(device: torch.device) -> None:
    """Allocate the device's tile counters (call before capturing CUDA graphs)."""
    if device not in _counters:
        _counters[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def splitk_linear(x: torch.Tensor, w: torch.Tensor, block_m: int, block_n: int, block_k: int,
                  split_k: int, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x: [M, K], w: [N, K] (both contiguous in K) -> x @ w.T, [M, N] in x's dtype."""
    (m, k), n = x.shape, w.shape[0]
    assert x.stride(1) == 1 and w.stride(1) == 1 and k % (split_k * block_k) == 0
    grid = (triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))
    assert grid[0] * grid[2] <= MAX_TILES
    reserve(x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split_k if split_k > 1 else 0, m, n, dtype=torch.float32, device=x.device)
    _splitk_linear_kernel[grid](x, w, out, part, _counters[x.device], m, n, k,
                                x.stride(0), w.stride(0), out.stride(0),
                                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                                num_warps=num_warps, num_stages=num_stages)
    return out
