"""RMSNorm, optionally fused with the residual add that precedes it; when the only reader of
its output is an fp8 linear layer that takes its input quantized, it writes that input as
per-token fp8 (`quantized_output`, set after loading: layers/quantization/__init__.py)."""
import torch
from torch import nn

from nanovllm.kernels.fused_ops import rms_norm
from nanovllm.layers.quantization import fp8_activation


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.quantized_output = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns norm(x), or (norm(x + residual), x + residual) when a residual is given; with
        `quantized_output`, norm(...) as an fp8 QuantizedActivation."""
        if self.quantized_output:
            return fp8_activation.rms_norm_quant(x, self.weight, self.eps, residual)
        return rms_norm(x, self.weight, self.eps, residual)
