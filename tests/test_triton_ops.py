"""Fused Triton ops (`kernels/triton_ops.py`) against their torch versions.

Runs natively on a GPU (bf16 included). Without one, the file re-runs itself in a
child process with `TRITON_INTERPRET=1` set from the start (tests/triton_interpreter.py:
the interpreter must be on before triton is first imported).
"""
import pytest
import torch

from nanovllm.kernels import fused_ops
from triton_interpreter import HAS_TRITON, RUN_HERE, needs_kernels, rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
CHILD_TIMEOUT_S = 300
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON, reason="ops run in this process")
def test_ops_under_triton_interpreter():
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)




def _close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm(dtype, hidden):
    from nanovllm.kernels import triton_ops
    x = torch.randn(7, hidden, dtype=dtype, device=DEVICE)
    res = torch.randn(7, hidden, dtype=dtype, device=DEVICE)
    w = torch.randn(hidden, dtype=dtype, device=DEVICE)
    _close(triton_ops.rms_norm(x, w, 1e-6), fused_ops._rms_norm_torch(x, w, 1e-6), dtype)
    out, new_res = triton_ops.rms_norm(x, w, 1e-6, res)
    _close(new_res, x + res, dtype)
    _close(out, fused_ops._rms_norm_torch(x + res, w, 1e-6), dtype)


def _qkv_views(tokens, heads, kv_heads, d, dtype, device):
    """q, k, v as strided views of one packed qkv projection, as the decoder makes them."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, dtype=dtype, device=device)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    return q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
def test_norm_rope_on_strided_views(dtype, with_norm):
    from nanovllm.kernels import triton_ops
    tokens, heads, kv_heads, d, max_pos = 5, 6, 2, 32, 64  # 6 heads: padded to 8 and masked
    q, k, v = _qkv_views(tokens, heads, kv_heads, d, dtype, DEVICE)
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    cos_sin = torch.randn(max_pos, d, device=DEVICE)
    qw = torch.randn(d, dtype=dtype, device=DEVICE) if with_norm else None
    kw = torch.randn(d, dtype=dtype, device=DEVICE) if with_norm else None
    ref_q, ref_k = fused_ops.norm_rope(q.cpu().clone(), k.cpu().clone(), positions.cpu(), cos_sin.cpu(),
                                       qw.cpu() if with_norm else None, kw.cpu() if with_norm else None)
    v_before = v.clone()
    triton_ops.qk_norm_rope_(q, k, positions, cos_sin, qw, kw, 1e-6)
    _close(q.cpu(), ref_q, dtype)
    _close(k.cpu(), ref_k, dtype)
    assert torch.equal(v, v_before)  # v untouched


def _poisoned_cache(num_blocks, block_size, kv_heads, d, dtype, device):
    return torch.full((num_blocks, block_size, kv_heads, d), float("nan"), dtype=dtype, device=device)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
def test_norm_rope_stores_kv(dtype, with_norm):
    """With a KVStore the kernel writes the rotated keys and the values into their slots
    (slot -1: nothing), as rope followed by the reference store_kvcache does."""
    from nanovllm.kernels import torch_ref, triton_ops
    tokens, heads, kv_heads, d, max_pos, blocks, block_size = 6, 4, 2, 32, 64, 5, 4
    q, k, v = _qkv_views(tokens, heads, kv_heads, d, dtype, DEVICE)
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    cos_sin = torch.randn(max_pos, d, device=DEVICE)
    qw = torch.randn(d, dtype=dtype, device=DEVICE) if with_norm else None
    kw = torch.randn(d, dtype=dtype, device=DEVICE) if with_norm else None
    slots = torch.tensor([3, 17, -1, 0, 19, 8], device=DEVICE)  # across blocks; one token writes nothing
    ref_q, ref_k = fused_ops.norm_rope(q.clone(), k.clone(), positions, cos_sin, qw, kw)
    ref_caches = [_poisoned_cache(blocks, block_size, kv_heads, d, dtype, DEVICE) for _ in range(2)]
    torch_ref.store_kvcache(ref_k, v, *ref_caches, slots)
    caches = [_poisoned_cache(blocks, block_size, kv_heads, d, dtype, DEVICE) for _ in range(2)]
    triton_ops.qk_norm_rope_(q, k, positions, cos_sin, qw, kw, 1e-6, fused_ops.KVStore(v, *caches, slots))
    _close(q, ref_q, dtype)
    _close(k, ref_k, dtype)
    for cache, ref in zip(caches, ref_caches):
        assert torch.equal(cache.isnan(), ref.isnan())  # the same slots written, the rest untouched
        _close(cache.nan_to_num(), ref.nan_to_num(), dtype)


def test_norm_rope_torch_path_stores_kv():
    """The torch path (CPU, or head sizes the kernel does not take) honours a KVStore too;
    on a GPU it stores with the Triton store kernel (graph-safe), elsewhere the reference."""
    from nanovllm.kernels import torch_ref
    tokens, heads, kv_heads, d, max_pos = 3, 4, 2, 24, 16  # head size 24: not a power of two
    q, k, v = _qkv_views(tokens, heads, kv_heads, d, torch.float32, DEVICE)
    positions, cos_sin = torch.tensor([0, 5, 9], device=DEVICE), torch.randn(max_pos, d, device=DEVICE)
    slots = torch.tensor([2, -1, 6], device=DEVICE)
    ref_q, ref_k = fused_ops.norm_rope(q.clone(), k.clone(), positions, cos_sin)
    ref_caches = [_poisoned_cache(2, 4, kv_heads, d, torch.float32, DEVICE) for _ in range(2)]
    torch_ref.store_kvcache(ref_k, v, *ref_caches, slots)
    caches = [_poisoned_cache(2, 4, kv_heads, d, torch.float32, DEVICE) for _ in range(2)]
    out_q, out_k = fused_ops.norm_rope(q, k, positions, cos_sin, kv_store=fused_ops.KVStore(v, *caches, slots))
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    for cache, ref in zip(caches, ref_caches):
        assert torch.equal(cache.nan_to_num(), ref.nan_to_num()) and torch.equal(cache.isnan(), ref.isnan())


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    from nanovllm.kernels import triton_ops
    x = torch.randn(3, 2 * 1500, dtype=dtype, device=DEVICE)  # spans two column blocks
    gate, up = x.chunk(2, -1)
    _close(triton_ops.silu_and_mul(x), torch.nn.functional.silu(gate) * up, dtype)


@needs_kernels
def test_advance_decode_matches_the_torch_advance():
    """One kernel advances a decode round's inputs in place exactly as ModelRunner._advance_decode
    does out of place; rows past num_seqs (a graph's padding) are left alone."""
    from types import SimpleNamespace
    from nanovllm.engine.model_runner import ModelRunner
    from nanovllm.kernels import triton_ops
    from nanovllm.utils.context import Context
    block_size, num_seqs, padded = 4, 5, 8
    block_tables = torch.randint(0, 50, (padded, 6), dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([0, 3, 7, 11, 18, 2, 2, 2], device=DEVICE)       # crossing block edges
    seq_lens = (positions + 1).to(torch.int32)
    slots = torch.full((padded,), -1, dtype=torch.int64, device=DEVICE)
    input_ids = torch.zeros(padded, dtype=torch.int64, device=DEVICE)
    tokens = torch.randint(0, 1000, (num_seqs,), device=DEVICE)
    context = Context(slot_mapping=slots[:num_seqs], cu_seqlens_q=None, seq_lens_k=seq_lens[:num_seqs],
                      block_tables=block_tables[:num_seqs], max_seqlen_q=1, max_seqlen_k=20)
    ref_ids, ref_pos, ref_ctx = ModelRunner._advance_decode(SimpleNamespace(block_size=block_size), tokens,
                                                            positions[:num_seqs], context)
    pad_before = [t[num_seqs:].clone() for t in (input_ids, positions, slots, seq_lens)]
    triton_ops.advance_decode_(tokens, input_ids, positions, slots, seq_lens, block_tables, block_size)
    assert torch.equal(input_ids[:num_seqs], ref_ids) and torch.equal(positions[:num_seqs], ref_pos)
    assert torch.equal(slots[:num_seqs], ref_ctx.slot_mapping)
    assert torch.equal(seq_lens[:num_seqs], ref_ctx.seq_lens_k)
    for t, before in zip((input_ids, positions, slots, seq_lens), pad_before):
        assert torch.equal(t[num_seqs:], before)
