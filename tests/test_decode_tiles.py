"""The decode tile's variants against the torch reference: other tile shapes, and fp8 caches
laid out heads-major or with V key-minor within each block (`triton_attn.new_kv_cache`), which
must read and write the same values as the contiguous layout.

- `paged_attention` equals the torch reference over the contiguous cache with the same bytes:
  decodes with and without split-KV, a padded head size and 3 query heads per KV head (rows
  masked), and for a key-minor V also prefill chunks over a cached prefix.
- `store_kvcache` and the fused RoPE store write the same bytes into a heads-major K and a
  key-minor V as into contiguous ones (the same kernel both times, so the interpreter's fp8
  rounding is no matter).
- The CUDA-core decode kernel (`triton_decode_fma`, DECODE_FMA_*) passes the same checks.
- `new_kv_cache` gives those layouts (FP8_HEADS_MAJOR, FP8_V_KEY_MINOR) only for fp8 caches.

Natively on a GPU (bf16 queries too); without one, in a child under `TRITON_INTERPRET=1`.
"""

import pytest
import torch

from nanovllm.kernels import fused_ops, kv_quant
from paged_batches import assert_attention_close, random_kv_scales, random_paged_batch, reference_attention
from triton_interpreter import HAS_TRITON, RUN_HERE, OnGpu, needs_kernels, rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
CHILD_TIMEOUT_S = 120
Q_DTYPES = [torch.float16] + ([torch.float32, torch.bfloat16] if HAS_CUDA else [])
FP8 = torch.float8_e4m3fn


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON, reason="kernels run in this process")
def test_decode_tiles_under_triton_interpreter():
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)


# memory order of each layout (dims of [blocks, block_size, heads, dim]) and the permutation back
LAYOUTS = {"plain": ((0, 1, 2, 3), (0, 1, 2, 3)), "heads_major": ((0, 2, 1, 3), (0, 2, 1, 3)),
           "key_minor": ((0, 2, 3, 1), (0, 3, 1, 2))}


def _relayout(cache: torch.Tensor, layout: str = "key_minor") -> torch.Tensor:
    """The same values with memory in `layout`'s order (key_minor: [blocks, heads, dim, block_size])."""
    order, back = LAYOUTS[layout]
    out = torch.empty([cache.shape[i] for i in order], dtype=cache.dtype, device=cache.device).permute(*back)
    kv_quant.as_bytes(out).copy_(kv_quant.as_bytes(cache))
    return out


def test_opaque_casts_only_for_16_bit_queries_over_fp8_on_nvidia_outside_the_interpreter(monkeypatch):
    """The fp8 decode tile's inline-assembly identity (DECODE_FP8_OPAQUE_V_CAST, and for K where
    DECODE_FP8_OPAQUE_K_CAST adds it) is chosen where PTX runs and the tile casts to 16 bits;
    everywhere else the added zero stands in (the kernel's results are the same either way: the
    natively run tile tests cover the assembly)."""
    from nanovllm.kernels import triton_attn

    def casts(kv_fp8, q):
        got = triton_attn._opaque_casts(kv_fp8, q)
        return got["OPAQUE_K_CAST"], got["OPAQUE_V_CAST"]

    q16, q32 = (torch.empty(2, 4, 8, dtype=d).as_subclass(OnGpu) for d in (torch.bfloat16, torch.float32))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert casts(True, q16) == (False, True)
    monkeypatch.setattr(triton_attn, "DECODE_FP8_OPAQUE_K_CAST", True)
    assert casts(True, q16) == (True, True)
    assert casts(False, q16) == casts(True, q32) == (False, False)
    assert casts(True, torch.empty(2, 4, 8, dtype=torch.bfloat16)) == (False, False)  # a CPU tensor
    monkeypatch.setattr(triton_attn, "DECODE_FP8_OPAQUE_V_CAST", False)
    assert casts(True, q16) == (False, False)  # K's only beside V's
    monkeypatch.setattr(triton_attn, "DECODE_FP8_OPAQUE_V_CAST", True)
    for interpret in ("1", "true"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        assert casts(True, q16) == (False, False)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.version, "hip", "6.0")
    assert casts(True, q16) == (False, False)


def test_the_register_cap_goes_with_the_opaque_v_cast_only(monkeypatch):
    """DECODE_FP8_OPAQUE_MAXNREG caps the fp8 decode tile only where its V takes the identity; other
    fp8 decode tiles (the fp8 tensor-core options, key-minor V, fp32 queries) keep
    DECODE_FP8_MAXNREG (None: ptxas's choice), which takes precedence where set."""
    from nanovllm.kernels import triton_attn as ta
    monkeypatch.setattr(ta, "DECODE_FP8_MAXNREG", None)
    assert ta._tile_config(1, 4, kv_fp8=True, opaque_v_cast=True)["maxnreg"] == ta.DECODE_FP8_OPAQUE_MAXNREG
    assert "maxnreg" not in ta._tile_config(1, 4, kv_fp8=True, opaque_v_cast=False)
    assert "maxnreg" not in ta._tile_config(1, 4, kv_fp8=True, on_gpu=False, opaque_v_cast=True)
    assert "maxnreg" not in ta._tile_config(8, 4, kv_fp8=True, opaque_v_cast=True)  # a prefill tile
    monkeypatch.setattr(ta, "DECODE_FP8_MAXNREG", 128)
    assert ta._tile_config(1, 4, kv_fp8=True, opaque_v_cast=True)["maxnreg"] == 128


def test_new_kv_cache_is_key_minor_for_fp8_only(monkeypatch):
    from nanovllm.kernels import triton_attn
    shape = (3, 16, 2, 8)
    monkeypatch.setattr(triton_attn, "FP8_V_KEY_MINOR", True)
    k, v = triton_attn.new_kv_cache(shape, FP8, torch.device("cpu"))
    assert k.shape == v.shape == shape and k.is_contiguous()
    assert v.stride() == (16 * 2 * 8, 1, 8 * 16, 16)  # rows of a block adjacent for each dimension
    k, v = triton_attn.new_kv_cache(shape, torch.bfloat16, torch.device("cpu"))
    assert v.is_contiguous()
    monkeypatch.setattr(triton_attn, "FP8_V_KEY_MINOR", False)
    assert triton_attn.new_kv_cache(shape, FP8, torch.device("cpu"))[1].is_contiguous()
    monkeypatch.setattr(triton_attn, "FP8_HEADS_MAJOR", True)
    for cache in triton_attn.new_kv_cache(shape, FP8, torch.device("cpu")):
        assert cache.shape == shape and cache.stride() == (16 * 2 * 8, 8, 16 * 8, 1)  # a head's block together
    assert triton_attn.new_kv_cache(shape, torch.bfloat16, torch.device("cpu"))[0].is_contiguous()


# (num_cached, q_len) per sequence; heads; kv heads; head_dim; block_size; kwargs
CASES = {
    "mixed_gqa2": ([(0, 7), (19, 5), (130, 10), (0, 1), (32, 1)], 4, 2, 32, 16, dict(max_seqlen_q=10)),
    "decode_split3": ([(0, 1), (69, 1), (149, 1)], 8, 2, 64, 16, dict(max_seqlen_q=1, num_splits=3)),
    "decode_gqa3_d40": ([(0, 1), (63, 1), (64, 1), (200, 1)], 6, 2, 40, 16, dict(max_seqlen_q=1)),
    "decode_gqa2_split2": ([(0, 1), (40, 1), (150, 1)], 4, 2, 64, 16, dict(max_seqlen_q=1, num_splits=2)),
}
# name -> (triton_attn constants, K layout, V layout, cases)
# (the tensor-core tile's variants turn the CUDA-core kernel, an fp8 cache's default, off)
VARIANTS = {
    "key_minor": (dict(DECODE_FMA_FP8=False), "plain", "key_minor", ["mixed_gqa2", "decode_split3"]),
    "heads_major_key_minor": (dict(DECODE_FMA_FP8=False, DECODE_FP8_BLOCK_N=64, DECODE_FP8_NUM_STAGES=5),
                              "heads_major", "key_minor", ["mixed_gqa2", "decode_gqa3_d40"]),
    "tile64": (dict(DECODE_FMA_FP8=False, DECODE_BLOCK_N=64, DECODE_FP8_BLOCK_N=64), "plain", "plain",
               ["decode_split3", "decode_gqa3_d40"]),
    # decode on the CUDA cores (triton_decode_fma), its default tile and a 2-warp one over other layouts
    # (groups above DECODE_FMA_MAX_GROUP allowed, so that programs of more than one pair of heads run)
    "fma": (dict(DECODE_FMA_FP8=True, DECODE_FMA_16BIT=True), "plain", "plain", ["decode_gqa2_split2"]),
    "fma_groups": (dict(DECODE_FMA_FP8=True, DECODE_FMA_16BIT=True, DECODE_FMA_MAX_GROUP=8), "plain", "plain",
                   ["decode_split3", "decode_gqa3_d40"]),
    "fma_w2_key_minor": (dict(DECODE_FMA_FP8=True, DECODE_FMA_BLOCK_N=16, DECODE_FMA_NUM_WARPS=2,
                              DECODE_FMA_MAX_GROUP=8), "heads_major", "key_minor", ["decode_split3"]),
    "fma_pv16": (dict(DECODE_FMA_FP8=True, DECODE_FMA_PV_FP16=True), "plain", "plain", ["decode_gqa2_split2"]),
    # P V summed over all keys each tile (one partial sum), the loop's loads not pipelined (one stage)
    "fma_rows1": (dict(DECODE_FMA_FP8=True, DECODE_FMA_16BIT=True, DECODE_FMA_ACC_ROWS=1), "plain", "plain",
                  ["decode_gqa2_split2", "decode_gqa3_d40"]),
    "fma_s1": (dict(DECODE_FMA_FP8=True, DECODE_FMA_16BIT=True, DECODE_FMA_NUM_STAGES=1), "plain", "plain",
               ["decode_gqa2_split2"]),
    "fma_acc2d": (dict(DECODE_FMA_FP8=True, DECODE_FMA_16BIT=True, DECODE_FMA_ACC_2D=True), "plain", "plain",
                  ["decode_gqa2_split2"]),
}
PARAMS = [(v, c, cache) for v, (_, _, v_layout, cases) in VARIANTS.items() for c in cases
          for cache in ([FP8] if v_layout == "key_minor" else [FP8, torch.float16])]


@needs_kernels
@pytest.mark.parametrize("dtype", Q_DTYPES)
@pytest.mark.parametrize("variant,case,cache_dtype", PARAMS)
def test_paged_attention_decode_tiles(gen, monkeypatch, variant, case, cache_dtype, dtype):
    from nanovllm.kernels import triton_attn
    constants, k_layout, v_layout, _ = VARIANTS[variant]
    for name, value in constants.items():
        monkeypatch.setattr(triton_attn, name, value)
    fp8 = kv_quant.is_fp8(cache_dtype)
    if not fp8:  # a 16-bit cache holds the queries' dtype
        dtype = cache_dtype = dtype if dtype != torch.float32 else torch.float16
    seqs, heads, kv_heads, d, block_size, kwargs = CASES[case]
    paged = random_paged_batch(gen, seqs, heads, kv_heads, d, block_size, cache_dtype)
    k_in = _relayout(paged["k_cache"].to(DEVICE), k_layout)
    v_in = _relayout(paged["v_cache"].to(DEVICE), v_layout)
    scales = dict(k_scale=paged["k_scale"].to(DEVICE), v_scale=paged["v_scale"].to(DEVICE)) if fp8 else {}
    got = triton_attn.paged_attention(
        paged["q"].to(dtype=dtype, device=DEVICE), k_in, v_in,
        **{name: t.to(DEVICE) for name, t in paged["batch"].items()}, scale=d ** -0.5, **scales, **kwargs).float().cpu()
    assert_attention_close(got, reference_attention(paged), dtype, gen)


@needs_kernels
def test_stores_write_the_same_bytes_in_every_layout(gen):
    """store_kvcache and the fused RoPE store: K heads-major and V key-minor hold what the
    contiguous caches hold."""
    from nanovllm.kernels import triton_attn, triton_ops
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    tokens, heads, kv_heads, d, max_pos, blocks, block_size = 6, 4, 2, 32, 64, 5, 4
    slots = torch.tensor([3, 17, -1, 0, 19, 8], device=DEVICE)
    k_scale, v_scale = [random_kv_scales(gen, kv_heads).to(DEVICE) for _ in range(2)]
    shape = (blocks, block_size, kv_heads, d)
    seed = f"seed {gen.initial_seed()}"

    def caches(cache_dtype):  # (plain K, plain V), (heads-major K, key-minor V), all zero
        zero = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
        return [(zero.clone(), zero.clone()), (_relayout(zero, "heads_major"), _relayout(zero, "key_minor"))]

    def assert_same(pairs):
        for plain, other in zip(*pairs):
            assert torch.equal(kv_quant.as_bytes(plain), kv_quant.as_bytes(other).contiguous()), seed
            assert kv_quant.as_bytes(plain).any(), "nothing was stored"

    for cache_dtype in (FP8, dtype):
        scales = (k_scale, v_scale) if cache_dtype == FP8 else (None, None)
        key = torch.randn(tokens, kv_heads, d, generator=gen).to(dtype=dtype, device=DEVICE)
        value = torch.randn(tokens, kv_heads, d, generator=gen).to(dtype=dtype, device=DEVICE)
        pairs = caches(cache_dtype)
        for k_cache, v_cache in pairs:
            triton_attn.store_kvcache(key, value, k_cache, v_cache, slots, *scales)
        assert_same(pairs)

        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype=dtype, device=DEVICE)
        positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(DEVICE)
        cos_sin = torch.randn(max_pos, d, generator=gen).to(DEVICE)
        pairs = caches(cache_dtype)
        for k_cache, v_cache in pairs:
            q, k, v = [t.view(tokens, -1, d) for t in
                       qkv.clone().split([heads * d, kv_heads * d, kv_heads * d], -1)]
            triton_ops.qk_norm_rope_(q, k, positions, cos_sin, None, None, 1e-6,
                                     fused_ops.KVStore(v, k_cache, v_cache, slots, *scales))
        assert_same(pairs)
