"""What the attention kernels (`triton_attn`, `triton_decode_fma`, `triton_prefill_tma`, and Gluon's
`gluon_decode_mma` for its scalar parts) share: the gather of one K or V tile through a sequence's
block table, a decode program's context length and scales, which KV tiles one split of a context
covers, the load of a query tile and the store of its rows, and which of their common run-time
arguments are not specialized."""
import triton
import triton.language as tl

# Of the arguments both kernels take (triton_attn._launch_args), those that vary at run time and
# so are not specialized (Triton would otherwise compile a variant per value of `== 1` and
# `% 16 == 0`): the block-table width, and the split count with the workspace strides that
# follow from it.
RUN_TIME_ARGS = ["stride_bt", "stride_pt", "stride_ph", "stride_lt", "stride_lh", "num_splits"]
LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)): the kernels' softmax works in base 2
# Running maximum starts finite, so a row with no visible key in a tile gets p = 0
# (exp2(-inf - finite)) instead of exp2(-inf - -inf) = NaN.
RUNNING_MAX_INIT = tl.constexpr(-1.0e30)
# fp16 products over an fp8 cache take 16-bit queries clamped to it (none beyond it in practice), not made inf
FP16_MAX = tl.constexpr(65504.0)


@triton.jit
def load_kv_tile(cache_ptr, block_table_ptr, positions, ctx_len, kv_head,
                  stride_b, stride_r, stride_h, stride_d,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Gather the cache rows of `positions` through the block table.  # [BLOCK_N, HEAD_DIM_PAD]

    Positions at or past `ctx_len` (MASKED tiles only) read 0, never the cache: slots
    outside the context may hold anything, NaN included. Masks are built only where
    needed: a mask the compiler cannot prove uniform would stop 16-byte loads.
    """
    dims = tl.arange(0, HEAD_DIM_PAD)
    if MASKED:
        pos_ok = positions < ctx_len
        block = tl.load(block_table_ptr + positions // PAGE_SIZE, mask=pos_ok, other=0)
    else:  # the caller passes context positions only
        block = tl.load(block_table_ptr + positions // PAGE_SIZE)
    row_offs = (block.to(tl.int64) * stride_b + (positions % PAGE_SIZE) * stride_r
                + kv_head * stride_h)                 # [BLOCK_N]
    ptrs = cache_ptr + row_offs[:, None] + dims[None, :] * stride_d
    if HEAD_DIM == HEAD_DIM_PAD:
        if MASKED:
            tile = tl.load(ptrs, mask=pos_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs)
    else:
        mask = (dims < HEAD_DIM)[None, :]
        if MASKED:
            mask = mask & pos_ok[:, None]
        tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile


@triton.jit
def decode_context(seq_lens_k_ptr, k_scale_ptr, v_scale_ptr, seq, kv_head, scale_log2, KV_FP8: tl.constexpr):
    """What a decode kernel's program reads of its sequence once it has a query: (the context length,
    the softmax scale with an fp8 cache's key scale for the KV head joined to it, the value scale:
    1 for a 16-bit cache). Read after the program's no-query return: read before it, the Gluon
    kernel's loop took 246 instructions and 157 registers against 231 and 132 (sm_90)."""
    ctx_len = tl.load(seq_lens_k_ptr + seq)
    v_scale = 1.0
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    return ctx_len, scale_log2, v_scale


@triton.jit
def split_tile_range(kv_end, seen_by_all, split, num_splits, BLOCK_N: tl.constexpr):
    """The KV tiles of `split` (of `num_splits` equal shares of the tiles below key `kv_end`):
    (tile_begin, full_end, masked_begin, tile_end). Tiles [tile_begin, full_end) lie wholly
    below `seen_by_all`, the keys every query row of the program sees, and run unmasked;
    [masked_begin, tile_end) are the rest, run masked."""
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    full_end = tl.minimum(seen_by_all // BLOCK_N, tile_end)
    return tile_begin, full_end, tl.maximum(tile_begin, full_end), tile_end


@triton.jit
def split_of_last_key(kv_end, num_splits, BLOCK_N: tl.constexpr):
    """The split (as `split_tile_range` shares out the tiles below key `kv_end`) whose tiles hold
    key kv_end - 1."""
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    return (num_tiles - 1) // tl.cdiv(num_tiles, num_splits)


@triton.jit
def load_q_tile(q_ptr, q_start, q_idx, head, row_ok, stride_qt, stride_qh,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Queries of the tile's rows.  # [BLOCK_M, HEAD_DIM_PAD]"""
    dims = tl.arange(0, HEAD_DIM_PAD)
    offs = (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    return tl.load(q_ptr + offs, mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def store_rows(ptr, tokens, head, row_ok, values, stride_t, stride_h,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Store [BLOCK_M, HEAD_DIM_PAD] `values` at rows (token, head) of a [T, H, ...] tensor."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    offs = tokens[:, None] * stride_t + head[:, None] * stride_h + dims[None, :]
    tl.store(ptr + offs, values.to(ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :])
