"""kernels/cpu_prefill_attn.py (CPU prefill chunks by bf16 products) against kernels/torch_ref.py."""
import pytest
import torch

from nanovllm.kernels import cpu_attn, cpu_prefill_attn, torch_ref
from nanovllm.utils.device import cpu_has_fast_bf16

needs_fast_bf16 = pytest.mark.skipif(not cpu_has_fast_bf16(),
                                     reason="the products path runs only where the CPU multiplies bf16 fast")


def _prefill_case(seq_lens, q_lens, num_heads, num_kv_heads, dtype, head_dim=16, block_size=16, seed=0):
    """Chunks of q_lens queries, each the last of its sequence's seq_lens positions, over a
    shuffled paged cache in the engine's layout (cpu_attn.new_kv_cache)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    caches = cpu_attn.new_kv_cache((num_blocks, block_size, num_kv_heads, head_dim), dtype, torch.device("cpu"))
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max(blocks)), -1, dtype=torch.int32)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return q, *caches, cu, torch.tensor(seq_lens, dtype=torch.int32), tables


@needs_fast_bf16
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 4), (4, 1)])
@pytest.mark.parametrize("max_scores", [1 << 22, 300])  # one slice of query rows / many
def test_bf16_prefill_matches_the_fp32_reference(num_heads, num_kv_heads, max_scores, monkeypatch):
    """Whole prompts and chunks after a cached prefix (queries the last of their keys): equal to
    the fp32 reference on the same bf16 values to bf16 rounding; a wrong mask or head mapping is
    off by ~0.1-1."""
    monkeypatch.setattr(cpu_prefill_attn, "MAX_SCORES", max_scores)
    q, k_cache, v_cache, cu, lens, tables = _prefill_case([7, 40, 33, 1], [7, 40, 9, 1], num_heads, num_kv_heads,
                                                          torch.bfloat16)
    ours = cpu_prefill_attn.prefill_attention(q, k_cache, v_cache, cu, lens, tables, 0.25)
    expected = torch_ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, lens, tables, 0.25)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), expected, rtol=2e-2, atol=2e-2)


def test_fp32_prefill_is_the_reference():
    q, k_cache, v_cache, cu, lens, tables = _prefill_case([7, 40], [7, 12], 6, 2, torch.float32)
    assert torch.equal(cpu_prefill_attn.prefill_attention(q, k_cache, v_cache, cu, lens, tables, 0.25),
                       torch_ref.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.25))


def test_causal_mask_hides_each_querys_later_keys():
    """Rows 1-2 of a 3-query chunk over 5 keys (positions 3, 4): key j is seen iff j <= position."""
    mask = cpu_prefill_attn._causal_mask(1, 3, q_len=3, k_len=5)
    assert mask.isinf().tolist() == [[False, False, False, False, True], [False] * 5]


@needs_fast_bf16
@pytest.mark.parametrize("max_scores", [1 << 22, 300])
def test_chunks_of_one_shape_attend_together_as_each_alone(max_scores, monkeypatch):
    """Sequences with the same query and key lengths run as one batch: each gets the values it gets
    alone (the same products per batch entry), close to the fp32 reference."""
    monkeypatch.setattr(cpu_prefill_attn, "MAX_SCORES", max_scores)
    seq_lens, q_lens = [40, 33, 40, 40, 33, 5], [40, 9, 40, 40, 9, 5]
    q, k_cache, v_cache, cu, lens, tables = _prefill_case(seq_lens, q_lens, 9, 3, torch.bfloat16, seed=1)
    ours = cpu_prefill_attn.prefill_attention(q, k_cache, v_cache, cu, lens, tables, 0.25)
    for b in range(len(seq_lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        alone = cpu_prefill_attn.prefill_attention(q[rows], k_cache, v_cache, torch.tensor([0, q_lens[b]]),
                                                   lens[b:b + 1], tables[b:b + 1], 0.25)
        assert torch.equal(ours[rows], alone), b
    expected = torch_ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, lens, tables, 0.25)
    torch.testing.assert_close(ours.float(), expected, rtol=2e-2, atol=2e-2)
