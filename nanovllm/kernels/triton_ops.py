"""Fused small ops for the GPU path, in Triton: RMSNorm (+ residual add),
q/k RMSNorm + RoPE (+ the K/V cache write), SiLU-and-mul, and the in-place advance of
a decode round's inputs between CUDA graph replays (`advance_decode_`, the math of
`ModelRunner._advance_decode`).

Unfused, each of these is several elementwise kernels per layer; in a decode step
that is mostly launch time, even inside a CUDA graph. Each kernel here reads its
inputs once and writes its outputs once. The math matches the torch versions in
`kernels/fused_ops.py` (float32 inside, rounding to the input dtype where HF does). The RMSNorm's
and SiLU-and-mul's arithmetic (`residual_rms_norm_row`, `silu_and_mul_cols`) is shared with
kernels/triton_fused_quant.py, whose forms quantize the result to per-token fp8 instead of storing it.

Compiled variants, per model: RMSNorm with and without the residual, RoPE with the K/V store
(the GPU path always stores), SiLU-and-mul, and the round advance (its row count is
`do_not_specialize`); token counts are only grids. engine/warmup.py meets them all at start-up.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.fused_ops import KVStore
from nanovllm.kernels.triton_attn import _check_scales, _check_v_layout, fp8_max
from nanovllm.kernels.triton_kv_write import load_cos_sin, norm_rope_halves, store_kv_rows
from nanovllm.kernels.triton_pdl import launch_dependents, launch_options, wait_for_prior_grid


@triton.jit
def inv_rms(xf, hidden, eps):
    """1 / rms of a float32 row of `hidden` values (lanes past it zero)."""
    return tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)


@triton.jit
def rms_scaled(x, row_inv_rms, w):
    """w * x / rms as HF rounds it: x / rms to x's dtype first, then the product."""
    return (w * (x.to(tl.float32) * row_inv_rms).to(x.dtype)).to(x.dtype)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up: gate float32, silu(gate) rounded to up's dtype before the product."""
    return (gate / (1 + tl.exp(-gate))).to(up.dtype) * up


@triton.jit
def residual_rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, stride_x, stride_r, stride_ro, hidden, eps,
                          HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One row: [res_out =] x (+ res), stored; returns w * (res_out / rms(res_out)) in x's dtype
    (lanes past `hidden` zero): [BLOCK]."""
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    row_inv_rms = inv_rms(x.to(tl.float32), hidden, eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return rms_scaled(x, row_inv_rms, w)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                     stride_ro, hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    """One program per row: [res_out =] x (+ res); out = w * (res_out / rms(res_out))."""
    launch_dependents(PDL)
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    y = residual_rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, stride_x, stride_r, stride_ro, hidden, eps,
                              HAS_RESIDUAL, BLOCK)
    cols = tl.arange(0, BLOCK)
    tl.store(out_ptr + row * stride_o + cols, y, mask=cols < hidden)


# warps of an RMSNorm program (Triton's default): the layout of a row, hence the order of its sum of
# squares, which triton_fused_quant's RMSNorm must share to round as this one does
RMS_NORM_WARPS = 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """x: [num_tokens, hidden] -> out (and the new residual x + residual, when given)."""
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        x.shape[1], eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(x.shape[1]),
        num_warps=RMS_NORM_WARPS, **launch_options(x.device))
    return out if residual is None else (out, res_out)


@triton.jit
def _norm_rope_heads(x_ptr, w_ptr, cos, sin, token, stride_t, stride_h, num_heads, eps,
                     HALF: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr):
    """The heads of one token of q or k, in place: optional per-head RMSNorm, then RoPE.
    Returns the rotated halves.  # 2 x [BLOCK_H, HALF]"""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    base = x_ptr + token * stride_t + heads * stride_h
    y1, y2 = norm_rope_halves(tl.load(base + dims, mask=mask, other=0.0),
                              tl.load(base + HALF + dims, mask=mask, other=0.0), w_ptr, cos, sin, eps,
                              dims, HAS_NORM)
    tl.store(base + dims, y1, mask=mask)
    tl.store(base + HALF + dims, y2, mask=mask)
    return y1, y2


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr, pos_ptr,
                         v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cb, stride_cr, stride_ch, stride_vcb, stride_vcr, stride_vch, stride_vcd,
                         num_q_heads, num_k_heads, eps,
                         HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                         BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                         STORE_KV: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    """Two programs per token (one launch for both): its q heads (program 0 of axis 1), and its
    k heads (program 1); with STORE_KV, the latter also writes the token's rotated k and its v
    into their cache slot (none for slot -1), quantized with each head's scale for an fp8
    cache (KV_FP8)."""
    launch_dependents(PDL)
    wait_for_prior_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = load_cos_sin(cos_sin_ptr, tl.load(pos_ptr + token), tl.arange(0, HALF)[None, :])
    if tl.program_id(1) == 0:
        _norm_rope_heads(q_ptr, q_w_ptr, cos, sin, token, stride_qt, stride_qh, num_q_heads, eps,
                         HALF, HAS_NORM, BLOCK_QH)
    else:
        _rope_k_and_store(k_ptr, k_w_ptr, cos, sin, token, stride_kt, stride_kh, num_k_heads, eps,
                          v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                          stride_vt, stride_vh, stride_cb, stride_cr, stride_ch,
                          stride_vcb, stride_vcr, stride_vch, stride_vcd,
                          HALF, HAS_NORM, BLOCK_KH, STORE_KV, PAGE_SIZE, KV_FP8, FP8_MAX)


@triton.jit
def _rope_k_and_store(k_ptr, k_w_ptr, cos, sin, token, stride_kt, stride_kh, num_k_heads, eps,
                      v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                      stride_vt, stride_vh, stride_cb, stride_cr, stride_ch,
                      stride_vcb, stride_vcr, stride_vch, stride_vcd,
                      HALF: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_KH: tl.constexpr,
                      STORE_KV: tl.constexpr, PAGE_SIZE: tl.constexpr,
                      KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """A token's k heads normed and rotated in place; with STORE_KV, k and v into the cache."""
    k1, k2 = _norm_rope_heads(k_ptr, k_w_ptr, cos, sin, token, stride_kt, stride_kh, num_k_heads, eps,
                              HALF, HAS_NORM, BLOCK_KH)
    if STORE_KV:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            heads = tl.arange(0, BLOCK_KH)[:, None]
            store_kv_rows(k1, k2, v_ptr + token * stride_vt, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                          slot, heads, heads < num_k_heads, stride_vh, stride_cb, stride_cr, stride_ch,
                          stride_vcb, stride_vcr, stride_vch, stride_vcd, tl.arange(0, HALF)[None, :], PAGE_SIZE,
                          KV_FP8, FP8_MAX)


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                  kv_store: KVStore | None = None) -> None:
    """In place on q: [num_tokens, num_heads, head_dim] and k: [num_tokens, num_kv_heads,
    head_dim] (strided views are fine): per-head RMSNorm when weights are given, then RoPE.
    With `kv_store`, the rotated keys and the values also go into the
    cache slots (what the attention backend's store_kvcache would do, one launch fewer).

    cos_sin_cache: [max_position, head_dim] float32, cos | sin halves.
    """
    num_tokens, num_heads, head_dim = q.shape
    assert q.stride(2) == 1 and k.stride(2) == 1 and k.shape[2] == head_dim
    assert head_dim % 2 == 0 and triton.next_power_of_2(head_dim) == head_dim
    assert (q_weight is None) == (k_weight is None)
    if kv_store is not None:
        v, k_cache, v_cache = kv_store.value, kv_store.k_cache, kv_store.v_cache
        assert v.shape == k.shape and v.stride(2) == 1
        assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == k.shape[1:] and k_cache.stride(3) == 1
        _check_v_layout(v_cache)
        slots, page_size = kv_store.slot_mapping, k_cache.shape[1]
        kv_fp8 = _check_scales(k_cache, kv_store.k_scale, kv_store.v_scale)
        v_cache_strides = v_cache.stride()
    else:  # unused pointers and strides
        v, k_cache, v_cache, slots, page_size, kv_fp8 = k, k, k, positions, 1, False
        v_cache_strides = (*k.stride(), 1)
    k_scale, v_scale = (kv_store.k_scale, kv_store.v_scale) if kv_fp8 else (positions, positions)
    _qk_norm_rope_kernel[(num_tokens, 2)](
        q, k, q_weight if q_weight is not None else q, k_weight if k_weight is not None else k,
        cos_sin_cache, positions, v, k_cache, v_cache, slots, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *v_cache_strides,
        num_heads, k.shape[1], eps, HALF=head_dim // 2, HAS_NORM=q_weight is not None,
        BLOCK_QH=triton.next_power_of_2(num_heads), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        STORE_KV=kv_store is not None, PAGE_SIZE=page_size, KV_FP8=kv_fp8, FP8_MAX=fp8_max(k_cache),
        **launch_options(q.device))


@triton.jit
def silu_and_mul_cols(x_ptr, row, stride_x, d, cols, mask):
    """silu(gate) * up at columns `cols` of one row of x [num_tokens, 2 * d] (gate | up), in x's
    dtype; masked lanes zero."""
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    return silu_mul(gate, up)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    y = silu_and_mul_cols(x_ptr, row, stride_x, d, cols, mask)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


SILU_BLOCK = 1024  # columns per program


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d]"""
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, SILU_BLOCK))](
        x, out, x.stride(0), out.stride(0), d, BLOCK=SILU_BLOCK, **launch_options(x.device))
    return out


@triton.jit(do_not_specialize=["num_seqs"])  # one compile for every batch size
def _advance_decode_kernel(token_ids_ptr, input_ids_ptr, positions_ptr, slot_ptr, seq_lens_ptr,
                           block_tables_ptr, stride_bt, num_seqs,
                           BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Rows [0, num_seqs): the next decode step's inputs, in place, from this step's tokens."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < num_seqs
    position = tl.load(positions_ptr + rows, mask=mask, other=0) + 1
    block = tl.load(block_tables_ptr + rows.to(tl.int64) * stride_bt + position // BLOCK_SIZE, mask=mask, other=0)
    tl.store(positions_ptr + rows, position, mask=mask)
    tl.store(slot_ptr + rows, block.to(tl.int64) * BLOCK_SIZE + position % BLOCK_SIZE, mask=mask)
    tl.store(seq_lens_ptr + rows, tl.load(seq_lens_ptr + rows, mask=mask, other=0) + 1, mask=mask)
    tl.store(input_ids_ptr + rows, tl.load(token_ids_ptr + rows, mask=mask, other=0), mask=mask)


ADVANCE_BLOCK = 256  # rows per program


def advance_decode_(token_ids: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, seq_lens_k: torch.Tensor, block_tables: torch.Tensor,
                    block_size: int) -> None:
    """One launch for what the next step of a decode round needs, written in place over this
    step's inputs (a CUDA graph's static buffers): input_ids = token_ids, positions += 1,
    seq_lens_k += 1, slot_mapping = the new position's cache slot through block_tables.

    token_ids: [num_seqs] int64; input_ids, positions, slot_mapping: [>= num_seqs] int64;
    seq_lens_k: [>= num_seqs] int32; block_tables: [>= num_seqs, max_blocks] int32 (covering
    the new positions). Rows from num_seqs on (a graph's padding) are left as they are.
    """
    num_seqs = token_ids.shape[0]
    assert block_tables.stride(1) == 1 and all(t.shape[0] >= num_seqs for t in
                                               (input_ids, positions, slot_mapping, seq_lens_k, block_tables))
    _advance_decode_kernel[(triton.cdiv(num_seqs, ADVANCE_BLOCK),)](
        token_ids, input_ids, positions, slot_mapping, seq_lens_k, block_tables, block_tables.stride(0),
        num_seqs, BLOCK_SIZE=block_size, BLOCK=ADVANCE_BLOCK)
