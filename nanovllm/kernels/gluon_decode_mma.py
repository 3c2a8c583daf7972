"""Decode attention on the tensor cores with K and V loaded straight into the products' registers.

Triton's decode tile (`triton_attn`) stages K and V through shared memory in the layouts `mma`
wants, and over an fp8 cache also converts them there (for Qwen3-8B's groups of 4 it reads the
cache at ~0.60 of copy bandwidth, against ~0.93 over bf16); `triton_decode_fma` avoids the staging
but spends ~1.5 instructions a value on conversions and reductions (issue-bound at ~0.80 for
Qwen3-0.6B's groups of 2). Here, in Gluon (layouts chosen by hand), each thread loads from global
memory exactly the values its `mma.sync` fragments hold, 16 bytes a load, converts an fp8 cache's
in registers (one `cvt` for two values) and multiplies: nothing goes through shared memory in the
loop, and each thread's loads for the next tile are in flight while it computes this one.

That works because both products are free to relabel one of their axes:
- S^T = K q^T sums over the head dimension, so K's dimensions may be taken in any order, q's in the
  same one. The order chosen (`_head_dim_perm`) gives each thread whole 16-byte pieces of a key row
  where its fragment holds 4-byte pieces spread over the row.
- O^T = V^T P^T has the output's dimensions as its rows; their order is free too (undone when the
  output is stored), and the one chosen (`_value_dim_perm`) gives each thread 16 consecutive bytes
  of a value row.
Both products are transposed so that the group's query heads (at most 8, MAX_GROUP) are their n of
8: no query rows are padded to mma's 16, and P^T, S^T's accumulator, becomes O^T's B operand by one
`movmatrix` a 16-key tile (`_transpose_8x8`). The relabelings are reshapes and permutes of the
loaded tiles, whose layouts then equal the `mma` operand layouts: the conversions to those layouts
are asserted (while the kernel builds) to move nothing.

One program (one warp) computes one sequence's query heads of one KV head over one split of its
context; splits write partial outputs and log2-sum-exps for `triton_attn`'s combine kernel. Same
arguments and results as `triton_attn.paged_attention` for a decode-only batch: over an fp8 cache
with per-KV-head scales, products in fp16 (e4m3 and e5m2 are exact in fp16); over a 16-bit cache of
the queries' dtype, products in it; fp32 accumulation; the fused RoPE of triton_attn.DECODE_FUSED_ROPE.
The cache is passed as int32 words (the loop carries words, not bytes). Variants: per model and cache
dtype, split or not (with DECODE_FUSED_ROPE its ROPE ones instead, as many).
"""
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from nanovllm.kernels.triton_kv_write import load_cos_sin, rope_q_rows, rope_store_new_kv
from nanovllm.kernels.triton_paged_tiles import (FP16_MAX, RUN_TIME_ARGS, RUNNING_MAX_INIT, decode_context,
                                                 split_of_last_key, split_tile_range)
from nanovllm.kernels.triton_pdl import launch_dependents, wait_for_prior_grid

MAX_GROUP = gl.constexpr(8)   # query heads of one KV head: P^T's columns, the B operand's n of 8


@gluon.constexpr_function
def _mma_layout():
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def _values_per_word(kv_fp8):
    return 4 if kv_fp8 else 2


@gluon.constexpr_function
def _piece(kv_fp8):
    """Values in one thread's 16-byte load."""
    return 16 // (1 if kv_fp8 else 2)


@gluon.constexpr_function
def _key_load_layout(block_n, head_dim, kv_fp8):
    """K's int32 words [block_n, W] (W = head_dim / values a word) in cache order: lane (g, t) =
    (lane // 4, lane % 4) holds keys g + 8j and the 16-byte pieces at words 4t + 16a (S^T's A operand,
    after `_head_dim_perm`)."""
    words = head_dim // _values_per_word(kv_fp8)
    regs = [[0, 1], [0, 2]] + [[0, 16 * (1 << a)] for a in range((words // 16).bit_length() - 1)]
    regs += [[8 * (1 << j), 0] for j in range((block_n // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[], block_bases=[], shape=[block_n, words])


@gluon.constexpr_function
def _value_load_layout(block_n, head_dim, kv_fp8):
    """V's int32 words [block_n, W] in cache order: lane (g, t) holds keys 2t + e + 8h + 16s and the
    head_dim / 8 values from value (head_dim / 8) g (O^T's A operand, after `_value_dim_perm`)."""
    words = head_dim // _values_per_word(kv_fp8)
    per_lane = words // 8  # a lane's words of one value row
    regs = [[0, 1 << b] for b in range(per_lane.bit_length() - 1)]
    regs += [[1, 0], [8, 0]] + [[16 * (1 << s), 0] for s in range((block_n // 16).bit_length() - 1)]
    lanes = [[2, 0], [4, 0], [0, per_lane], [0, 2 * per_lane], [0, 4 * per_lane]]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[], block_bases=[],
                                      shape=[block_n, words])


@gluon.jit
def _words_to_values(w, like, KV_FP8: gl.constexpr, E5M2: gl.constexpr):
    """[R, C] int32 words of the cache -> [R, C x values a word] in `like`'s dtype, in memory order: an fp8
    cache's 4 values a word converted to fp16 (two `cvt` a word), a 16-bit cache's 2 reinterpreted.
    The words, not their values, are what the loop carries from one tile to the next: a tile of
    bytes kept in registers cost a byte extract and repack per value (PRMT, 582 instructions a
    16-key tile against 231)."""
    if KV_FP8:
        fmt: gl.constexpr = "e5m2x2" if E5M2 else "e4m3x2"
        b0, b1, b2, b3 = gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 r0, r1; mov.b32 {lo, hi}, $4; "
            f"cvt.rn.f16x2.{fmt} r0, lo; cvt.rn.f16x2.{fmt} r1, hi; "
            "mov.b32 {$0, $1}, r0; mov.b32 {$2, $3}, r1; }",
            "=h,=h,=h,=h,r", [w], dtype=(like.dtype, like.dtype, like.dtype, like.dtype), is_pure=True, pack=1)
        x = gl.join(gl.join(b0, b2), gl.join(b1, b3))                    # [R, C, 2, 2]: x[r, c, i, j] = b(2i + j)
        values = gl.reshape(x, [w.shape[0], w.shape[1] * 4])
    else:
        lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [w], dtype=(like.dtype, like.dtype),
                                           is_pure=True, pack=1)
        values = gl.reshape(gl.join(lo, hi), [w.shape[0], w.shape[1] * 2])
    return values


@gluon.jit
def _head_dim_perm(x, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, PIECE: gl.constexpr):
    """x [ROWS, D] in cache order -> the same values, columns in S^T's k order: cache column
    4 PIECE a + PIECE t + 4r + 2h + e becomes k = 4 PIECE a + 16r + 8h + 2t + e (PIECE: `_piece`)."""
    x = gl.reshape(x, [ROWS, HEAD_DIM // (4 * PIECE), 4, PIECE // 4, 2, 2])
    x = gl.permute(x, [0, 1, 3, 4, 2, 5])
    return gl.reshape(x, [ROWS, HEAD_DIM])


@gluon.jit
def _value_dim_perm(x, COLS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """x [D, COLS], rows in cache order -> rows in O^T's m order: cache row (D / 8) g + 2i + h
    becomes m = 16i + 8h + g."""
    x = gl.reshape(x, [8, HEAD_DIM // 16, 2, COLS])
    x = gl.permute(x, [1, 2, 0, 3])
    return gl.reshape(x, [HEAD_DIM, COLS])


@gluon.constexpr_function
def _query_layout():
    """The group's query rows [8, D] (and the halves and RoPE tables of the fused RoPE)."""
    return gl.BlockedLayout([1, 4], [2, 16], [1, 1], [1, 0])


@gluon.jit
def _query_b_operand(q, HEAD_DIM: gl.constexpr, PIECE: gl.constexpr, DTYPE: gl.constexpr):
    """The group's queries q [8, D] as S^T's B operand: q^T [D, 8] in DTYPE (fp16 clamped to its range
    over an fp8 cache), rows in k order."""
    if DTYPE == gl.float16:
        q = gl.minimum(gl.maximum(q.to(gl.float32), -FP16_MAX), FP16_MAX)
    q_t = gl.permute(_head_dim_perm(q.to(DTYPE), MAX_GROUP, HEAD_DIM, PIECE), [1, 0])   # [D, 8]
    return gl.convert_layout(q_t, gl.DotOperandLayout(1, _mma_layout(), 2))


@gluon.jit
def _load_query(q_ptr, token, kv_head, stride_qt, stride_qh, QPK: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The group's queries [8, D], heads past QPK zero."""
    heads = gl.arange(0, MAX_GROUP, layout=gl.SliceLayout(1, _query_layout()))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, _query_layout()))
    ptrs = q_ptr + token * stride_qt + (kv_head * QPK + heads)[:, None] * stride_qh + dims[None, :]
    return gl.load(ptrs, mask=(heads < QPK)[:, None], other=0.0)


@gluon.jit
def _block_of(block_table_ptr, tile, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """The cache block that holds tile `tile` (a tile lies in one block: PAGE_SIZE % BLOCK_N == 0)."""
    return gl.load(block_table_ptr + tile * BLOCK_N // PAGE_SIZE).to(gl.int64)


@gluon.jit
def _load_tiles(k_cache_ptr, v_cache_ptr, block, tile, ctx_len, kv_head,
                stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh,
                BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, MASKED: gl.constexpr,
                KV_FP8: gl.constexpr):
    """Tile `tile`'s K and V words in cache order and their load layouts ([BLOCK_N, W] int32 each:
    the cache seen as int32, strides in words), from cache block `block` (`_block_of`). MASKED:
    keys at or past ctx_len read 0."""
    k_layout: gl.constexpr = _key_load_layout(BLOCK_N, HEAD_DIM, KV_FP8)
    v_layout: gl.constexpr = _value_load_layout(BLOCK_N, HEAD_DIM, KV_FP8)
    words: gl.constexpr = HEAD_DIM // _values_per_word(KV_FP8)
    first = tile * BLOCK_N
    row0 = first % PAGE_SIZE
    k_keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, k_layout))
    k_words = gl.arange(0, words, layout=gl.SliceLayout(0, k_layout))
    v_keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_layout))
    v_words = gl.arange(0, words, layout=gl.SliceLayout(0, v_layout))
    k_base = k_cache_ptr + block * stride_kb + kv_head * stride_kh
    v_base = v_cache_ptr + block * stride_vb + kv_head * stride_vh
    k_ptrs = k_base + (row0 + k_keys)[:, None] * stride_kr + k_words[None, :]
    v_ptrs = v_base + (row0 + v_keys)[:, None] * stride_vr + v_words[None, :]
    if MASKED:
        k = gl.load(k_ptrs, mask=(first + k_keys < ctx_len)[:, None], other=0)
        v = gl.load(v_ptrs, mask=(first + v_keys < ctx_len)[:, None], other=0)
    else:
        k = gl.load(k_ptrs)
        v = gl.load(v_ptrs)
    return k, v


@gluon.jit
def _transpose_8x8(x):
    """x [R, 8] fp16 in an mma accumulator's layout (R a multiple of 8) -> the same values in the
    layout of an mma B operand ([K, N] = [R, 8]), by `movmatrix.trans` of each 8 x 8 block: the
    instruction's result, read in x's layout, is y[8b + r, c] = x[8b + c, r], and transposing each
    block back as a tensor leaves the values where the B operand's layout holds them."""
    y = gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [x],
                                  dtype=x.dtype, is_pure=True, pack=2)
    rows: gl.constexpr = x.shape[0]
    y = gl.permute(gl.reshape(y, [rows // 8, 8, 8]), [0, 2, 1])
    return gl.reshape(y, [rows, 8])


@gluon.jit
def _attend(acc_t, m_i, l_i, q_b, k, v, tile, ctx_len, scale_log2,
            BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, MASKED: gl.constexpr, KV_FP8: gl.constexpr,
            E5M2: gl.constexpr):
    """One online-softmax step over a loaded tile (k, v: `_load_tiles`' words). acc_t O^T [D, 8]
    (rows in m order); m_i [8] per query head; l_i [BLOCK_N, 8] per-key partial sums of the
    softmax's denominator (summed over keys at the end); q_b S^T's B operand, in the products' dtype."""
    mma: gl.constexpr = _mma_layout()
    k = _head_dim_perm(_words_to_values(k, q_b, KV_FP8, E5M2), BLOCK_N, HEAD_DIM, _piece(KV_FP8))  # [BLOCK_N, D]
    k_a = gl.convert_layout(k, gl.DotOperandLayout(0, mma, 2), assert_trivial=True)
    s_t = mma_v2(k_a, q_b, gl.zeros([BLOCK_N, MAX_GROUP], gl.float32, mma)) * scale_log2  # [BLOCK_N, 8]
    if MASKED:
        keys = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        s_t = gl.where((keys < ctx_len)[:, None], s_t, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s_t, 0))                                       # [8]
    alpha = gl.exp2(m_i - m_new)
    p_t = gl.exp2(s_t - m_new[None, :])                                           # [BLOCK_N, 8]
    l_i = l_i * alpha[None, :] + p_t
    p_b = gl.convert_layout(_transpose_8x8(p_t.to(q_b.dtype)), gl.DotOperandLayout(1, mma, 2),
                            assert_trivial=True)                                  # P^T [BLOCK_N, 8]
    v_t = _value_dim_perm(gl.permute(_words_to_values(v, q_b, KV_FP8, E5M2), [1, 0]), BLOCK_N, HEAD_DIM)  # [D, BLOCK_N]
    v_a = gl.convert_layout(v_t, gl.DotOperandLayout(0, mma, 2), assert_trivial=True)
    acc_t = mma_v2(v_a, p_b, acc_t * alpha[None, :])                              # [D, 8]
    return acc_t, m_new, l_i


@gluon.jit(do_not_specialize=RUN_TIME_ARGS)
def decode_mma_kernel(
        out_ptr, part_out_ptr, part_lse_ptr,
        q_ptr, k_cache_ptr, v_cache_ptr,
        cu_seqlens_q_ptr, seq_lens_k_ptr, block_tables_ptr, scale_log2, k_scale_ptr, v_scale_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, stride_bt,
        stride_pt, stride_ph, stride_lt, stride_lh, num_splits,
        k_new_ptr, v_new_ptr, pos_ptr, slot_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr, rope_eps,
        stride_knt, stride_knh, stride_vnt, stride_vnh,
        QPK: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
        PREFETCH: gl.constexpr, KV_FP8: gl.constexpr, E5M2: gl.constexpr, IS_SPLIT: gl.constexpr,
        ROPE: gl.constexpr, QK_NORM: gl.constexpr, FP8_MAX: gl.constexpr, PDL: gl.constexpr):
    """Grid: (KV heads x splits, sequences). KV_FP8: an fp8 cache (E5M2: e5m2, else e4m3), products in
    fp16, per-KV-head scales; else a 16-bit cache of q's dtype, products in it. PREFETCH: tiles whose
    loads are in flight while one is computed (1 or 2).

    ROPE (triton_attn.DECODE_FUSED_ROPE), as in triton_attn's decode tile: q and the new key and value
    are this step's before q/k norm (QK_NORM) and RoPE; the program of the split whose tiles hold the
    new key stores it into the cache first (triton_kv_write's helpers, the same rounding as the RoPE
    kernel's)."""
    mma: gl.constexpr = _mma_layout()
    DTYPE: gl.constexpr = gl.float16 if KV_FP8 else q_ptr.dtype.element_ty
    launch_dependents(PDL)
    wait_for_prior_grid(PDL)
    seq = gl.program_id(1)
    kv_head = gl.program_id(0) // num_splits
    split = gl.program_id(0) % num_splits
    token = gl.load(cu_seqlens_q_ptr + seq)
    if gl.load(cu_seqlens_q_ptr + seq + 1) == token:  # no query this step
        return
    ctx_len, scale_log2, v_scale = decode_context(seq_lens_k_ptr, k_scale_ptr, v_scale_ptr, seq, kv_head, scale_log2,
                                                  KV_FP8)
    if ROPE:
        q = _rope_query_and_store_kv(
            q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, token, kv_head, ctx_len, split, num_splits,
            stride_qt, stride_qh, stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh,
            k_new_ptr, v_new_ptr, pos_ptr, slot_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr, rope_eps,
            stride_knt, stride_knh, stride_vnt, stride_vnh,
            QPK, BLOCK_N, HEAD_DIM, PAGE_SIZE, KV_FP8, E5M2, QK_NORM, FP8_MAX)
    else:
        q = _load_query(q_ptr, token, kv_head, stride_qt, stride_qh, QPK, HEAD_DIM)
    q_b = _query_b_operand(q, HEAD_DIM, _piece(KV_FP8), DTYPE)

    # one query at the context's end: it sees every key, so only the last tile is masked
    tile_begin, full_end, masked_begin, tile_end = split_tile_range(ctx_len, ctx_len, split, num_splits, BLOCK_N)

    m_i = gl.full([MAX_GROUP], RUNNING_MAX_INIT, gl.float32, gl.SliceLayout(0, mma))
    l_i = gl.zeros([BLOCK_N, MAX_GROUP], gl.float32, mma)
    acc_t = gl.zeros([HEAD_DIM, MAX_GROUP], gl.float32, mma)
    block_table_ptr = block_tables_ptr + seq.to(gl.int64) * stride_bt
    if tile_begin < full_end:
        # registers hold the next PREFETCH tiles' K and V while this one is used, and the block id of the one
        # after them (a tile's loads wait for its block id: read a tile earlier, its latency is off the path)
        last = full_end - 1
        k, v = _load_tiles(k_cache_ptr, v_cache_ptr, _block_of(block_table_ptr, tile_begin, BLOCK_N, PAGE_SIZE),
                           tile_begin, ctx_len, kv_head, stride_kb, stride_kr, stride_kh, stride_vb, stride_vr,
                           stride_vh, BLOCK_N, HEAD_DIM, PAGE_SIZE, False, KV_FP8)
        if PREFETCH == 2:
            second = gl.minimum(tile_begin + 1, last)
            k2, v2 = _load_tiles(k_cache_ptr, v_cache_ptr, _block_of(block_table_ptr, second, BLOCK_N, PAGE_SIZE),
                                 second, ctx_len, kv_head, stride_kb, stride_kr, stride_kh, stride_vb, stride_vr,
                                 stride_vh, BLOCK_N, HEAD_DIM, PAGE_SIZE, False, KV_FP8)
        next_block = _block_of(block_table_ptr, gl.minimum(tile_begin + PREFETCH, last), BLOCK_N, PAGE_SIZE)
        for tile in range(tile_begin, full_end):
            k_next, v_next = _load_tiles(k_cache_ptr, v_cache_ptr, next_block, gl.minimum(tile + PREFETCH, last),
                                         ctx_len, kv_head, stride_kb, stride_kr, stride_kh, stride_vb, stride_vr,
                                         stride_vh, BLOCK_N, HEAD_DIM, PAGE_SIZE, False, KV_FP8)
            next_block = _block_of(block_table_ptr, gl.minimum(tile + PREFETCH + 1, last), BLOCK_N, PAGE_SIZE)
            acc_t, m_i, l_i = _attend(acc_t, m_i, l_i, q_b, k, v, tile, ctx_len, scale_log2,
                                      BLOCK_N, HEAD_DIM, False, KV_FP8, E5M2)
            if PREFETCH == 2:
                k = k2
                v = v2
                k2 = k_next
                v2 = v_next
            else:
                k = k_next
                v = v_next
    for tile in range(masked_begin, tile_end):
        k, v = _load_tiles(k_cache_ptr, v_cache_ptr, _block_of(block_table_ptr, tile, BLOCK_N, PAGE_SIZE), tile,
                           ctx_len, kv_head, stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh,
                           BLOCK_N, HEAD_DIM, PAGE_SIZE, True, KV_FP8)
        acc_t, m_i, l_i = _attend(acc_t, m_i, l_i, q_b, k, v, tile, ctx_len, scale_log2,
                                  BLOCK_N, HEAD_DIM, True, KV_FP8, E5M2)
    _store(out_ptr, part_out_ptr, part_lse_ptr, acc_t, m_i, gl.sum(l_i, 0), v_scale, token, kv_head, split,
           stride_ot, stride_oh, stride_pt, stride_ph, stride_lt, stride_lh, QPK, HEAD_DIM, IS_SPLIT)


@gluon.jit
def _rope_query_and_store_kv(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, token, kv_head, ctx_len,
                             split, num_splits, stride_qt, stride_qh, stride_kb, stride_kr, stride_kh,
                             stride_vb, stride_vr, stride_vh, k_new_ptr, v_new_ptr, pos_ptr, slot_ptr, cos_sin_ptr,
                             q_w_ptr, k_w_ptr, rope_eps, stride_knt, stride_knh, stride_vnt, stride_vnh,
                             QPK: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                             PAGE_SIZE: gl.constexpr, KV_FP8: gl.constexpr, E5M2: gl.constexpr,
                             QK_NORM: gl.constexpr, FP8_MAX: gl.constexpr):
    """The fused RoPE (ROPE): the group's queries [8, D] normed and rotated, and, in the program of the
    split whose tiles hold the new key, this step's key and value stored into the cache (through
    element pointers: the kernel reads the cache as words), visible to the program's loads after."""
    half_dims = gl.arange(0, HEAD_DIM // 2, layout=gl.SliceLayout(0, _query_layout()))[None, :]
    cos, sin = load_cos_sin(cos_sin_ptr, gl.load(pos_ptr + token), half_dims)
    heads = gl.arange(0, MAX_GROUP, layout=gl.SliceLayout(1, _query_layout()))
    q = rope_q_rows(q_ptr, token + heads * 0, kv_head * QPK + heads, heads < QPK, stride_qt, stride_qh, q_w_ptr,
                    cos, sin, rope_eps, half_dims, QK_NORM)             # [8, D]
    if split == split_of_last_key(ctx_len, num_splits, BLOCK_N):
        if KV_FP8:
            elem: gl.constexpr = gl.float8e5 if E5M2 else gl.float8e4nv
        else:
            elem: gl.constexpr = q_ptr.dtype.element_ty
        vpw: gl.constexpr = _values_per_word(KV_FP8)
        rope_store_new_kv(k_new_ptr, v_new_ptr, token, kv_head, slot_ptr,
                          k_cache_ptr.to(gl.pointer_type(elem), bitcast=True),
                          v_cache_ptr.to(gl.pointer_type(elem), bitcast=True), k_scale_ptr, v_scale_ptr, k_w_ptr,
                          cos, sin, rope_eps, stride_knt, stride_knh, stride_vnt, stride_vnh,
                          stride_kb * vpw, stride_kr * vpw, stride_kh * vpw, stride_vb * vpw, stride_vr * vpw,
                          stride_vh * vpw, 1, half_dims, PAGE_SIZE, QK_NORM, KV_FP8, FP8_MAX)
        tl.debug_barrier()  # the key and value written are visible to the program's loads below
    return q


@gluon.jit
def _store(out_ptr, part_out_ptr, part_lse_ptr, acc_t, m_i, l_i, v_scale, token, kv_head, split,
           stride_ot, stride_oh, stride_pt, stride_ph, stride_lt, stride_lh,
           QPK: gl.constexpr, HEAD_DIM: gl.constexpr, IS_SPLIT: gl.constexpr):
    """O = acc / l (times the value scale) at the group's heads, dimensions back in cache order; a
    split's partial output and log2-sum-exp instead where IS_SPLIT. m_i, l_i [8] per query head."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, 1], [0, 1])  # [D, 8]: a column's rows on lanes
    has_keys = l_i > 0.0  # false only for a split past the end of a short context
    l_safe = gl.convert_layout(gl.where(has_keys, l_i, 1.0), gl.SliceLayout(0, layout))
    o_t = gl.convert_layout(acc_t, layout) / l_safe[None, :] * v_scale           # [D, 8]
    m_rows = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, layout))
    dims = (HEAD_DIM // 8) * (m_rows % 8) + m_rows // 8                 # [D] cache order of O^T's rows
    cols = gl.arange(0, MAX_GROUP, layout=gl.SliceLayout(0, layout))
    heads = kv_head * QPK + cols                                         # [8]
    mask = (cols < QPK)[None, :]
    if not IS_SPLIT:
        ptrs = out_ptr + token * stride_ot + heads[None, :] * stride_oh + dims[:, None]
        gl.store(ptrs, o_t.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ptrs = part_out_ptr + token * stride_pt + heads[None, :] * stride_ph + split * HEAD_DIM + dims[:, None]
        gl.store(ptrs, o_t, mask=mask)
        head_ids = gl.arange(0, MAX_GROUP, layout=m_i.type.layout)
        lse = gl.where(has_keys, m_i + gl.log2(gl.where(has_keys, l_i, 1.0)), float("-inf"))
        gl.store(part_lse_ptr + token * stride_lt + (kv_head * QPK + head_ids) * stride_lh + split, lse,
                 mask=head_ids < QPK)
