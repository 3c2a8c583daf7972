"""What Triton kernels use to write a token's keys and values into the paged cache: the per-head
RMSNorm (Qwen3's q/k norm) and RoPE of a head's two halves, fp8 quantization with per-KV-head
scales, and the store of a token's K/V rows through its slot.

Shared by `triton_ops`' q/k norm + RoPE kernel (every step) and the decode attention kernels with
the RoPE fused in (`triton_attn.DECODE_FUSED_ROPE`: its decode tile and `triton_decode_fma`, which
also take a decode step's query rows through `rope_q_rows` and its new K/V through
`rope_store_new_kv`): all round where HF's torch code rounds (float32 inside, the input dtype after
the norm and after the rotation).
"""
import triton
import triton.language as tl


@triton.jit
def quantize_fp8(x, scale, out_dtype: tl.constexpr, FP8_MAX: tl.constexpr):
    """fp8(clamp(x / scale)), as `kv_quant.quantize`: x [..., D]; scale broadcasts over it."""
    y = x.to(tl.float32) / scale
    return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(out_dtype)


@triton.jit
def load_cos_sin(cos_sin_ptr, pos, dims):
    """cos and sin of position `pos` from a [max_position, 2 * HALF] float32 table (cos | sin
    halves); `dims` is arange(HALF)[None, :] (in a Gluon caller, in the layout of the rows it will
    rotate).  # 2 x [1, HALF]"""
    row = cos_sin_ptr + pos.to(tl.int64) * 2 * dims.shape[1]
    return tl.load(row + dims), tl.load(row + dims.shape[1] + dims)


@triton.jit
def norm_rope_halves(x1, x2, w_ptr, cos, sin, eps, dims, HAS_NORM: tl.constexpr):
    """Heads given as their two halves x1, x2 [ROWS, HALF]: optional per-head RMSNorm with weight
    `w_ptr` [2 * HALF], then RoPE (`dims`: arange(HALF)[None, :]). Returns the rotated halves, in
    x1's dtype.  # 2 x [ROWS, HALF]"""
    HALF: tl.constexpr = dims.shape[1]
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv_rms = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)
        x1 = tl.load(w_ptr + dims) * (f1 * inv_rms[:, None]).to(x1.dtype)
        x2 = tl.load(w_ptr + HALF + dims) * (f2 * inv_rms[:, None]).to(x2.dtype)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    return (f1 * cos - f2 * sin).to(x1.dtype), (f2 * cos + f1 * sin).to(x1.dtype)


@triton.jit
def _store_halves(row_ptr, x1, x2, scale_ptrs, mask, dims, stride_d, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Store the two halves [ROWS, HALF] at `row_ptr` (+ row offsets; dimension stride `stride_d`),
    quantized with each row's scale (`scale_ptrs`, broadcast over the row) for an fp8 cache. A
    function of its own: Triton's compiler refuses a variable whose type changes inside the caller's
    run-time `if`."""
    offsets = dims * stride_d
    if KV_FP8:
        scale = tl.load(scale_ptrs, mask=mask, other=1.0)
        x1 = quantize_fp8(x1, scale, row_ptr.dtype.element_ty, FP8_MAX)
        x2 = quantize_fp8(x2, scale, row_ptr.dtype.element_ty, FP8_MAX)
    tl.store(row_ptr + offsets, x1, mask=mask)
    tl.store(row_ptr + dims.shape[1] * stride_d + offsets, x2, mask=mask)


@triton.jit
def store_kv_rows(k1, k2, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot, heads, mask,
                  stride_vh, stride_cb, stride_cr, stride_ch, stride_vcb, stride_vcr, stride_vch, stride_vcd,
                  dims, PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Write one token's K/V rows of KV heads `heads` [ROWS, 1] (or [ROWS, HALF], equal along a row;
    `mask` alike) into cache slot `slot` (>= 0): the keys given as halves k1, k2 [ROWS, HALF], the
    values read from `v_ptr` (the token's row; head stride `stride_vh`). V's dimension stride
    `stride_vcd` allows a key-minor V cache (triton_attn.new_kv_cache). `dims`: arange(HALF)[None, :]."""
    HALF: tl.constexpr = dims.shape[1]
    k_row = k_cache_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cr + heads * stride_ch
    v_row = v_cache_ptr + (slot // PAGE_SIZE) * stride_vcb + (slot % PAGE_SIZE) * stride_vcr + heads * stride_vch
    v_src = v_ptr + heads * stride_vh
    _store_halves(k_row, k1, k2, k_scale_ptr + heads, mask, dims, 1, KV_FP8, FP8_MAX)
    _store_halves(v_row, tl.load(v_src + dims, mask=mask), tl.load(v_src + HALF + dims, mask=mask),
                  v_scale_ptr + heads, mask, dims, stride_vcd, KV_FP8, FP8_MAX)


@triton.jit
def rope_q_rows(q_ptr, tokens, head, row_ok, stride_qt, stride_qh, w_ptr, cos, sin, eps, dims,
                QK_NORM: tl.constexpr):
    """Query rows (tokens, heads) [ROWS] of a decode step, read before their norm and RoPE, normed
    (QK_NORM) and rotated as triton_ops' RoPE kernel does them; zeros where not `row_ok`. `dims`:
    arange(HEAD_DIM // 2)[None, :].  # [ROWS, HEAD_DIM]"""
    HALF: tl.constexpr = dims.shape[1]
    base = q_ptr + tokens[:, None] * stride_qt + head[:, None] * stride_qh + dims
    y1, y2 = norm_rope_halves(tl.load(base, mask=row_ok[:, None], other=0.0),
                              tl.load(base + HALF, mask=row_ok[:, None], other=0.0), w_ptr, cos, sin, eps,
                              dims, QK_NORM)
    return tl.reshape(tl.permute(tl.join(y1, y2), (0, 2, 1)), (y1.shape[0], 2 * HALF))


@triton.jit
def rope_store_new_kv(k_new_ptr, v_new_ptr, token, kv_head, slot_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                      v_scale_ptr, k_w_ptr, cos, sin, eps, stride_knt, stride_knh, stride_vnt, stride_vnh,
                      stride_kb, stride_kr, stride_kh, stride_vb, stride_vr, stride_vh, stride_vd, dims,
                      PAGE_SIZE: tl.constexpr, QK_NORM: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Decode token `token`'s key of `kv_head` normed and rotated, and its value, written into its
    cache slot (none for slot -1), as triton_ops' RoPE kernel writes them. `dims`: arange(HEAD_DIM //
    2)[None, :]."""
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        k_src = k_new_ptr + token * stride_knt + kv_head * stride_knh + dims
        k1, k2 = norm_rope_halves(tl.load(k_src), tl.load(k_src + dims.shape[1]), k_w_ptr, cos, sin, eps, dims,
                                  QK_NORM)
        heads = kv_head + dims * 0  # [1, HALF], the head along the row
        store_kv_rows(k1, k2, v_new_ptr + token * stride_vnt, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                      slot, heads, heads >= 0, stride_vnh, stride_kb, stride_kr, stride_kh,
                      stride_vb, stride_vr, stride_vh, stride_vd, dims, PAGE_SIZE, KV_FP8, FP8_MAX)
