"""SiLU-and-mul: the gated activation of the MLP, on gate and up packed in one tensor."""
import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d]"""
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
