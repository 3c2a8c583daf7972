"""Attention layer: stores this step's K/V in the paged cache, then attends.

The KV cache tensors are attached by `ModelRunner` after it sizes the cache; the
per-step metadata comes from `utils/context.py`. On the GPU the store is left to the
RoPE kernel, which has the rotated keys at hand (`kv_store`): one launch fewer a layer. With
`triton_attn.DECODE_FUSED_ROPE` a decode step hands the norm, RoPE and store to the attention
kernel itself (`fuses_rope`, `forward`'s `rope`): one launch fewer again.
An fp8 cache also gets its fixed scales `k_scale` / `v_scale` (`engine/kv_scales.py`).
"""
import torch
from torch import nn

from nanovllm.kernels import cpu_small_ops
from nanovllm.kernels.fused_ops import DecodeRope, KVStore
from nanovllm.layers import opaque_ops
from nanovllm.utils.context import get_context


class Attention(nn.Module):
    backend = None  # set by ModelRunner: a module from nanovllm.kernels

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])  # [num_blocks, block_size, kv_heads, d]
        self.k_scale = self.v_scale = None  # [kv_heads] float32, for an fp8 cache only
        self.checkpoint_kv_scales = None  # (k, v) floats from the checkpoint, if it has them
        self.kv_amax = None  # [2, kv_heads] float32 while scales are calibrated: max |k|, |v| seen

    def kv_store(self, v: torch.Tensor) -> KVStore | None:
        """Where RoPE should write this step's K/V (`v`: [num_tokens, kv_heads, d]): on the GPU,
        this layer's cache; on the CPU too, outside torch.compile, where the cache has v's dtype
        (not fp8) and the C++ RoPE + store is built (kernels/cpu_small_ops.py); None elsewhere
        (`forward` stores them)."""
        if self.kv_amax is not None:  # calibrating: forward sees k and v before they are stored
            return None
        if not v.is_cuda and not (v.device.type == "cpu" and self.k_cache.dtype == v.dtype
                                  and self.k_cache.dim() == 4 and not torch.compiler.is_compiling()
                                  and cpu_small_ops.rope_store_built(v.dtype, self.head_dim)):
            return None
        return KVStore(v, self.k_cache, self.v_cache, get_context().slot_mapping, self.k_scale, self.v_scale)

    def fuses_rope(self, q: torch.Tensor) -> bool:
        """Whether this step's attention can take its q/k norm + RoPE and K/V store (`forward`'s
        `rope`): a GPU decode step whose kernel does them (triton_attn.fuses_decode_rope)."""
        return q.is_cuda and self.backend.fuses_decode_rope(q, self.k_cache, get_context().max_seqlen_q)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_stored: bool = False,
                rope: DecodeRope | None = None) -> torch.Tensor:
        """q: [num_tokens, heads, d]; k, v: [num_tokens, kv_heads, d] -> [num_tokens, heads * d]
        `kv_stored`: k and v are already in the cache (written through `kv_store`). `rope` (where
        `fuses_rope`): q and k are before q/k norm and RoPE, and the attention kernel does them and
        the store."""
        if torch.compiler.is_compiling():  # a compiled CPU forward keeps it opaque (layers/opaque_ops.py)
            return opaque_ops.attention(q, k, v, self.opaque_key)
        return self.forward_eager(q, k, v, kv_stored, rope)

    def forward_eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_stored: bool = False,
                      rope: DecodeRope | None = None) -> torch.Tensor:
        ctx = get_context()
        if self.kv_amax is not None:
            torch.maximum(self.kv_amax, torch.stack([k.abs().amax((0, 2)), v.abs().amax((0, 2))]).float(),
                          out=self.kv_amax)
        if not kv_stored and rope is None:
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping,
                                       self.k_scale, self.v_scale)
        o = self.backend.paged_attention(q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.seq_lens_k,
                                         ctx.block_tables, self.scale, max_seqlen_q=ctx.max_seqlen_q,
                                         max_seqlen_k=ctx.max_seqlen_k, k_scale=self.k_scale,
                                         v_scale=self.v_scale,
                                         **({} if rope is None else {"rope": rope}))  # the GPU backend's option
        return o.flatten(1)
