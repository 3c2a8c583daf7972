"""Decode attention on the CUDA cores: the products as broadcast multiply-adds, no tensor cores.

A decode step has one query token per sequence, so the query tile of one KV head holds only
the query heads of its group (2 for Qwen3-0.6B). `triton_attn`'s decode tile pads them to
the 16 rows the tensor cores need and stages K and V through shared memory in the layouts
the products want; over an fp8 cache that staging (V converted to fp16, stored, read back
transposed) is where its time goes, and it reads the cache at about half the copy bandwidth
(benchmarks/RESULTS.md "FP8 KV at B1", "Tenth session").

Here each K/V tile is converted to fp32 in the registers it was loaded into and used there:
s = sum_d q[h, d] * k[n, d] and o[h, d] += sum_n p[h, n] * v[n, d] are multiply-adds over the
loaded layout plus reductions across the threads that share a row (P V's only at the end:
ACC_ROWS partial sums, one per row a thread holds). The loop's K/V loads are pipelined
(LOOP_STAGES: cp.async into shared memory, tiles ahead of the one in use); nothing else goes
through shared memory except the reductions Triton places there when a tile spans several
warps (one warp per program avoids them: DECODE_FMA_NUM_WARPS). Over B1's fp8 decode batches
on an H200 it reads the cache at 0.74 of copy bandwidth (16-key tiles, 3 stages; 0.61 before
the pipelined loads and partial sums) against the tensor-core tile's 0.56 (benchmarks/RESULTS.md
"Twelfth session", "Nineteenth session").

Same arguments and semantics as `triton_attn.paged_attention` for a decode-only batch (one
query per sequence; a sequence with none writes nothing), split-KV included: a split writes
its partial output and log2-sum-exp into the caller's workspace, combined by `triton_attn`'s
combine kernel. Any cache dtype: fp8 (per-KV-head scales folded in as in `triton_attn`) or
16-bit; fp32 accumulation (with DECODE_FMA_PV_FP16, off, a tile's P V is summed in fp16
first). Variants: per model and cache dtype, times split or not (with triton_attn.DECODE_FUSED_ROPE, set
before an engine starts, its ROPE ones instead, as many).
"""
import triton
import triton.language as tl

from nanovllm.kernels.triton_kv_write import load_cos_sin, rope_q_rows, rope_store_new_kv
from nanovllm.kernels.triton_paged_tiles import (RUN_TIME_ARGS, RUNNING_MAX_INIT, decode_context, load_kv_tile,
                                                 split_of_last_key, split_tile_range)
from nanovllm.kernels.triton_pdl import launch_dependents, wait_for_prior_grid

# Query heads one program computes, each with its own scalar softmax state and [D] (or
# [BLOCK_N, D]) accumulator, written out per head (Triton has no per-row loop over a tile).
HEADS_PER_PROGRAM = tl.constexpr(2)


@triton.jit
def _softmax_step(s, m_i, l_i, positions, ctx_len, MASKED: tl.constexpr):
    """One query head's scores s [BLOCK_N] (base 2) -> (p [BLOCK_N], alpha, new running max, new sum)."""
    if MASKED:
        s = tl.where(positions < ctx_len, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 0)


@triton.jit
def _weigh_values(acc, p, alpha, v, ACC_2D: tl.constexpr, PV_FP16: tl.constexpr, ACC_ROWS: tl.constexpr):
    """acc * alpha + p V: acc [D]; [ACC_ROWS, D], the tile's rows r, r + ACC_ROWS, ... summed into row
    r (within a thread: the rows it holds); or [BLOCK_N, D], the sum over keys left to the end.
    PV_FP16: v [BLOCK_N, D] fp16, the tile's products and their sum over keys in fp16 (packed
    two a instruction), added to the fp32 accumulator."""
    if PV_FP16:
        pv = tl.sum(p.to(tl.float16)[:, None] * v, 0, dtype=tl.float16)
        return acc * alpha + pv.to(tl.float32)
    if ACC_2D:
        return acc * alpha + p[:, None] * v
    if ACC_ROWS > 1:
        pv = p[:, None] * v
        return acc * alpha + tl.sum(tl.reshape(pv, [pv.shape[0] // ACC_ROWS, ACC_ROWS, pv.shape[1]]), 0)
    return acc * alpha + tl.sum(p[:, None] * v, 0)


@triton.jit
def _attend_tile(acc0, acc1, m0, m1, l0, l1, q0, q1, tile, ctx_len, kv_head,
                 k_cache_ptr, v_cache_ptr, block_table_ptr,
                 stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, stride_vd,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, ACC_2D: tl.constexpr,
                 PV_FP16: tl.constexpr, ACC_ROWS: tl.constexpr):
    """One online-softmax step of the program's two query heads over KV tile `tile`.
    q0, q1 [D] fp32 (softmax scale in them); m, l scalars; acc as `_weigh_values`. Written per
    head on 2-D tiles only: the scores come out in the layout of the tile's rows, which is the
    layout p needs against V, so no tile changes layout (a [heads, keys, D] broadcast did, through
    shared memory, and ran at a third of the copy bandwidth)."""
    positions = tile * BLOCK_N + tl.arange(0, BLOCK_N)                     # [BLOCK_N]
    k = load_kv_tile(k_cache_ptr, block_table_ptr, positions, ctx_len, kv_head,
                     stride_kb, stride_kr, stride_kh, 1, HEAD_DIM, HEAD_DIM_PAD,
                     PAGE_SIZE, MASKED).to(tl.float32)                     # [BLOCK_N, D]
    p0, alpha0, m0, l0 = _softmax_step(tl.sum(k * q0[None, :], 1), m0, l0, positions, ctx_len, MASKED)
    p1, alpha1, m1, l1 = _softmax_step(tl.sum(k * q1[None, :], 1), m1, l1, positions, ctx_len, MASKED)
    v = load_kv_tile(v_cache_ptr, block_table_ptr, positions, ctx_len, kv_head,
                     stride_vb, stride_vr, stride_vh, stride_vd, HEAD_DIM, HEAD_DIM_PAD,
                     PAGE_SIZE, MASKED).to(tl.float16 if PV_FP16 else tl.float32)  # [BLOCK_N, D]
    acc0 = _weigh_values(acc0, p0, alpha0, v, ACC_2D, PV_FP16, ACC_ROWS)
    acc1 = _weigh_values(acc1, p1, alpha1, v, ACC_2D, PV_FP16, ACC_ROWS)
    return acc0, acc1, m0, m1, l0, l1


@triton.jit
def _store_head(out_ptr, part_out_ptr, part_lse_ptr, acc, m_i, l_i, v_scale, token, head, head_end, split,
                stride_ot, stride_oh, stride_pt, stride_ph, stride_lt, stride_lh,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, IS_SPLIT: tl.constexpr):
    """One query head's output [D] (or its split's partial output and log2-sum-exp); nothing for
    a head at or past `head_end`."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    head_ok = dims * 0 + head < head_end  # [D]: Triton 3.9's interpreter rejects a scalar mask in `&`
    has_keys = l_i > 0.0  # false only for a split past the end of a short context
    o = acc / tl.where(has_keys, l_i, 1.0) * v_scale                       # [D]
    if not IS_SPLIT:
        tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, o.to(out_ptr.dtype.element_ty),
                 mask=(dims < HEAD_DIM) & head_ok)
    else:  # padded dims too: the combine reads them
        tl.store(part_out_ptr + token * stride_pt + head * stride_ph + split * HEAD_DIM_PAD + dims, o,
                 mask=(dims < HEAD_DIM_PAD) & head_ok)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=head < head_end)


@triton.jit
def _load_q(q_ptr, token, head, head_end, stride_qt, stride_qh, scale_log2,
            HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """One query head's query in fp32 times the softmax scale (zeros for a head at or past
    `head_end`, outside the group)."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    # (the head test as a [D] tensor: Triton 3.9's interpreter rejects a scalar mask in `&`)
    mask = (dims < HEAD_DIM) & (dims * 0 + head < head_end)
    q = tl.load(q_ptr + token * stride_qt + head * stride_qh + dims, mask=mask, other=0.0)
    return q.to(tl.float32) * scale_log2                                    # [D]


@triton.jit
def _rope_q(q_ptr, token, head, head_end, stride_qt, stride_qh, scale_log2, w_ptr, cos, sin, eps,
            HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """`_load_q` of a query read before its norm and RoPE, normed and rotated as triton_ops' RoPE
    kernel does it (ROPE; a power-of-two head size)."""
    tokens = token + tl.zeros([1], dtype=tl.int32)                          # [1]
    q = rope_q_rows(q_ptr, tokens, tokens * 0 + head, tokens * 0 + head < head_end, stride_qt, stride_qh,
                    w_ptr, cos, sin, eps, tl.arange(0, HEAD_DIM // 2)[None, :], QK_NORM)  # [1, D]
    return tl.reshape(q, [HEAD_DIM]).to(tl.float32) * scale_log2          # [D]


@triton.jit(do_not_specialize=RUN_TIME_ARGS)
def decode_fma_kernel(
        out_ptr, part_out_ptr, part_lse_ptr,
        q_ptr, k_cache_ptr, v_cache_ptr,
        cu_seqlens_q_ptr, seq_lens_k_ptr, block_tables_ptr, scale_log2, k_scale_ptr, v_scale_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, stride_vd, stride_bt,
        stride_pt, stride_ph, stride_lt, stride_lh, num_splits,
        k_new_ptr, v_new_ptr, pos_ptr, slot_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr, rope_eps,
        stride_knt, stride_knh, stride_vnt, stride_vnh,
        QPK: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
        IS_SPLIT: tl.constexpr, KV_FP8: tl.constexpr, ACC_2D: tl.constexpr, PV_FP16: tl.constexpr,
        LOOP_STAGES: tl.constexpr, ACC_ROWS: tl.constexpr,
        ROPE: tl.constexpr, QK_NORM: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    """Grid: (KV heads x head pairs x splits, sequences). One program: one sequence's pair of
    query heads (HEADS_PER_PROGRAM) of one KV head over one split of its context; a group of
    more than two query heads reads its K/V once per pair (for groups of 4, B1 on the Qwen3-8B
    shape ran slower than with the tensor-core tile: triton_attn.DECODE_FMA_MAX_GROUP; so did one
    program of four heads, at 255 registers: RESULTS.md "Fourteenth session").

    ROPE (triton_attn.DECODE_FUSED_ROPE): as in triton_attn's decode tile, q and the new key and value
    are this step's before q/k norm (QK_NORM) and RoPE; each program of the split that holds the new
    key stores it into the cache first (every pair's the same bytes)."""
    launch_dependents(PDL)
    wait_for_prior_grid(PDL)
    pairs = tl.cdiv(QPK, HEADS_PER_PROGRAM)
    seq = tl.program_id(1)
    kv_head = tl.program_id(0) // (pairs * num_splits)
    pair = tl.program_id(0) // num_splits % pairs
    split = tl.program_id(0) % num_splits
    token = tl.load(cu_seqlens_q_ptr + seq)
    if tl.load(cu_seqlens_q_ptr + seq + 1) == token:  # no query this step
        return
    ctx_len, scale_log2, v_scale = decode_context(seq_lens_k_ptr, k_scale_ptr, v_scale_ptr, seq, kv_head, scale_log2,
                                                  KV_FP8)
    head0 = kv_head * QPK + pair * HEADS_PER_PROGRAM
    head_end = (kv_head + 1) * QPK  # the group's heads are below it (head0 always; head0 + 1 if QPK > 1)
    if ROPE:
        half_dims = tl.arange(0, HEAD_DIM // 2)[None, :]
        cos, sin = load_cos_sin(cos_sin_ptr, tl.load(pos_ptr + token), half_dims)
        q0 = _rope_q(q_ptr, token, head0, head_end, stride_qt, stride_qh, scale_log2, q_w_ptr, cos, sin, rope_eps,
                     HEAD_DIM, QK_NORM)
        q1 = _rope_q(q_ptr, token, head0 + 1, head_end, stride_qt, stride_qh, scale_log2, q_w_ptr, cos, sin,
                     rope_eps, HEAD_DIM, QK_NORM)
        # every pair's program of the new key's split writes it (the same bytes): each then reads its own
        # write, where one writer alone raced the other pairs' reads (groups of 3 on an H200)
        if split == split_of_last_key(ctx_len, num_splits, BLOCK_N):
            rope_store_new_kv(k_new_ptr, v_new_ptr, token, kv_head, slot_ptr, k_cache_ptr, v_cache_ptr,
                              k_scale_ptr, v_scale_ptr, k_w_ptr, cos, sin, rope_eps,
                              stride_knt, stride_knh, stride_vnt, stride_vnh, stride_kb, stride_kr, stride_kh,
                              stride_vb, stride_vr, stride_vh, stride_vd, half_dims, PAGE_SIZE, QK_NORM, KV_FP8,
                              FP8_MAX)
            tl.debug_barrier()  # the key and value written are visible to the program's loads below
    else:
        q0 = _load_q(q_ptr, token, head0, head_end, stride_qt, stride_qh, scale_log2, HEAD_DIM, HEAD_DIM_PAD)
        q1 = _load_q(q_ptr, token, head0 + 1, head_end, stride_qt, stride_qh, scale_log2, HEAD_DIM, HEAD_DIM_PAD)

    # one query at the context's end: it sees every key, so only the last tile is masked
    tile_begin, full_end, masked_begin, tile_end = split_tile_range(ctx_len, ctx_len, split, num_splits, BLOCK_N)
    m0 = tl.full((), RUNNING_MAX_INIT, dtype=tl.float32)
    m1 = m0
    l0 = tl.zeros((), dtype=tl.float32)
    l1 = l0
    if ACC_2D:
        acc0 = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    elif ACC_ROWS > 1:
        acc0 = tl.zeros([ACC_ROWS, HEAD_DIM_PAD], dtype=tl.float32)
    else:
        acc0 = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    acc1 = acc0
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in tl.range(tile_begin, full_end, num_stages=LOOP_STAGES):  # loads LOOP_STAGES - 1 tiles ahead
        acc0, acc1, m0, m1, l0, l1 = _attend_tile(
            acc0, acc1, m0, m1, l0, l1, q0, q1, tile, ctx_len, kv_head, k_cache_ptr, v_cache_ptr,
            block_table_ptr, stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, stride_vd,
            BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, False, ACC_2D, PV_FP16, ACC_ROWS)
    for tile in range(masked_begin, tile_end):
        acc0, acc1, m0, m1, l0, l1 = _attend_tile(
            acc0, acc1, m0, m1, l0, l1, q0, q1, tile, ctx_len, kv_head, k_cache_ptr, v_cache_ptr,
            block_table_ptr, stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, stride_vd,
            BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, True, ACC_2D, PV_FP16, ACC_ROWS)
    if ACC_2D or ACC_ROWS > 1:
        acc0 = tl.sum(acc0, 0)
        acc1 = tl.sum(acc1, 0)
    _store_head(out_ptr, part_out_ptr, part_lse_ptr, acc0, m0, l0, v_scale, token, head0, head_end, split,
                stride_ot, stride_oh, stride_pt, stride_ph, stride_lt, stride_lh, HEAD_DIM, HEAD_DIM_PAD, IS_SPLIT)
    _store_head(out_ptr, part_out_ptr, part_lse_ptr, acc1, m1, l1, v_scale, token, head0 + 1, head_end, split,
                stride_ot, stride_oh, stride_pt, stride_ph, stride_lt, stride_lh, HEAD_DIM, HEAD_DIM_PAD, IS_SPLIT)
