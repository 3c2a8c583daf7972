"""The Triton kernels with an fp8 KV cache against the torch reference.

- `store_kvcache` and the fused RoPE store (`qk_norm_rope_` with a KVStore) write the
  bytes `kv_quant.quantize` gives (slot -1: nothing).
- `paged_attention` over an fp8 cache equals the reference over the same cache (which
  dequantizes before SDPA): prefill chunks over a cached prefix, decodes, and split-KV.

Natively on a GPU (bf16 queries too); without one, in a child process under
`TRITON_INTERPRET=1` (tests/triton_interpreter.py). The interpreter (triton 3.9) casts
fp32 to fp8 wrongly where rounding carries into the exponent (e4m3: 127.6 became 64, not
128; e5m2: 7.68 became 4.0), so the *store* tests, which compare bytes, run on the GPU
only; its conversion rounds to nearest even, as torch's does. Reading fp8 is exact in the
interpreter, so the attention tests (over caches the reference wrote) run in both.
"""

import pytest
import torch

from nanovllm.kernels import fused_ops, kv_quant, torch_ref
from paged_batches import (TOLERANCE, assert_attention_close, random_kv_scales, random_paged_batch,
                           reference_attention)
from triton_interpreter import HAS_TRITON, RUN_HERE, needs_kernels, rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
CHILD_TIMEOUT_S = 300
# under the interpreter fp16 only (fp32 tiles read the same fp8 tiles; it keeps the child short)
Q_DTYPES = [torch.float16] + ([torch.float32, torch.bfloat16] if HAS_CUDA else [])
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
needs_gpu_store = pytest.mark.skipif(not HAS_CUDA, reason="the interpreter's fp32 -> fp8 cast is wrong "
                                     "where rounding carries (see the module docstring)")


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON, reason="kernels run in this process")
def test_fp8_kernels_under_triton_interpreter():
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)


def _scales(gen, heads: int) -> torch.Tensor:
    return random_kv_scales(gen, heads).to(DEVICE)


@needs_gpu_store
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", Q_DTYPES)
def test_store_kvcache_quantizes_like_the_reference(gen, dtype, cache_dtype):
    from nanovllm.kernels import triton_attn
    tokens, kv_heads, d, blocks, block_size = 9, 3, 64, 6, 4
    key = (torch.randn(tokens, kv_heads, d, generator=gen) * 3).to(dtype=dtype, device=DEVICE)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-7])  # clipped both ways, zero, subnormal
    value = torch.randn(tokens, kv_heads, d, generator=gen).to(dtype=dtype, device=DEVICE)
    slots = torch.tensor([3, 17, -1, 0, 19, 8, 23, -1, 5], device=DEVICE)
    k_scale, v_scale = _scales(gen, kv_heads), _scales(gen, kv_heads)
    caches = [torch.full((blocks, block_size, kv_heads, d), 0x7F, dtype=torch.uint8, device=DEVICE)
              .view(cache_dtype) for _ in range(4)]  # 0x7F: NaN in e4m3, a marker in e5m2
    triton_attn.store_kvcache(key, value, caches[0], caches[1], slots, k_scale, v_scale)
    ref_k, ref_v = [c.cpu() for c in caches[2:]]
    torch_ref.store_kvcache(key.cpu(), value.cpu(), ref_k, ref_v, slots.cpu(), k_scale.cpu(), v_scale.cpu())
    seed = f"seed {gen.initial_seed()}"
    assert torch.equal(caches[0].cpu().view(torch.uint8), ref_k.view(torch.uint8)), seed
    assert torch.equal(caches[1].cpu().view(torch.uint8), ref_v.view(torch.uint8)), seed


@needs_gpu_store
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("with_norm", [False, True])
def test_norm_rope_stores_fp8_kv_like_the_reference(gen, cache_dtype, with_norm):
    from nanovllm.kernels import triton_ops
    dtype = torch.float32 if not HAS_CUDA else torch.bfloat16
    tokens, heads, kv_heads, d, max_pos, blocks, block_size = 6, 4, 2, 32, 64, 5, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype=dtype, device=DEVICE)
    q, k, v = [t.view(tokens, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)]
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(DEVICE)
    cos_sin = torch.randn(max_pos, d, generator=gen).to(DEVICE)
    qw = torch.randn(d, generator=gen).to(dtype=dtype, device=DEVICE) if with_norm else None
    kw = torch.randn(d, generator=gen).to(dtype=dtype, device=DEVICE) if with_norm else None
    slots = torch.tensor([3, 17, -1, 0, 19, 8], device=DEVICE)
    k_scale, v_scale = _scales(gen, kv_heads), _scales(gen, kv_heads)
    shape = (blocks, block_size, kv_heads, d)
    caches = [torch.zeros(shape, dtype=torch.uint8, device=DEVICE).view(cache_dtype) for _ in range(4)]
    ref_q, ref_k = fused_ops.norm_rope(q.clone().cpu(), k.clone().cpu(), positions.cpu(), cos_sin.cpu(),
                                       qw if qw is None else qw.cpu(), kw if kw is None else kw.cpu())
    # the reference rotates in fp32 and rounds to dtype as the kernel does; compare the
    # kernel's own rotated keys (within rounding of ref_k) through the reference store
    triton_ops.qk_norm_rope_(q, k, positions, cos_sin, qw, kw, 1e-6,
                             fused_ops.KVStore(v, caches[0], caches[1], slots, k_scale, v_scale))
    torch.testing.assert_close(k.float().cpu(), ref_k.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    ref_caches = [c.cpu() for c in caches[2:]]
    torch_ref.store_kvcache(k.cpu(), v.cpu(), *ref_caches, slots.cpu(), k_scale.cpu(), v_scale.cpu())
    for cache, ref in zip(caches[:2], ref_caches):
        assert torch.equal(cache.cpu().view(torch.uint8), ref.view(torch.uint8)), f"seed {gen.initial_seed()}"


# (num_cached, q_len) per sequence; heads; kv heads; head_dim; block_size; kwargs
CASES = {
    "mixed_gqa2": ([(0, 7), (19, 5), (130, 10), (0, 1), (32, 1)], 4, 2, 32, 16, dict(max_seqlen_q=10)),
    "decode_split3": ([(0, 1), (69, 1), (149, 1)], 8, 2, 64, 16, dict(max_seqlen_q=1, num_splits=3)),
}


@needs_kernels
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", Q_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_over_an_fp8_cache(gen, case, dtype, cache_dtype):
    from nanovllm.kernels import triton_attn
    seqs, heads, kv_heads, d, block_size, kwargs = CASES[case]
    paged = random_paged_batch(gen, seqs, heads, kv_heads, d, block_size, cache_dtype)
    on_device = {name: t.to(DEVICE) for name, t in paged["batch"].items()}
    got = triton_attn.paged_attention(paged["q"].to(dtype=dtype, device=DEVICE), paged["k_cache"].to(DEVICE),
                                      paged["v_cache"].to(DEVICE), **on_device, scale=d ** -0.5,
                                      k_scale=paged["k_scale"].to(DEVICE), v_scale=paged["v_scale"].to(DEVICE),
                                      **kwargs).float().cpu()
    assert_attention_close(got, reference_attention(paged), dtype, gen)


def test_quantize_rounds_and_clips_like_torch():
    x = torch.tensor([[[0.0, 1.0, -3.3, 1e6, -1e6, 2.0 ** -12]]])
    for dtype in FP8:
        q = kv_quant.quantize(x, torch.tensor([0.5]), dtype)
        limit = torch.finfo(dtype).max
        assert q.float()[0, 0, 3] == limit and q.float()[0, 0, 4] == -limit  # clipped, never inf or NaN
        assert torch.equal(q.float()[0, 0, :3], (x[0, 0, :3] / 0.5).to(dtype).float())
        torch.testing.assert_close(kv_quant.dequantize(q, torch.tensor([0.5]), torch.float32)[0, 0, :3],
                                   x[0, 0, :3], atol=0.5, rtol=0.07)


@needs_kernels
@pytest.mark.parametrize("m", [1, 5, 40])
def test_block_fp8_linear_matches_the_dequantized_product(gen, m):
    """kernels/triton_fp8.block_fp8_linear against x @ (w * block scales)^T in fp32; a ragged
    N and K (not multiples of the block) included."""
    from nanovllm.kernels import triton_fp8
    from nanovllm.layers.quantization.fp8 import expand_block_scales
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    n, k, block = 80, 96, (32, 32)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // 32), -(-k // 32), generator=gen) * 0.01 + 1e-3
    expected = x.float() @ (w.float() * expand_block_scales(scale, block, (n, k))).t()
    got = triton_fp8.block_fp8_linear(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), block).float().cpu()
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3), f"relative error {rel:.2e}, seed {gen.initial_seed()}"
