"""kernels/cpu_attn.py (batched CPU decode attention) against kernels/torch_ref.py."""
import pytest
import torch

from nanovllm.kernels import cpu_attn, step_memo, torch_ref


def _paged_case(seq_lens, q_lens, num_heads, num_kv_heads, head_dim=16, block_size=16, seed=0):
    """A shuffled paged cache holding `seq_lens` contexts, with -1-padded block tables."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks that no table points at
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + 1  # one more column than any sequence needs: padding must be ignored
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), tables


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3), (8, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_matches_reference(num_heads, num_kv_heads, block_size):
    seq_lens = [1, 16, 17, 40, 5, 33]
    case = _paged_case(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, block_size=block_size)
    expected = torch_ref.paged_attention(*case, scale=0.25)
    torch.testing.assert_close(cpu_attn.paged_attention(*case, scale=0.25), expected, rtol=1e-5, atol=1e-5)
    trimmed = cpu_attn.paged_attention(*case, scale=0.25, max_seqlen_q=1, max_seqlen_k=max(seq_lens))
    torch.testing.assert_close(trimmed, expected, rtol=1e-5, atol=1e-5)


def test_prefill_and_mixed_steps_match_reference():
    case = _paged_case([7, 30, 1, 18], [7, 12, 1, 1], num_heads=6, num_kv_heads=2)
    torch.testing.assert_close(cpu_attn.paged_attention(*case, scale=0.3), torch_ref.paged_attention(*case, scale=0.3),
                               rtol=1e-5, atol=1e-5)


def test_cpu_backend_is_registered():
    from nanovllm.kernels import get_attention_backend
    assert get_attention_backend("cpu") is cpu_attn


@pytest.mark.parametrize("slots", [[5, 0, 17, 3], [5, -1, 17, -1], []])
def test_store_kvcache_matches_reference(slots):
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(len(slots), 2, 8, generator=gen), torch.randn(len(slots), 2, 8, generator=gen)
    caches = [torch.zeros(3, 8, 2, 8) for _ in range(4)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    cpu_attn.store_kvcache(k, v, caches[0], caches[1], slot_mapping)
    torch_ref.store_kvcache(k, v, caches[2], caches[3], slot_mapping)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert bool(caches[0].any()) == any(s >= 0 for s in slots)


def test_nan_in_slots_no_sequence_owns_does_not_leak():
    """An uninitialised cache can hold NaN bit patterns past a sequence's end and in padding
    blocks: weight 0 times NaN must not reach the output."""
    seq_lens = [3, 20, 16, 9]
    q, k_cache, v_cache, cu, lens, tables = _paged_case(seq_lens, [1] * 4, num_heads=6, num_kv_heads=2)
    owned = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for table, n in zip(tables.tolist(), seq_lens):
        for p in range(n):
            owned[table[p // k_cache.shape[1]], p % k_cache.shape[1]] = True
    k_cache[~owned], v_cache[~owned] = float("nan"), float("nan")
    for _ in range(2):  # the second call reuses the gather buffers and the step's plan
        out = cpu_attn.paged_attention(q, k_cache, v_cache, cu, lens, tables, scale=0.25)
        assert not out.isnan().any()
        torch.testing.assert_close(out, torch_ref.paged_attention(q, k_cache, v_cache, cu, lens, tables, scale=0.25),
                                   rtol=1e-5, atol=1e-5)


def test_buffers_made_in_inference_mode_serve_calls_outside_it():
    case = _paged_case([9, 30], [1, 1], num_heads=4, num_kv_heads=2)
    with torch.inference_mode():
        inside = cpu_attn.paged_attention(*case, scale=0.25)
    torch.testing.assert_close(cpu_attn.paged_attention(*case, scale=0.25), inside)


@pytest.mark.parametrize("q_lens", [[7, 1, 12, 1, 1], [1, 1, 5], [3, 1, 1, 4, 1, 2], [1, 6]])
def test_mixed_steps_split_decodes_from_prefills(q_lens):
    """Decodes of a mixed step take the batched path, its prefill chunks the reference; together
    they equal the reference's whole step (prefills first, last, between, alone)."""
    seq_lens = [n + 11 * i for i, n in enumerate(q_lens)]
    case = _paged_case(seq_lens, q_lens, num_heads=6, num_kv_heads=2, block_size=5)
    expected = torch_ref.paged_attention(*case, scale=0.3)
    for _ in range(2):  # the second call reuses the step's split and plan
        torch.testing.assert_close(cpu_attn.paged_attention(*case, scale=0.3, max_seqlen_k=max(seq_lens)),
                                   expected, rtol=1e-5, atol=1e-5)
    if sum(n == 1 for n in q_lens) >= 2:
        assert step_memo._local.mixed_split[1] is not None
