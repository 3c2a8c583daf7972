"""`gluon_decode_mma`, decode attention with K and V loaded straight into the tensor cores' register
fragments, against the torch reference (which dequantizes an fp8 cache before SDPA).

Groups of 1 to 8 query heads, head sizes 64 to 256, one split and several (the combine kernel
merging them), contexts ending anywhere in a tile (the masked last tile) and a split past the end
of a short context, e4m3 and e5m2 caches with fp16 and bf16 queries, bf16 and fp16 caches, and a
cache whose blocks hold two tiles.
The kernel is Gluon, which Triton's interpreter does not run: these tests need an NVIDIA GPU with
fp8 conversions (Ada or Hopper) and skip elsewhere. On any machine: where the kernel applies, and
that it compiles for Hopper (Triton's bundled ptxas, no GPU), the fused RoPE too, with each layout
conversion a no-op (asserted while it builds), no spills, and nothing in its loops through shared memory.
(The fused RoPE against the separate RoPE kernel: tests/test_triton_attn.py, on a GPU.)
"""
import os
import sys

import pytest
import torch

from nanovllm.kernels import triton_attn
from paged_batches import assert_attention_close, random_paged_batch, reference_attention
from triton_interpreter import HAS_TRITON

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import attn_sass  # noqa: E402

HAS_FP8_GPU = (torch.cuda.is_available() and torch.version.hip is None
               and torch.cuda.get_device_capability() >= triton_attn.DECODE_MMA_MIN_CAPABILITY)
needs_fp8_gpu = pytest.mark.skipif(not HAS_FP8_GPU, reason="Gluon kernel: an NVIDIA GPU of sm_89 or later")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# context lengths (one query each), heads, kv heads, head_dim, block_size, num_splits
CASES = {
    "gqa4_tails": ([1, 15, 16, 17, 40, 129, 300], 32, 8, 128, 16, None),
    "gqa2_split5": ([3, 77, 1000, 2049], 16, 8, 128, 16, 5),
    "gqa8_d64": ([31, 64, 200], 16, 2, 64, 16, 3),
    "mha_d256": ([16, 100], 4, 4, 256, 16, None),
    "gqa4_block32": ([20, 47, 95], 8, 2, 128, 32, 2),
    "gqa3_short_split": ([5, 18], 6, 2, 128, 16, 8),  # splits past the end of the context write nothing
}


@pytest.fixture
def decode_mma(monkeypatch):
    """The Gluon kernel switched on (DECODE_MMA_FP8, DECODE_MMA_16BIT) for the test."""
    monkeypatch.setattr(triton_attn, "DECODE_MMA_FP8", True)
    monkeypatch.setattr(triton_attn, "DECODE_MMA_16BIT", True)


def _decode_batch(gen, case, cache_dtype):
    ctx_lens, heads, kv_heads, d, block_size, num_splits = CASES[case]
    paged = random_paged_batch(gen, [(n - 1, 1) for n in ctx_lens], heads, kv_heads, d, block_size, cache_dtype)
    return paged, d, num_splits


# (query dtype, cache dtype)
DTYPES = [(torch.float16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn),
          (torch.float16, torch.float8_e5m2), (torch.bfloat16, torch.float8_e5m2),
          (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]


@needs_fp8_gpu
@pytest.mark.parametrize("dtype,cache_dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_decode_mma_matches_the_reference(gen, decode_mma, case, dtype, cache_dtype):
    paged, d, num_splits = _decode_batch(gen, case, cache_dtype)
    fp8 = paged["k_scale"] is not None
    q = paged["q"].to(dtype=dtype, device=DEVICE)
    k_cache, v_cache = paged["k_cache"].to(DEVICE), paged["v_cache"].to(DEVICE)
    assert triton_attn._use_decode_mma(q, k_cache, v_cache, fp8)
    on_device = {name: t.to(DEVICE) for name, t in paged["batch"].items()}
    scales = dict(k_scale=paged["k_scale"].to(DEVICE), v_scale=paged["v_scale"].to(DEVICE)) if fp8 else {}
    got = triton_attn.paged_attention(q, k_cache, v_cache, **on_device, scale=d ** -0.5, max_seqlen_q=1,
                                      num_splits=num_splits, **scales).float().cpu()
    assert_attention_close(got, reference_attention(paged), dtype, gen)


@needs_fp8_gpu
@pytest.mark.parametrize("dtype,cache_dtype", [DTYPES[0], DTYPES[4]])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_mma_loading_two_tiles_ahead(gen, decode_mma, monkeypatch, case, dtype, cache_dtype):
    """DECODE_MMA_PREFETCH = 2: the same results with two tiles' loads in flight."""
    monkeypatch.setattr(triton_attn, "DECODE_MMA_PREFETCH", 2)
    test_decode_mma_matches_the_reference(gen, decode_mma, case, dtype, cache_dtype)


@needs_fp8_gpu
def test_decode_mma_agrees_with_the_triton_kernels(gen, decode_mma, monkeypatch):
    """The same batch through the Gluon kernel and through the CUDA-core kernel it replaces: both
    round the same fp8 values, so they agree more closely than either does with the reference."""
    paged, d, _ = _decode_batch(gen, "gqa2_split5", torch.float8_e4m3fn)
    args = dict({name: t.to(DEVICE) for name, t in paged["batch"].items()}, scale=d ** -0.5, max_seqlen_q=1,
                k_scale=paged["k_scale"].to(DEVICE), v_scale=paged["v_scale"].to(DEVICE))
    q = paged["q"].to(dtype=torch.float16, device=DEVICE)
    caches = paged["k_cache"].to(DEVICE), paged["v_cache"].to(DEVICE)
    gluon_out = triton_attn.paged_attention(q, *caches, **args)
    monkeypatch.setattr(triton_attn, "DECODE_MMA_FP8", False)
    triton_out = triton_attn.paged_attention(q, *caches, **args)
    torch.testing.assert_close(gluon_out, triton_out, atol=2e-3, rtol=2e-3)


def test_decode_mma_applies_only_where_its_layouts_hold(monkeypatch):
    """The Gluon kernel takes 16-bit queries over an fp8 cache (or a 16-bit one of their dtype) with
    contiguous rows, groups of at most 8 query heads, power-of-two heads of 64 or more and blocks of
    whole tiles, on a CUDA GPU only, each cache kind under its own switch."""
    def applies(heads=16, kv_heads=8, d=128, block=16, q_dtype=torch.bfloat16, cache=torch.float8_e4m3fn,
                cuda=True, fp8_switch=True, switch_16bit=True):
        q = torch.empty(2, heads, d, dtype=q_dtype)
        k = torch.empty(4, block, kv_heads, d, dtype=cache)
        monkeypatch.setattr(triton_attn, "DECODE_MMA_FP8", fp8_switch)
        monkeypatch.setattr(triton_attn, "DECODE_MMA_16BIT", switch_16bit)
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: cuda))
        monkeypatch.setattr(triton_attn, "_capability", lambda device: (9, 0))
        try:
            return triton_attn._use_decode_mma(q, k, k, cache in (torch.float8_e4m3fn, torch.float8_e5m2))
        finally:
            monkeypatch.undo()

    assert applies()
    assert applies(heads=32) and applies(heads=64, kv_heads=8) and applies(d=64) and applies(block=32)
    assert not applies(heads=72)                      # a group of 9
    assert not applies(d=96) and not applies(d=32)   # not a power of two; too small
    assert not applies(block=8)                      # a block smaller than a tile
    assert not applies(q_dtype=torch.float32)
    assert not applies(cuda=False)
    assert not applies(fp8_switch=False) and applies(switch_16bit=False)
    assert applies(cache=torch.bfloat16) and applies(cache=torch.float16, q_dtype=torch.float16)
    assert not applies(cache=torch.bfloat16, switch_16bit=False) and applies(cache=torch.bfloat16, fp8_switch=False)
    assert not applies(cache=torch.float16)          # a 16-bit cache of another dtype than the queries'


# (kv_cache_dtype, query heads per KV head, head_dim, BLOCK_N, split, fused RoPE, tiles prefetched); a 32-key
# tile for pages of 32 or more
COMPILED = [("fp8", 2, 128, 16, False, False, 1), ("fp8_e5m2", 4, 128, 16, True, True, 1),
            ("fp8", 8, 64, 32, False, False, 1), ("fp8", 1, 256, 16, True, False, 1),
            ("auto", 4, 128, 16, True, True, 1), ("fp8", 4, 128, 16, True, False, 2)]


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton's compiler")
@pytest.mark.parametrize("kv,qpk,head_dim,block_n,split,rope,prefetch", COMPILED)
def test_decode_mma_compiles_for_hopper_with_registers_only_loops(tmp_path, kv, qpk, head_dim, block_n, split, rope,
                                                                   prefetch):
    kernel = attn_sass.compile_decode_mma(kv, 90, qpk, block_n, head_dim, split, rope, prefetch)
    sass, _ = attn_sass.sass_of(kernel, str(tmp_path), "decode_mma")
    assert "STL" not in sass.split(), "register spills"
    loops = attn_sass.loops(sass)
    assert len(loops) == 2, "the unmasked tiles' loop and the masked tail's"
    for loop in loops:
        assert sum(op.startswith("HMMA") for op in loop) == 2 * (block_n // 16) * head_dim // 16
        assert not [op for op in loop if op.startswith(attn_sass.SHARED_OPS)]


def _join(a, b):
    """Triton's `join` in torch: a new minor dimension of size 2."""
    return torch.stack([a, b], dim=-1)


def test_the_kernels_index_maps_in_torch():
    """The kernel's relabelings, written again in torch op for op (Gluon's reshape, permute and join
    have torch's semantics), compose as its docstrings say: the four values a word converts to come
    back in memory order, and the store's dimension map undoes `_value_dim_perm`. (The layouts
    themselves are checked by the compiler; these maps are what the kernel computes with.)"""
    rows, words = 4, 32
    w = torch.arange(rows * words * 4).reshape(rows, words, 4)  # value j of word c: byte 4c + j
    b0, b1, b2, b3 = w.unbind(-1)
    joined = _join(_join(b0, b2), _join(b1, b3)).reshape(rows, words * 4)  # `_words_to_values` over an fp8 cache
    assert torch.equal(joined, torch.arange(rows * words * 4).reshape(rows, words * 4))

    for head_dim in (64, 128, 256):
        rows_in_cache_order = torch.arange(head_dim)[:, None].expand(head_dim, 8)
        # `_value_dim_perm`: O^T's row m holds cache dimension permuted[m]
        permuted = rows_in_cache_order.reshape(8, head_dim // 16, 2, 8).permute(1, 2, 0, 3).reshape(head_dim, 8)
        m = torch.arange(head_dim)
        store_dims = (head_dim // 8) * (m % 8) + m // 8  # `_store`'s dims
        assert torch.equal(permuted[:, 0], store_dims)
