"""Decode attention on the CUDA cores: the products as broadcast multiply-adds, no tensor cores.

A decode step has one query token per sequence, so the query tile of one KV head holds only
the query heads of its group (2 for Qwen3-0.6B). `triton_attn`'s decode tile pads them to
the 16 rows the tensor cores need and stages K and V through shared memory in the layouts
the products want; over an fp8 cache that staging (V converted to fp16, stored, read back
transposed) is where its time goes, and it reads the cache at about half the copy bandwidth
(benchmarks/RESULTS.md "FP8 KV at B1", "Tenth session").

Here each K/V tile is converted to fp32 in the registers it was loaded into and used there:
s = sum_d q[h, d] * k[n, d] and o[h, d] += sum_n p[h, n] * v[n, d] are multiply-adds over the
loaded layout plus reductions across the threads that share a row. Per KV byte that is a
few instructions (one conversion, two multiply-adds per query head), which the CUDA cores
issue faster than HBM delivers an fp8 cache; nothing goes through shared memory except the
reductions Triton places there when a tile spans several warps (one warp per program avoids
them: DECODE_FMA_NUM_WARPS).

Same arguments and semantics as `triton_attn.paged_attention` for a decode-only batch (one
query per sequence; a sequence with none writes nothing), split-KV included: a split writes
its partial output and log2-sum-exp into the caller's workspace, combined by `triton_attn`'s
combine kernel. Any cache dtype: fp8 (per-KV-head scales folded in as in `triton_attn`) or
16-bit; fp32 accumulation throughout. Variants: per model and cache dtype, times split or not.
"""
import triton
import triton.language as tl

from nanovllm.kernels.triton_paged_tiles import load_kv_tile

# Running maximum starts finite, so a row with no visible key gets p = 0, not NaN
RUNNING_MAX_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, tile, ctx_len, kv_head, k_cache_ptr, v_cache_ptr, block_table_ptr,
                 stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, stride_vd,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step of the group's query heads over KV tile `tile`.
    acc [QPK_PAD, D] fp32, m_i / l_i [QPK_PAD], q [QPK_PAD, D] fp32 (softmax scale in it)."""
    positions = tile * BLOCK_N + tl.arange(0, BLOCK_N)                     # [BLOCK_N]
    k = load_kv_tile(k_cache_ptr, block_table_ptr, positions, ctx_len, kv_head,
                     stride_kb, stride_kr, stride_kh, 1, HEAD_DIM, HEAD_DIM_PAD,
                     PAGE_SIZE, MASKED).to(tl.float32)                     # [BLOCK_N, D]
    s = tl.sum(q[:, None, :] * k[None, :, :], 2)                           # [QPK_PAD, BLOCK_N]
    if MASKED:
        s = tl.where((positions < ctx_len)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))                                  # [QPK_PAD]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])                                        # [QPK_PAD, BLOCK_N]
    v = load_kv_tile(v_cache_ptr, block_table_ptr, positions, ctx_len, kv_head,
                     stride_vb, stride_vr, stride_vh, stride_vd, HEAD_DIM, HEAD_DIM_PAD,
                     PAGE_SIZE, MASKED).to(tl.float32)                     # [BLOCK_N, D]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)  # [QPK_PAD, D]
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_bt", "stride_pt", "stride_ph", "stride_lt", "stride_lh", "num_splits"])
def decode_fma_kernel(
        out_ptr, part_out_ptr, part_lse_ptr,
        q_ptr, k_cache_ptr, v_cache_ptr,
        cu_seqlens_q_ptr, seq_lens_k_ptr, block_tables_ptr, scale_log2, k_scale_ptr, v_scale_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, stride_vd, stride_bt,
        stride_pt, stride_ph, stride_lt, stride_lh, num_splits,
        QPK: tl.constexpr, QPK_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
        IS_SPLIT: tl.constexpr, KV_FP8: tl.constexpr):
    """Grid: (KV heads x splits, sequences). One program: one sequence's query heads of one
    KV head over one split of its context."""
    seq = tl.program_id(1)
    kv_head = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    token = tl.load(cu_seqlens_q_ptr + seq)
    if tl.load(cu_seqlens_q_ptr + seq + 1) == token:  # no query this step
        return
    ctx_len = tl.load(seq_lens_k_ptr + seq)
    if KV_FP8:  # the KV head's key scale joins the softmax scale
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
    rows = tl.arange(0, QPK_PAD)
    head = kv_head * QPK + rows                                            # [QPK_PAD]
    row_ok = rows < QPK
    dims = tl.arange(0, HEAD_DIM_PAD)
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    q = q.to(tl.float32) * scale_log2                                      # [QPK_PAD, D]

    num_tiles = tl.cdiv(ctx_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    full_end = tl.minimum(ctx_len // BLOCK_N, tile_end)   # tiles wholly inside the context
    masked_begin = tl.maximum(tile_begin, full_end)
    m_i = tl.full([QPK_PAD], RUNNING_MAX_INIT, dtype=tl.float32)
    l_i = tl.zeros([QPK_PAD], dtype=tl.float32)
    acc = tl.zeros([QPK_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_begin, full_end):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, tile, ctx_len, kv_head, k_cache_ptr, v_cache_ptr,
                                     block_table_ptr, stride_kb, stride_kr, stride_kh,
                                     stride_vb, stride_vr, stride_vh, stride_vd,
                                     BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, False)
    for tile in range(masked_begin, tile_end):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, tile, ctx_len, kv_head, k_cache_ptr, v_cache_ptr,
                                     block_table_ptr, stride_kb, stride_kr, stride_kh,
                                     stride_vb, stride_vr, stride_vh, stride_vd,
                                     BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, True)

    has_keys = l_i > 0.0  # false only for a split past the end of a short context
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]                       # [QPK_PAD, D]
    if KV_FP8:  # every value row of this KV head had the same scale
        o = o * tl.load(v_scale_ptr + kv_head)
    if not IS_SPLIT:
        offs = token * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + offs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :])
    else:
        offs = token * stride_pt + head[:, None] * stride_ph + split * HEAD_DIM_PAD + dims[None, :]
        tl.store(part_out_ptr + offs, o, mask=row_ok[:, None])  # padded dims too: the combine reads them
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=row_ok)
