"""What Triton kernels use to write a token's keys and values into the paged cache: the per-head
RMSNorm (Qwen3's q/k norm) and RoPE of a head's two halves, fp8 quantization with per-KV-head
scales, and the store of a token's K/V rows through its slot.

Shared by `triton_ops`' q/k norm + RoPE kernel (every step) and `triton_attn`'s decode tiles with
the RoPE fused in (DECODE_FUSED_ROPE): both round where HF's torch code rounds (float32 inside,
the input dtype after the norm and after the rotation), so both give the same bits.
"""
import triton
import triton.language as tl


@triton.jit
def quantize_fp8(x, scale, out_dtype: tl.constexpr, FP8_MAX: tl.constexpr):
    """fp8(clamp(x / scale)), as `kv_quant.quantize`: x [..., D]; scale broadcasts over it."""
    y = x.to(tl.float32) / scale
    return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(out_dtype)


@triton.jit
def load_cos_sin(cos_sin_ptr, pos, HALF: tl.constexpr):
    """cos and sin of position `pos` from a [max_position, 2 * HALF] float32 table (cos | sin
    halves).  # 2 x [1, HALF]"""
    dims = tl.arange(0, HALF)[None, :]
    row = cos_sin_ptr + pos.to(tl.int64) * 2 * HALF
    return tl.load(row + dims), tl.load(row + HALF + dims)


@triton.jit
def norm_rope_halves(x1, x2, w_ptr, cos, sin, eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads given as their two halves x1, x2 [ROWS, HALF]: optional per-head RMSNorm with weight
    `w_ptr` [2 * HALF], then RoPE. Returns the rotated halves, in x1's dtype.  # 2 x [ROWS, HALF]"""
    dims = tl.arange(0, HALF)[None, :]
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv_rms = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)
        x1 = tl.load(w_ptr + dims) * (f1 * inv_rms[:, None]).to(x1.dtype)
        x2 = tl.load(w_ptr + HALF + dims) * (f2 * inv_rms[:, None]).to(x2.dtype)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    return (f1 * cos - f2 * sin).to(x1.dtype), (f2 * cos + f1 * sin).to(x1.dtype)


@triton.jit
def _store_halves(row_ptr, x1, x2, scale_ptrs, mask, stride_d, HALF: tl.constexpr, KV_FP8: tl.constexpr,
                  FP8_MAX: tl.constexpr):
    """Store the two halves [ROWS, HALF] at `row_ptr` (+ row offsets; dimension stride `stride_d`),
    quantized with each row's scale (`scale_ptrs`: [ROWS, 1]) for an fp8 cache. A function of its
    own: Triton's compiler refuses a variable whose type changes inside the caller's run-time `if`."""
    dims = tl.arange(0, HALF)[None, :] * stride_d
    if KV_FP8:
        scale = tl.load(scale_ptrs, mask=mask, other=1.0)
        x1 = quantize_fp8(x1, scale, row_ptr.dtype.element_ty, FP8_MAX)
        x2 = quantize_fp8(x2, scale, row_ptr.dtype.element_ty, FP8_MAX)
    tl.store(row_ptr + dims, x1, mask=mask)
    tl.store(row_ptr + HALF * stride_d + dims, x2, mask=mask)


@triton.jit
def store_kv_rows(k1, k2, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot, heads, mask,
                  stride_vh, stride_cb, stride_cr, stride_ch, stride_vcb, stride_vcr, stride_vch, stride_vcd,
                  HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Write one token's K/V rows of KV heads `heads` [ROWS, 1] (`mask` [ROWS, 1]) into cache slot
    `slot` (>= 0): the keys given as halves k1, k2 [ROWS, HALF], the values read from `v_ptr` (the
    token's row; head stride `stride_vh`). V's dimension stride `stride_vcd` allows a key-minor V
    cache (triton_attn.new_kv_cache)."""
    dims = tl.arange(0, HALF)[None, :]
    k_row = k_cache_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cr + heads * stride_ch
    v_row = v_cache_ptr + (slot // PAGE_SIZE) * stride_vcb + (slot % PAGE_SIZE) * stride_vcr + heads * stride_vch
    v_src = v_ptr + heads * stride_vh
    _store_halves(k_row, k1, k2, k_scale_ptr + heads, mask, 1, HALF, KV_FP8, FP8_MAX)
    _store_halves(v_row, tl.load(v_src + dims, mask=mask), tl.load(v_src + HALF + dims, mask=mask),
                  v_scale_ptr + heads, mask, stride_vcd, HALF, KV_FP8, FP8_MAX)
