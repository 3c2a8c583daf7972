"""kernels/fused_ops.py's torch path (what the CPU runs) against the formulas it follows,
written out op by op as HF transformers computes them: the values must be the same bits."""
import pytest
import torch

from nanovllm.kernels import fused_ops


def _rope_written_out(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32, rounded back: (x1 cos - x2 sin, x2 cos + x1 sin)."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, -1)  # [tokens, 1, d/2]
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7])
def test_rope_equals_the_rotate_half_formula(dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads, d, max_pos = 9, 3, 64, 300
    q = torch.randn(tokens, heads, d, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, d, generator=gen).to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    cos_sin = torch.randn(max_pos, d, generator=gen)
    out_q, out_k = fused_ops.norm_rope(q, k, positions, cos_sin)
    assert torch.equal(out_q, _rope_written_out(q, positions, cos_sin))
    assert torch.equal(out_k, _rope_written_out(k, positions, cos_sin))
