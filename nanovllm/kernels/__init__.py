"""Attention backends: the one place where CPU and GPU attention differ.

A backend is a module with `store_kvcache(...)` and `paged_attention(...)` of the
signatures in `torch_ref.py`. `get_attention_backend(device_type)` picks it. The GPU's
(`triton_attn`) also has `fuses_decode_rope(...)`: where it holds, `paged_attention(...,
rope=...)` does a decode step's q/k norm + RoPE and K/V store itself (layers/attention.py).
"""
from types import ModuleType


def get_attention_backend(device_type: str) -> ModuleType:
    if device_type == "cuda":
        from nanovllm.kernels import triton_attn
        return triton_attn
    if device_type == "cpu":  # decode steps batched; prefill by torch_ref, the plain reference
        from nanovllm.kernels import cpu_attn
        return cpu_attn
    raise ValueError(f"no attention backend for device type {device_type!r} (supported: cpu, cuda)")
