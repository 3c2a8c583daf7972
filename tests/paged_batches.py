"""Random paged-attention batches for the attention kernel tests, and their check.

`random_paged_batch` builds sequences over a paged KV cache written by the torch reference
(blocks in random order, unowned slots NaN so that an unmasked read shows), the queries, the
per-KV-head scales of an fp8 cache, and the batch's metadata, all on the CPU.
`assert_attention_close` compares a kernel's output with the reference's.
"""
import torch

from nanovllm.kernels import kv_quant, torch_ref

# the same cache on both sides: only the queries' dtype and the summation order differ
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
FP8_VALUE_STD = 0.02  # K and V of an fp8 cache: well inside its range at scales of 0.005-0.025


def random_kv_scales(gen: torch.Generator, heads: int) -> torch.Tensor:
    """Per-head fp8 scales, all different.  # [heads] float32"""
    return 0.005 + 0.02 * torch.rand(heads, generator=gen)


def random_paged_batch(gen: torch.Generator, seqs: list[tuple[int, int]], heads: int, kv_heads: int,
                       head_dim: int, block_size: int, cache_dtype: torch.dtype) -> dict:
    """`seqs`: (num_cached, q_len) per sequence. Returns q [num_tokens, heads, d] (float32 over an
    fp8 cache, else the cache's dtype), k_cache, v_cache, k_scale and v_scale ([kv_heads], None
    for a 16-bit cache), and `batch` (cu_seqlens_q, seq_lens_k, block_tables)."""
    fp8 = kv_quant.is_fp8(cache_dtype)
    ctx_lens = [c + n for c, n in seqs]
    per_seq = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seqs), max(per_seq) + 1), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    # NaN where nothing was written (fp8 0xFF in both formats): an unmasked read shows
    k_cache = torch.full(shape, 0xFF, dtype=torch.uint8).view(cache_dtype) if fp8 else \
        torch.full(shape, float("nan"), dtype=cache_dtype)
    v_cache = k_cache.clone()
    k_scale, v_scale = [random_kv_scales(gen, kv_heads) if fp8 else None for _ in range(2)]
    for b, (ctx, nb) in enumerate(zip(ctx_lens, per_seq)):
        blocks = torch.tensor([order.pop() for _ in range(nb)])
        tables[b, :nb] = blocks
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen) * (FP8_VALUE_STD if fp8 else 0.5)
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen) * (FP8_VALUE_STD if fp8 else 1.0)
        if not fp8:
            k, v = k.to(cache_dtype), v.to(cache_dtype)
        torch_ref.store_kvcache(k, v, k_cache, v_cache, torch_ref.context_slots(blocks, ctx, block_size),
                                k_scale, v_scale)
    q_lens = [n for _, n in seqs]
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen)
    batch = dict(cu_seqlens_q=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
                 seq_lens_k=torch.tensor(ctx_lens, dtype=torch.int32), block_tables=tables)
    return dict(q=q if fp8 else q.to(cache_dtype), k_cache=k_cache, v_cache=v_cache,
                k_scale=k_scale, v_scale=v_scale, batch=batch)


def reference_attention(paged: dict) -> torch.Tensor:
    """The torch reference over `paged`'s cache, scale head_dim ** -0.5.  # [num_tokens, heads, d] float32"""
    return torch_ref.paged_attention(paged["q"], paged["k_cache"], paged["v_cache"], **paged["batch"],
                                     scale=paged["q"].shape[-1] ** -0.5, k_scale=paged["k_scale"],
                                     v_scale=paged["v_scale"]).float()


def assert_attention_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                           gen: torch.Generator) -> None:
    """A kernel's output (queries in `dtype`) against the reference's, naming the seed."""
    seed = f"seed {gen.initial_seed()}"
    assert not got.isnan().any(), f"NaN in output (an unmasked read), {seed}"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol, msg=lambda m: f"{m}\n{seed}")
