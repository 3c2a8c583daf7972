"""Attention layer: stores this step's K/V in the paged cache, then attends.

The KV cache tensors are attached by `ModelRunner` after it sizes the cache; the
per-step metadata comes from `utils/context.py`.
"""
import torch
from torch import nn

from nanovllm.utils.context import get_context


class Attention(nn.Module):
    backend = None  # set by ModelRunner: a module from nanovllm.kernels

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])  # [num_blocks, block_size, kv_heads, d]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [num_tokens, heads, d]; k, v: [num_tokens, kv_heads, d] -> [num_tokens, heads * d]"""
        ctx = get_context()
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        o = self.backend.paged_attention(q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.seq_lens_k,
                                         ctx.block_tables, self.scale, max_seqlen_q=ctx.max_seqlen_q,
                                         max_seqlen_k=ctx.max_seqlen_k)
        return o.flatten(1)
