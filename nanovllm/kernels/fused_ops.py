"""Small fused ops the layers call: RMSNorm (+ residual), q/k norm + RoPE (+ storing K/V),
SiLU-and-mul.

On CUDA tensors they run the Triton kernels of `triton_ops.py`; on the CPU, outside
torch.compile, the C++ of `cpu_small_ops.py` where it is built (the same arithmetic; the
RMSNorm there for 16-bit dtypes only: fp32 keeps torch's fused `F.rms_norm`, whose
values the reference tests hold exactly); elsewhere the plain torch versions below, which
follow HF transformers' arithmetic (float32 inside, rounded back to the input dtype).
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanovllm.kernels import cpu_small_ops, get_attention_backend
from nanovllm.kernels.step_memo import once_per_step


class KVStore(NamedTuple):
    """Where RoPE writes this step's keys (rotated) and values: one layer's paged cache."""
    value: torch.Tensor         # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor       # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor       # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens]; slot -1 writes nothing
    k_scale: torch.Tensor | None = None  # [num_kv_heads] float32: an fp8 cache's scales
    v_scale: torch.Tensor | None = None


class DecodeRope(NamedTuple):
    """A decode step's q/k norm + RoPE and K/V store, handed to an attention backend that does them
    inside its decode kernel (triton_attn.fuses_decode_rope) instead of `norm_rope`."""
    k: torch.Tensor                  # [num_tokens, num_kv_heads, head_dim], before norm and RoPE
    positions: torch.Tensor          # [num_tokens]
    cos_sin_cache: torch.Tensor      # [max_position, head_dim] float32 (cos | sin halves)
    q_weight: torch.Tensor | None    # [head_dim]: the per-head q/k RMSNorm's weights (Qwen3), or None
    k_weight: torch.Tensor | None
    eps: float
    kv_store: KVStore                # where the rotated keys and the values go


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Returns norm(x), or (norm(x + residual), x + residual) when a residual is given."""
    if x.is_cuda and x.dim() == 2:
        from nanovllm.kernels import triton_ops
        return triton_ops.rms_norm(x, weight, eps, residual)
    if x.dtype != torch.float32:
        out = cpu_small_ops.rms_norm(x, weight, eps, residual)  # None: not on the CPU, or not built
        if out is not None:
            return out
    if residual is not None:
        x = x + residual
        return _rms_norm_torch(x, weight, eps), x
    return _rms_norm_torch(x, weight, eps)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # torch's fused kernel: the same values
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
              q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
              eps: float = 1e-6, kv_store: KVStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm of q and k (Qwen3), then RoPE; with `kv_store`, the
    rotated keys and the values are also written into the cache.

    q: [num_tokens, heads, d]; k: [num_tokens, kv_heads, d]; positions: [num_tokens];
    cos_sin_cache: [max_position, d] float32 (cos | sin halves).
    """
    head_dim = q.shape[-1]
    if q.is_cuda and head_dim & (head_dim - 1) == 0:
        from nanovllm.kernels import triton_ops
        triton_ops.qk_norm_rope_(q, k, positions, cos_sin_cache, q_weight, k_weight, eps, kv_store)
        return q, k
    if (kv_store is not None and q_weight is None
            and cpu_small_ops.rope_store_applies(q, k, kv_store.value, kv_store.k_cache)):
        cpu_small_ops.rope_store(q, k, kv_store.value, positions, cos_sin_cache, kv_store.k_cache,
                                 kv_store.v_cache, kv_store.slot_mapping)  # in place, then stored
        return q, k
    if q_weight is not None:
        q, k = _rms_norm_torch(q, q_weight, eps), _rms_norm_torch(k, k_weight, eps)
    cos, sin = _cos_sin(positions, cos_sin_cache)  # [num_tokens, 1, d/2] each
    if q.dtype == k.dtype:  # q and k rotated together: half the small ops
        q, k = _rotate(torch.cat([q, k], 1), cos, sin).split([q.shape[1], k.shape[1]], 1)
    else:
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    if kv_store is not None:  # the attention backend's store: on CUDA Triton's, which graphs can capture
        get_attention_backend(k.device.type).store_kvcache(k, *kv_store)
    return q, k


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of `positions` [num_tokens]: each [num_tokens, 1, d/2]. Every layer of a step
    passes the same two tensors, so the lookup is done once per step (eagerly; a compiled forward
    fuses it into each rotation instead)."""
    if torch.compiler.is_compiling():
        return cos_sin_cache[positions].unsqueeze(1).chunk(2, -1)
    return once_per_step("cos_sin", (positions, cos_sin_cache),
                         lambda: cos_sin_cache[positions].unsqueeze(1).chunk(2, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d]"""
    if x.is_cuda:
        from nanovllm.kernels import triton_ops
        return triton_ops.silu_and_mul(x)
    out = cpu_small_ops.silu_and_mul(x)
    if out is not None:
        return out
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up
