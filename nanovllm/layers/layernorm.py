"""RMSNorm, optionally fused with the residual add that precedes it."""
import torch
from torch import nn

from nanovllm.kernels.fused_ops import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        return rms_norm(x, self.weight, self.eps, residual)
