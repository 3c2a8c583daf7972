"""Rotary position embedding (RoPE), with the scaling types of Llama 3.x and Qwen2.5.

`inv_freq` is computed once per model from `rope_theta` and `rope_scaling`
(default, linear, llama3, yarn; formulas as in HF transformers'
`modeling_rope_utils`), then a cos/sin table over all positions is cached.
Rotation uses the "rotate half" layout of HF checkpoints.
"""
import math

import torch
from torch import nn

from nanovllm.kernels.fused_ops import DecodeRope, KVStore, norm_rope


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def linear_inv_freq(head_dim: int, theta: float, scaling: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    return default_inv_freq(head_dim, theta) / scaling["factor"], 1.0


def llama3_inv_freq(head_dim: int, theta: float, scaling: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    inv_freq = default_inv_freq(head_dim, theta)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    old_len = scaling.get("original_max_position_embeddings") or max_pos
    factor = scaling.get("factor") or max_pos / old_len
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    extrapolation = default_inv_freq(head_dim, theta)
    interpolation = extrapolation / factor
    keep = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


ROPE_SCALINGS = {"linear": linear_inv_freq, "llama3": llama3_inv_freq, "yarn": yarn_inv_freq}


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None, max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the factor applied to cos and sin."""
    if scaling is None:
        return default_inv_freq(head_dim, theta), 1.0
    return ROPE_SCALINGS[scaling["rope_type"]](head_dim, theta, scaling, max_pos)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq, attention_factor = compute_inv_freq(head_dim, theta, scaling, max_position)
        t = torch.arange(max_position, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1) * attention_factor
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)  # [max_position, head_dim]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                kv_store: KVStore | None = None):
        """Optional per-head q/k RMSNorm, then rotation; with `kv_store` (Attention.kv_store),
        the rotated keys and the values also go into the KV cache.

        positions: [num_tokens]; q: [num_tokens, heads, d]; k: [num_tokens, kv_heads, d].
        """
        if q_norm is None:
            return norm_rope(q, k, positions, self.cos_sin_cache, kv_store=kv_store)
        return norm_rope(q, k, positions, self.cos_sin_cache, q_norm.weight, k_norm.weight, q_norm.eps,
                         kv_store=kv_store)

    def for_attention(self, positions: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None,
                      k_norm: nn.Module | None, kv_store: KVStore) -> DecodeRope:
        """What `forward` would do, handed to an attention backend that does it inside its decode
        kernel (Attention.fuses_rope): k [num_tokens, kv_heads, d] before norm and RoPE."""
        if q_norm is None:
            return DecodeRope(k, positions, self.cos_sin_cache, None, None, 0.0, kv_store)
        return DecodeRope(k, positions, self.cos_sin_cache, q_norm.weight, k_norm.weight, q_norm.eps, kv_store)
