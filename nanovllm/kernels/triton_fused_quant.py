"""RMSNorm (+ residual add) and SiLU-and-mul that write their output as per-token fp8, for the
rowwise fp8 product after them (layers/quantization/fp8.py).

Unfused, the fp8 linear layer after an RMSNorm or SiLU-and-mul quantizes its input itself
(triton_fp8.quantize_rows): a second launch that reads back the row the kernel before it just
wrote. Here one program per row computes the op's output in registers, rounded to the input
dtype exactly as kernels/triton_ops.py rounds what it stores (the same `residual_rms_norm_row` /
`silu_and_mul_cols`), then quantizes it with triton_fp8's `quantize_row`, the rounding
`quantize_rows` applies: the fp8 values and scales are those of the two launches, bit for bit,
and the 16-bit output is never written (the residual stream still is).

Bit for bit needs one more thing of the RMSNorm: its sum of squares added in the order
triton_ops.rms_norm adds it, which is set by how Triton lays a row over the threads. The same
warps (triton_ops.RMS_NORM_WARPS) and the same loads give the same layout, as long as no store
of the row's shape widens it: Triton's coalescing gives the loads of a row the widest vector of
any access of the same shape, and a 16-byte fp8 store holds twice the elements of a 16-byte
bf16 load. So the fp8 row is stored as [BLOCK / STORE_CHUNK, STORE_CHUNK] (`_store_row_2d`), a
shape no load has. (The SiLU-and-mul has no sum: its layout changes no value.)

One program per row, the whole row in registers (as `quantize_rows`): the amax needs all of it.
ELEMENTS_PER_WARP sets the SiLU-and-mul's warps from the row length (Qwen3-8B's 12288: 16).

Variants, per model: the RMSNorm with and without the residual (the first layer's input norm has
none), the SiLU-and-mul; BLOCK and the warps from the hidden or intermediate size, the dtypes
from the model. The row count is only the grid. Launched with programmatic dependent launch
where the GPU has it (kernels/triton_pdl.py), as the kernels they replace.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.triton_fp8 import quantize_row
from nanovllm.kernels.triton_ops import RMS_NORM_WARPS, residual_rms_norm_row, silu_and_mul_cols
from nanovllm.kernels.triton_pdl import launch_dependents, launch_options, wait_for_prior_grid

STORE_CHUNK = tl.constexpr(8)  # fp8 elements a row of the RMSNorm's 2-D store holds (one 8-byte store)
ELEMENTS_PER_WARP = 1024  # of a SiLU-and-mul row: 32 a thread
MIN_WARPS, MAX_WARPS = 4, 16


def _silu_num_warps(block: int) -> int:
    return min(max(block // ELEMENTS_PER_WARP, MIN_WARPS), MAX_WARPS)


@triton.jit
def _store_row_2d(row_ptr, q, hidden, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Store q [BLOCK] (float32) at row_ptr's first `hidden` elements, cast to their dtype, as a
    [BLOCK // CHUNK, CHUNK] tile: a shape none of the row's loads has (the module docstring)."""
    offs = tl.arange(0, BLOCK // CHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]  # [BLOCK // CHUNK, CHUNK]
    q2 = tl.reshape(q, (BLOCK // CHUNK, CHUNK))
    tl.store(row_ptr + offs, q2.to(row_ptr.dtype.element_ty), mask=offs < hidden)


@triton.jit
def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                           stride_ro, hidden, eps, HAS_RESIDUAL: tl.constexpr, FP8_MAX: tl.constexpr,
                           MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per row: [res_out =] x (+ res); out, scale = per-token fp8 of w * (res_out / rms)."""
    launch_dependents(PDL)
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    y = residual_rms_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, stride_x, stride_r, stride_ro, hidden, eps,
                              HAS_RESIDUAL, BLOCK)                           # [BLOCK] in x's dtype
    q, scale = quantize_row(y, FP8_MAX, MIN_SCALE)
    _store_row_2d(out_ptr + row * stride_o, q, hidden, BLOCK, STORE_CHUNK)
    tl.store(scale_ptr + row, scale)


def rms_norm_per_token_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                             fp8_dtype: torch.dtype, min_scale: float):
    """x [num_tokens, hidden] (+ residual, the same shape) -> (fp8 [num_tokens, hidden], float32
    scales [num_tokens, 1], the new residual x + residual or None): triton_ops.rms_norm's output
    quantized as triton_fp8.quantize_rows quantizes it."""
    rows, hidden = x.shape
    assert x.stride(1) == 1 and (residual is None or (residual.shape == x.shape and residual.stride(1) == 1))
    out = torch.empty((rows, hidden), dtype=fp8_dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    res, res_dst = (residual, res_out) if residual is not None else (x, x)  # unused pointers without one
    block = triton.next_power_of_2(hidden)
    assert block >= STORE_CHUNK.value, hidden
    if rows:
        _rms_norm_quant_kernel[(rows,)](
            x, res, weight, out, scale, res_dst, x.stride(0), res.stride(0), out.stride(0), res_dst.stride(0),
            hidden, eps, HAS_RESIDUAL=residual is not None, FP8_MAX=torch.finfo(fp8_dtype).max,
            MIN_SCALE=min_scale, BLOCK=block, num_warps=RMS_NORM_WARPS, **launch_options(x.device))
    return out, scale, res_out


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, d, FP8_MAX: tl.constexpr,
                               MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per row: out, scale = per-token fp8 of silu(gate) * up."""
    launch_dependents(PDL)
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    y = silu_and_mul_cols(x_ptr, row, stride_x, d, cols, mask)                # [BLOCK] in x's dtype
    q, scale = quantize_row(y, FP8_MAX, MIN_SCALE)
    tl.store(out_ptr + row * stride_o + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def silu_and_mul_per_token_quant(x: torch.Tensor, fp8_dtype: torch.dtype,
                                 min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [num_tokens, 2 * d] (gate | up) -> (fp8 [num_tokens, d], float32 scales [num_tokens, 1]):
    triton_ops.silu_and_mul's output quantized as triton_fp8.quantize_rows quantizes it."""
    rows, d = x.shape[0], x.shape[1] // 2
    assert x.stride(1) == 1 and x.shape[1] == 2 * d
    out = torch.empty((rows, d), dtype=fp8_dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(d)
    if rows:
        _silu_and_mul_quant_kernel[(rows,)](
            x, out, scale, x.stride(0), out.stride(0), d, FP8_MAX=torch.finfo(fp8_dtype).max, MIN_SCALE=min_scale,
            BLOCK=block, num_warps=_silu_num_warps(block), **launch_options(x.device))
    return out, scale
