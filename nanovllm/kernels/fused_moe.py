"""Fused mixture of experts on the GPU, in Triton: route, sort by expert, two grouped GEMMs.

One MoE block is four steps, each graph-capturable (no host synchronization, shapes that
depend only on the number of tokens), so decode steps replay them inside CUDA graphs:

1. `route`: one kernel, one program per token: the float32 softmax of the router logits
   and its top-k (renormalized when asked), as `kernels/moe_torch.route`.
2. `moe_align_block_size`: the token-expert pairs (pair p = token p // k, slot p % k)
   sorted by expert, each expert's run padded to a multiple of BLOCK_M with the sentinel
   P = num_tokens * k, so that every BLOCK_M rows of the sorted list belong to one expert
   (`expert_ids` per block). One single-program kernel (a counting sort); no counts come
   to the host.
3. `_moe_gate_up_kernel`: one launch for all experts: each program multiplies BLOCK_M
   sorted pairs by a BLOCK_N slice of its expert's gate and up rows (w13 [E, 2I, H]) and
   writes silu(gate) * up ([P, I]): SiLU-and-mul fused, the [P, 2I] product never stored.
4. `_moe_down_kernel`: one launch: the same blocks times w2 [E, H, I], each row scaled by
   its routing weight ([P, H]); then the sum over each token's k pairs (a torch reduce).

Blocks past the padded total exit at once, so the grid can be sized from the number of
tokens alone. Experts no token chose cost nothing; an expert that gets every token runs
ceil(P / BLOCK_M) blocks.

Variants (each a Triton compilation, all known at start-up): the tile configs of
`TILE_CONFIGS` (a fixed table, picked by the number of tokens; tuned on an H200 for the
Qwen3-30B-A3B shapes by benchmarks/bench_moe.py) for each of the two GEMM kernels, and
the route kernel for the model's (num_experts, top_k, renormalize), the align kernel for
each BLOCK_M of the table. The model's shapes
(H, I, E, k) are the only other values kernels specialize on; the number of pairs and of
padded rows vary at run time and are `do_not_specialize`.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# (largest number of tokens, config): the first row whose bound holds is used
TILE_CONFIGS: tuple[tuple[int, TileConfig], ...] = (
    (32, TileConfig(16, 64, 128, 1, 4, 4)),
    (128, TileConfig(16, 128, 128, 1, 4, 3)),
    (512, TileConfig(32, 128, 64, 8, 4, 4)),
    (1 << 62, TileConfig(64, 128, 64, 8, 8, 4)),
)


def tile_config(num_tokens: int) -> TileConfig:
    return next(config for bound, config in TILE_CONFIGS if num_tokens <= bound)


# ---- 1. routing --------------------------------------------------------------------

@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """One program per token: softmax over the experts, then TOP_K rounds of argmax (the
    lowest index among equal probabilities), weights renormalized over the chosen ones."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    x = tl.load(logits_ptr + t * stride_t + offs, mask=mask, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    left = tl.where(mask, p, -1.0)  # probabilities not chosen yet
    slots = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, offs, BLOCK_E), axis=0)
        chosen_w = tl.where(slots == j, best, chosen_w)
        chosen_id = tl.where(slots == j, idx, chosen_id)
        left = tl.where(offs == idx, -1.0, left)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(tl.where(slots < TOP_K, chosen_w, 0.0), axis=0)
    tl.store(weights_ptr + t * TOP_K + slots, chosen_w, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, chosen_id, mask=slots < TOP_K)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [num_tokens, E] -> (weights [num_tokens, top_k] float32, ids [num_tokens, top_k] int32)."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0),
                                     TOP_K=top_k, RENORMALIZE=renormalize,
                                     BLOCK_E=triton.next_power_of_2(num_experts),
                                     BLOCK_K=triton.next_power_of_2(top_k))
    return weights, ids


# ---- 2. sort by expert, padded to blocks --------------------------------------------

@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, num_experts,
                      num_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """One program: count the pairs of each expert, lay the experts' padded runs end to end,
    give each block of rows its expert, then write each pair at its expert's run start plus
    its rank among that expert's pairs (stable: in pair order)."""
    experts = tl.arange(0, BLOCK_E)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [BLOCK_E]: where each expert's padded run ends
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    for start in range(0, num_blocks, CHUNK):  # a block's expert: how many runs end at or before it
        rows = (start + offs) * BLOCK_M
        expert = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + start + offs, tl.minimum(expert, num_experts - 1), mask=start + offs < num_blocks)
    next_row = ends - padded  # [BLOCK_E]: the next free row of each expert's run
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=-1)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
        before = tl.cumsum(hit, axis=0) - hit  # earlier pairs of the same expert in this chunk
        row = tl.sum(hit * (next_row[None, :] + before), axis=1)
        tl.store(sorted_ids_ptr + row, start + offs, mask=start + offs < num_pairs)
        next_row += tl.sum(hit, axis=0)


ALIGN_CHUNK = 128  # pairs per loop iteration of the align kernel


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids: [num_tokens, k] -> (sorted_ids [max_padded] int32: pair indices by expert,
    each expert's run padded with the sentinel num_tokens * k to a multiple of block_m;
    expert_ids [max_padded / block_m] int32: the expert of each block of rows;
    num_padded [1] int32: how many sorted rows are in use). max_padded depends on the shape only."""
    num_pairs, device = topk_ids.numel(), topk_ids.device
    # at most min(P, E) experts are in use, each padded by at most block_m - 1 rows
    num_blocks = -(-(num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m)
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    _moe_align_kernel[(1,)](topk_ids.contiguous(), sorted_ids, expert_ids, num_padded, num_pairs, num_experts,
                            num_blocks, BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts),
                            CHUNK=ALIGN_CHUNK)
    return sorted_ids, expert_ids, num_padded


# ---- 3-4. grouped GEMMs ------------------------------------------------------------

@triton.jit
def _block_coords(num_rows, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (row block, column block), grouped so neighbours share weight tiles."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_rows, BLOCK_M)
    num_pid_n = tl.cdiv(n, BLOCK_N)
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % group_size), (pid % (GROUP_M * num_pid_n)) // group_size


@triton.jit(do_not_specialize=["num_pairs", "num_rows"])
def _moe_gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                        num_pairs, num_rows, inter, hidden, stride_xm, stride_we, stride_wn, stride_om,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    """out[pair, n] = silu(x[token] . gate_e[n]) * (x[token] . up_e[n]) for BLOCK_M sorted
    pairs of one expert e and BLOCK_N columns n of its intermediate dimension."""
    pid_m, pid_n = _block_coords(num_rows, inter, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pairs < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (pairs // TOP_K)[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    u_ptrs = g_ptrs + inter * stride_wn
    n_ok = offs_n < inter
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_ok = offs_k < hidden - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_rows"])
def _moe_down_kernel(h_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                     num_pairs, num_rows, hidden, inter, stride_hm, stride_we, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     PRECISION: tl.constexpr):
    """out[pair, n] = weight[pair] * (h[pair] . down_e[n]) for BLOCK_M sorted pairs of one
    expert e and BLOCK_N of the hidden columns n."""
    pid_m, pid_n = _block_coords(num_rows, hidden, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pairs < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + pairs[:, None] * stride_hm + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    n_ok = offs_n < hidden
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        k_ok = offs_k < inter - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc = acc * tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
    """x: [num_tokens, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_weights/ids: [num_tokens, k]
    -> [num_tokens, H] in x's dtype. `config`: a tile config (default: TILE_CONFIGS' for num_tokens)."""
    num_tokens, hidden = x.shape
    num_experts, inter, top_k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    assert x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous(), "fused_experts takes contiguous tensors"
    if num_tokens == 0:
        return torch.empty_like(x)
    cfg = config or tile_config(num_tokens)
    num_pairs = num_tokens * top_k
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, num_experts, cfg.block_m)
    num_rows = sorted_ids.numel()
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 models: exact products
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    grid = (num_rows // cfg.block_m * triton.cdiv(inter, cfg.block_n),)
    _moe_gate_up_kernel[grid](x, w13, h, sorted_ids, expert_ids, num_padded, num_pairs, num_rows, inter, hidden,
                              x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), TOP_K=top_k, **meta)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    grid = (num_rows // cfg.block_m * triton.cdiv(hidden, cfg.block_n),)
    _moe_down_kernel[grid](h, w2, out, topk_weights.contiguous(), sorted_ids, expert_ids, num_padded, num_pairs,
                           num_rows, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), out.stride(0), **meta)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
