"""SiLU-and-mul: the gated activation of the MLP, on gate and up packed in one tensor."""
import torch
from torch import nn

from nanovllm.kernels.fused_ops import silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d]"""
        return silu_and_mul(x)
