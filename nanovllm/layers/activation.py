"""SiLU-and-mul: the gated activation of the MLP, on gate and up packed in one tensor. When the
only reader of its output is an fp8 linear layer that takes its input quantized (down), it
writes that input as per-token fp8 (`quantized_output`, set after loading:
layers/quantization/__init__.py)."""
import torch
from torch import nn

from nanovllm.kernels.fused_ops import silu_and_mul
from nanovllm.layers.quantization import fp8_activation
from nanovllm.layers.quantization.fp8 import QuantizedActivation


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.quantized_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedActivation:
        """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d]"""
        if self.quantized_output:
            return fp8_activation.silu_and_mul_quant(x)
        return silu_and_mul(x)
