"""The layers before a rowwise fp8 product, writing its input quantized.

An RMSNorm (with the residual add before it) or a SiLU-and-mul whose only reader is an fp8
linear layer that takes per-token fp8 input (`Fp8LinearMethod.takes_quantized_input`; the
pairs are set at load by layers/quantization/__init__.py) returns its output as an
`fp8.QuantizedActivation`: the values and scales that `fp8.quantize_rows` makes of the op's
output, bit for bit. On the GPU each is one Triton launch (kernels/triton_fused_quant.py, vLLM's
"dynamic per-token quant" fusions); elsewhere, and for rows narrower than that RMSNorm takes, the
op and then `quantize_rows`. Inputs are 2-D, [num_tokens, width], as the decoder layers pass them.
"""
import torch

from nanovllm.kernels import fused_ops
from nanovllm.layers.quantization.fp8 import FP8_DTYPE, MIN_SCALE, QuantizedActivation, quantize_rows


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """`fused_ops.rms_norm` with its output quantized per token: a QuantizedActivation, or
    (it, x + residual) when a residual is given. x, residual: [num_tokens, hidden]."""
    assert x.dim() == 2, x.shape
    if x.is_cuda and _fused_norm_takes(x.shape[-1]):
        from nanovllm.kernels import triton_fused_quant
        values, scale, new_residual = triton_fused_quant.rms_norm_per_token_quant(x, weight, eps, residual,
                                                                                  FP8_DTYPE, MIN_SCALE)
        quantized = QuantizedActivation(values, scale, x.dtype)   # triton_ops.rms_norm writes x's dtype
    else:
        out = fused_ops.rms_norm(x, weight, eps, residual)
        y, new_residual = out if residual is not None else (out, None)   # [num_tokens, hidden]
        quantized = QuantizedActivation(*quantize_rows(y), y.dtype)
    return quantized if residual is None else (quantized, new_residual)


def silu_and_mul_quant(x: torch.Tensor) -> QuantizedActivation:
    """`fused_ops.silu_and_mul` (x [num_tokens, 2 * d] -> [num_tokens, d]) with its output
    quantized per token."""
    assert x.dim() == 2, x.shape
    if x.is_cuda:
        from nanovllm.kernels import triton_fused_quant
        values, scale = triton_fused_quant.silu_and_mul_per_token_quant(x, FP8_DTYPE, MIN_SCALE)
        return QuantizedActivation(values, scale, x.dtype)   # triton_ops.silu_and_mul writes x's dtype
    y = fused_ops.silu_and_mul(x)                              # [num_tokens, d]
    return QuantizedActivation(*quantize_rows(y), y.dtype)


def _fused_norm_takes(hidden: int) -> bool:
    """Whether the fused RMSNorm kernel takes rows of `hidden` elements: at least one of its fp8
    store chunks."""
    from nanovllm.kernels import triton_fused_quant
    return hidden >= triton_fused_quant.STORE_CHUNK.value
