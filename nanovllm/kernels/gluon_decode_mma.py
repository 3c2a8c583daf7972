"""Decode attention over an fp8 cache on the tensor cores, with K and V fed from registers.

Triton's decode tile (`triton_attn`) and `triton_decode_fma` both pay for an fp8 cache in the
layouts its bytes travel through: the tile converts K and V to fp16 and restages them through
shared memory in the layouts `mma` wants (for Qwen3-8B's groups of 4 it reads the cache at ~0.60
of copy bandwidth, against 0.93 for a bf16 cache), and decode_fma spends ~1.5 instructions a value
on conversions and reductions (issue-bound at ~0.80 for Qwen3-0.6B's groups of 2). Here, in Gluon
(layouts chosen by hand), each thread loads from global memory exactly the bytes its `mma.sync`
fragments hold, converts them in registers (one `cvt` for two values) and multiplies: nothing goes
through shared memory in the loop.

That works because both products are free to relabel one of their axes:
- S = q K^T sums over the head dimension, so K's dimensions may be taken in any order, q's in the
  same one. The order chosen (`_head_dim_perm`) gives each thread 16 consecutive bytes of a key
  row where its fragment holds 4-byte pieces spread over the row: 16-byte loads.
- O^T = V^T P^T (the transposed product, so that P^T, 8 query heads wide, is the B operand and
  S's accumulator already holds it) has the output's dimensions as its rows; their order is free
  too (undone when the output is stored), and the one chosen (`_value_dim_perm`) gives each thread
  16 consecutive bytes of a value row.
The relabelings are reshapes and permutes of the loaded tiles, whose layouts then equal the
`mma` operand layouts: the conversions to those layouts are asserted to move nothing.

One program (one warp) computes one sequence's query heads of one KV head (up to 8, padded to
mma's 16 rows in S) over one split of its context; splits write partial outputs and log2-sum-exps
for `triton_attn`'s combine kernel. Same arguments and results as `triton_attn.paged_attention`
for a decode-only batch over an fp8 cache with per-KV-head scales; fp16 products (e4m3 and e5m2
are exact in fp16), fp32 accumulation.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from nanovllm.kernels.triton_paged_tiles import RUN_TIME_ARGS, RUNNING_MAX_INIT

MAX_GROUP = gl.constexpr(8)   # query heads of one KV head: P^T's columns, the B operand's n of 8
MMA_M = gl.constexpr(16)      # rows of one mma.sync (m16n8k16)
FP16_MAX = gl.constexpr(65504.0)


@gluon.constexpr_function
def _mma_layout():
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def _key_load_layout(block_n, head_dim):
    """K's words [block_n, head_dim / 4] (4 cache bytes each) in cache order: lane (g, t) = (lane // 4,
    lane % 4) holds keys g + 8j and the 16-byte pieces at bytes 16t + 64a (S's B operand, after
    `_head_dim_perm`)."""
    regs = [[0, 1], [0, 2]]
    regs += [[0, 16 * (1 << a)] for a in range((head_dim // 64).bit_length() - 1)]
    regs += [[8 * (1 << j), 0] for j in range((block_n // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[], block_bases=[], shape=[block_n, head_dim // 4])


@gluon.constexpr_function
def _value_load_layout(block_n, head_dim):
    """V's words [block_n, head_dim / 4] in cache order: lane (g, t) holds keys 2t + e + 8h + 16s and
    the head_dim / 8 bytes from byte (head_dim / 8) g (O^T's A operand, after `_value_dim_perm`)."""
    words = head_dim // 32  # a lane's words of one value row
    regs = [[0, 1 << b] for b in range(words.bit_length() - 1)]
    regs += [[1, 0], [8, 0]] + [[16 * (1 << s), 0] for s in range((block_n // 16).bit_length() - 1)]
    lanes = [[2, 0], [4, 0], [0, words], [0, 2 * words], [0, 4 * words]]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[], block_bases=[],
                                      shape=[block_n, head_dim // 4])


@gluon.jit
def _fp8_words_to_f16(w, E5M2: gl.constexpr):
    """[R, C] int32 words of 4 fp8 values each -> [R, 4C] fp16, in memory order (two `cvt` a word).
    The words, not their bytes, are what the loop carries from one tile to the next: a tile of
    bytes kept in registers costs a byte extract and repack per value."""
    fmt: gl.constexpr = "e5m2x2" if E5M2 else "e4m3x2"
    b0, b1, b2, b3 = gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .b32 r0, r1; mov.b32 {lo, hi}, $4; "
        f"cvt.rn.f16x2.{fmt} r0, lo; cvt.rn.f16x2.{fmt} r1, hi; "
        "mov.b32 {$0, $1}, r0; mov.b32 {$2, $3}, r1; }",
        "=h,=h,=h,=h,r", [w], dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=1)
    x = gl.join(gl.join(b0, b2), gl.join(b1, b3))                        # [R, C, 2, 2]: x[r, c, i, j] = b(2i + j)
    return gl.reshape(x, [w.shape[0], w.shape[1] * 4])


@gluon.jit
def _head_dim_perm(x, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """x [ROWS, D] in cache order -> the same values, columns in S's k order: cache column
    64a + 16t + 4r + 2h + e becomes k = 64a + 16r + 8h + 2t + e."""
    x = gl.reshape(x, [ROWS, HEAD_DIM // 64, 4, 4, 2, 2])
    x = gl.permute(x, [0, 1, 3, 4, 2, 5])
    return gl.reshape(x, [ROWS, HEAD_DIM])


@gluon.jit
def _value_dim_perm(x, COLS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """x [D, COLS], rows in cache order -> rows in O^T's m order: cache row (D / 8) g + 2i + h
    becomes m = 16i + 8h + g."""
    x = gl.reshape(x, [8, HEAD_DIM // 16, 2, COLS])
    x = gl.permute(x, [1, 2, 0, 3])
    return gl.reshape(x, [HEAD_DIM, COLS])


@gluon.jit
def _load_query(q_ptr, token, kv_head, stride_qt, stride_qh, QPK: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The group's queries as S^T's B operand: q^T [D, 8] fp16, rows in k order, heads past QPK zero."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    heads = gl.arange(0, MAX_GROUP, layout=gl.SliceLayout(1, layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    ptrs = q_ptr + token * stride_qt + (kv_head * QPK + heads)[:, None] * stride_qh + dims[None, :]
    q = gl.load(ptrs, mask=(heads < QPK)[:, None], other=0.0)
    q = gl.minimum(gl.maximum(q.to(gl.float32), -FP16_MAX), FP16_MAX).to(gl.float16)
    q_t = gl.permute(_head_dim_perm(q, MAX_GROUP, HEAD_DIM), [1, 0])   # [D, 8]
    return gl.convert_layout(q_t, gl.DotOperandLayout(1, _mma_layout(), 2))


@gluon.jit
def _load_tiles(k_cache_ptr, v_cache_ptr, block_table_ptr, tile, ctx_len, kv_head,
                stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh,
                BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, MASKED: gl.constexpr):
    """Tile `tile`'s K and V words in cache order and their load layouts ([BLOCK_N, D / 4] int32 each:
    the cache seen as int32, strides in words). The tile lies in one page (PAGE_SIZE % BLOCK_N == 0). MASKED: keys at or past ctx_len
    read 0."""
    k_layout: gl.constexpr = _key_load_layout(BLOCK_N, HEAD_DIM)
    v_layout: gl.constexpr = _value_load_layout(BLOCK_N, HEAD_DIM)
    first = tile * BLOCK_N
    block = gl.load(block_table_ptr + first // PAGE_SIZE).to(gl.int64)
    row0 = first % PAGE_SIZE
    k_keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, k_layout))
    k_words = gl.arange(0, HEAD_DIM // 4, layout=gl.SliceLayout(0, k_layout))
    v_keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_layout))
    v_words = gl.arange(0, HEAD_DIM // 4, layout=gl.SliceLayout(0, v_layout))
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
                                  dtype=gl.float16, is_pure=True, pack=2)
    rows: gl.constexpr = x.shape[0]
    y = gl.permute(gl.reshape(y, [rows // 8, 8, 8]), [0, 2, 1])
    return gl.reshape(y, [rows, 8])


@gluon.jit
def _attend(acc_t, m_i, l_i, q_b, k, v, tile, ctx_len, scale_log2,
            BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, MASKED: gl.constexpr, E5M2: gl.constexpr):
    """One online-softmax step over a loaded tile (k, v: `_load_tiles`' words). acc_t O^T [D, 8]
    (rows in m order); m_i [8] per query head; l_i [BLOCK_N, 8] per-key partial sums of the
    softmax's denominator (summed over keys at the end); q_b S^T's B operand."""
    mma: gl.constexpr = _mma_layout()
    k = _head_dim_perm(_fp8_words_to_f16(k, E5M2), BLOCK_N, HEAD_DIM)           # [BLOCK_N, D]
    k_a = gl.convert_layout(k, gl.DotOperandLayout(0, mma, 2), assert_trivial=True)
    s_t = mma_v2(k_a, q_b, gl.zeros([BLOCK_N, MAX_GROUP], gl.float32, mma)) * scale_log2  # [BLOCK_N, 8]
    if MASKED:
        keys = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        s_t = gl.where((keys < ctx_len)[:, None], s_t, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s_t, 0))                                       # [8]
    alpha = gl.exp2(m_i - m_new)
    p_t = gl.exp2(s_t - m_new[None, :])                                           # [BLOCK_N, 8]
    l_i = l_i * alpha[None, :] + p_t
    p_b = gl.convert_layout(_transpose_8x8(p_t.to(gl.float16)), gl.DotOperandLayout(1, mma, 2),
                            assert_trivial=True)                                  # P^T [BLOCK_N, 8]
    v_t = _value_dim_perm(gl.permute(_fp8_words_to_f16(v, E5M2), [1, 0]), BLOCK_N, HEAD_DIM)  # [D, BLOCK_N]
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
        QPK: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
        E5M2: gl.constexpr, IS_SPLIT: gl.constexpr, PDL: gl.constexpr):
    """Grid: (KV heads x splits, sequences)."""
    mma: gl.constexpr = _mma_layout()
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    seq = gl.program_id(1)
    kv_head = gl.program_id(0) // num_splits
    split = gl.program_id(0) % num_splits
    token = gl.load(cu_seqlens_q_ptr + seq)
    if gl.load(cu_seqlens_q_ptr + seq + 1) == token:  # no query this step
        return
    ctx_len = gl.load(seq_lens_k_ptr + seq)
    scale_log2 = scale_log2 * gl.load(k_scale_ptr + kv_head)
    v_scale = gl.load(v_scale_ptr + kv_head)
    q_b = _load_query(q_ptr, token, kv_head, stride_qt, stride_qh, QPK, HEAD_DIM)

    num_tiles = gl.cdiv(ctx_len, BLOCK_N)
    per_split = gl.cdiv(num_tiles, num_splits)
    tile_begin = split * per_split
    tile_end = gl.minimum(tile_begin + per_split, num_tiles)
    full_end = gl.minimum(ctx_len // BLOCK_N, tile_end)
    masked_begin = gl.maximum(tile_begin, full_end)

    m_i = gl.full([MAX_GROUP], RUNNING_MAX_INIT, gl.float32, gl.SliceLayout(0, mma))
    l_i = gl.zeros([BLOCK_N, MAX_GROUP], gl.float32, mma)
    acc_t = gl.zeros([HEAD_DIM, MAX_GROUP], gl.float32, mma)
    block_table_ptr = block_tables_ptr + seq.to(gl.int64) * stride_bt
    if tile_begin < full_end:  # registers hold the next tile's K and V while this one is used
        k, v = _load_tiles(k_cache_ptr, v_cache_ptr, block_table_ptr, tile_begin, ctx_len, kv_head,
                           stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh,
                           BLOCK_N, HEAD_DIM, PAGE_SIZE, False)
        for tile in range(tile_begin, full_end):
            next_tile = gl.minimum(tile + 1, full_end - 1)
            k_next, v_next = _load_tiles(k_cache_ptr, v_cache_ptr, block_table_ptr, next_tile, ctx_len, kv_head,
                                         stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh,
                                         BLOCK_N, HEAD_DIM, PAGE_SIZE, False)
            acc_t, m_i, l_i = _attend(acc_t, m_i, l_i, q_b, k, v, tile, ctx_len, scale_log2,
                                      BLOCK_N, HEAD_DIM, False, E5M2)
            k = k_next
            v = v_next
    for tile in range(masked_begin, tile_end):
        k, v = _load_tiles(k_cache_ptr, v_cache_ptr, block_table_ptr, tile, ctx_len, kv_head,
                           stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh,
                           BLOCK_N, HEAD_DIM, PAGE_SIZE, True)
        acc_t, m_i, l_i = _attend(acc_t, m_i, l_i, q_b, k, v, tile, ctx_len, scale_log2,
                                  BLOCK_N, HEAD_DIM, True, E5M2)
    _store(out_ptr, part_out_ptr, part_lse_ptr, acc_t, m_i, gl.sum(l_i, 0), v_scale, token, kv_head, split,
           stride_ot, stride_oh, stride_pt, stride_ph, stride_lt, stride_lh, QPK, HEAD_DIM, IS_SPLIT)


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
