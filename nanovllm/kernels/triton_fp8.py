"""Triton kernel of the fp8 linear path: per-token (row) quantization of activations.

`quantize_rows(x)` is `layers/quantization/fp8.quantize_rows` in one launch (the torch
version is five elementwise kernels and a reduction per linear layer, which a decode step
of a 36-layer model pays 144 times): one program per row computes its amax, its scale
(amax / 448, at least MIN_SCALE) and the clamped e4m3 values.

Variants: BLOCK = the row length rounded up to a power of two (one per distinct input
size of the model's linear layers: hidden and intermediate sizes, a bounded set fixed by
the model config); the number of rows is a grid size, never a constexpr.
"""
import torch
import triton
import triton.language as tl

NUM_WARPS = 8


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, cols,
                          FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    scale = tl.maximum(tl.max(tl.abs(x), 0) / FP8_MAX, MIN_SCALE)
    q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
    tl.store(out_ptr + row * stride_o + offs, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor, fp8_dtype: torch.dtype, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (last dim contiguous) -> (fp8 [rows, cols], float32 scales [rows, 1])."""
    rows, cols = x.shape
    assert x.stride(1) == 1
    out = torch.empty((rows, cols), dtype=fp8_dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, out, scale, x.stride(0), out.stride(0), cols,
                                       FP8_MAX=torch.finfo(fp8_dtype).max, MIN_SCALE=min_scale,
                                       BLOCK=triton.next_power_of_2(cols), num_warps=NUM_WARPS)
    return out, scale
