"""Sampler: turns the logits of a batch into next tokens, as batched tensor ops."""
import torch
from torch import nn


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """logits: [num_seqs, vocab]; temperatures: [num_seqs] (0 = greedy) -> token ids [num_seqs]"""
        logits = logits.float()
        greedy = logits.argmax(-1)
        if bool((temperatures == 0).all()):
            return greedy
        probs = torch.softmax(logits / temperatures.clamp_min(1e-5).unsqueeze(1), -1)
        # Gumbel-max in its exponential form: argmax p / E with E ~ Exp(1) samples from p.
        sampled = probs.div_(torch.empty_like(probs).exponential_(1)).argmax(-1)
        return torch.where(temperatures == 0, greedy, sampled)
