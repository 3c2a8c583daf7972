"""kernels/cpu_attn.py (batched CPU decode attention) against kernels/torch_ref.py, with and without\nthe C++ decode kernel."""
import pytest
import torch

from nanovllm.kernels import cpu_attn, cpu_paged_decode, step_memo, torch_ref
from nanovllm.utils.device import cpu_has_fast_bf16


@pytest.fixture(autouse=True, params=["paged_kernel", "torch_only"])
def decode_path(request, monkeypatch):
    """Every test on both decode paths: the C++ kernel (kernels/cpu_paged_decode.py: where a C++
    compiler is found, for head sizes that are multiples of 16) and the torch-only one (the
    gather and the decode mirrors: without a compiler)."""
    if request.param == "torch_only":
        monkeypatch.setattr(cpu_paged_decode, "kernel_for", lambda *args: None)
    return request.param


def _paged_case(seq_lens, q_lens, num_heads, num_kv_heads, head_dim=16, block_size=16, seed=0, layout="contiguous"):
    """A shuffled paged cache holding `seq_lens` contexts, with -1-padded block tables.
    layout: "contiguous" ([num_blocks, block_size, kv_heads, d] memory) or "heads_major"
    (cpu_attn.new_kv_cache, the engine's CPU cache), holding the same values."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks that no table points at
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    if layout == "heads_major":
        k_cache, v_cache = _in_engine_layout(k_cache), _in_engine_layout(v_cache)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + 1  # one more column than any sequence needs: padding must be ignored
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), tables


def _in_engine_layout(cache: torch.Tensor) -> torch.Tensor:
    """`cache`'s values in a cache made by cpu_attn.new_kv_cache (memory [kv_heads, blocks, rows, d])."""
    out = cpu_attn.new_kv_cache(tuple(cache.shape), cache.dtype, cache.device)[0]
    out.copy_(cache)
    assert out.permute(2, 0, 1, 3).is_contiguous() and torch.equal(out, cache)
    return out


LAYOUTS = ["contiguous", "heads_major"]


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3), (8, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_matches_reference(num_heads, num_kv_heads, block_size, layout):
    seq_lens = [1, 16, 17, 40, 5, 33]
    case = _paged_case(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, block_size=block_size, layout=layout)
    expected = torch_ref.paged_attention(*case, scale=0.25)
    torch.testing.assert_close(cpu_attn.paged_attention(*case, scale=0.25), expected, rtol=1e-5, atol=1e-5)
    trimmed = cpu_attn.paged_attention(*case, scale=0.25, max_seqlen_q=1, max_seqlen_k=max(seq_lens))
    torch.testing.assert_close(trimmed, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_and_mixed_steps_match_reference(layout):
    case = _paged_case([7, 30, 1, 18], [7, 12, 1, 1], num_heads=6, num_kv_heads=2, layout=layout)
    torch.testing.assert_close(cpu_attn.paged_attention(*case, scale=0.3), torch_ref.paged_attention(*case, scale=0.3),
                               rtol=1e-5, atol=1e-5)


def test_cpu_backend_is_registered():
    from nanovllm.kernels import get_attention_backend
    assert get_attention_backend("cpu") is cpu_attn


@pytest.mark.parametrize("slots", [[5, 0, 17, 3], [5, -1, 17, -1], []])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_store_kvcache_matches_reference(slots, layout):
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(len(slots), 2, 8, generator=gen), torch.randn(len(slots), 2, 8, generator=gen)
    caches = [torch.zeros(3, 8, 2, 8) for _ in range(4)]
    if layout == "heads_major":  # ours in the engine's layout, the reference's contiguous
        caches[:2] = [_in_engine_layout(c) for c in caches[:2]]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    cpu_attn.store_kvcache(k, v, caches[0], caches[1], slot_mapping)
    torch_ref.store_kvcache(k, v, caches[2], caches[3], slot_mapping)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert bool(caches[0].any()) == any(s >= 0 for s in slots)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nan_in_slots_no_sequence_owns_does_not_leak(layout):
    """An uninitialised cache can hold NaN bit patterns past a sequence's end and in padding
    blocks: weight 0 times NaN must not reach the output."""
    seq_lens = [3, 20, 16, 9]
    q, k_cache, v_cache, cu, lens, tables = _paged_case(seq_lens, [1] * 4, num_heads=6, num_kv_heads=2, layout=layout)
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
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixed_steps_split_decodes_from_prefills(q_lens, layout):
    """Decodes of a mixed step take the batched path, its prefill chunks the reference; together
    they equal the reference's whole step (prefills first, last, between, alone)."""
    seq_lens = [n + 11 * i for i, n in enumerate(q_lens)]
    case = _paged_case(seq_lens, q_lens, num_heads=6, num_kv_heads=2, block_size=5, layout=layout)
    expected = torch_ref.paged_attention(*case, scale=0.3)
    for _ in range(2):  # the second call reuses the step's split and plan
        torch.testing.assert_close(cpu_attn.paged_attention(*case, scale=0.3, max_seqlen_k=max(seq_lens)),
                                   expected, rtol=1e-5, atol=1e-5)
    if sum(n == 1 for n in q_lens) >= 2:
        assert step_memo._local.mixed_split[1] is not None


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_in_engine_layout_equals_its_dequantized_values(dtype):
    """Stores quantize into the heads-major fp8 cache (moved as bytes); decode reads it back as
    attention over the dequantized cache, and the stored bytes are the reference store's."""
    from nanovllm.kernels import kv_quant
    seq_lens = [9, 30, 17]
    q, k_src, v_src, _, lens, tables = _paged_case(seq_lens, [1] * 3, num_heads=4, num_kv_heads=2)
    scales = torch.tensor([0.02, 0.05]), torch.tensor([0.01, 0.03])
    ours = cpu_attn.new_kv_cache(tuple(k_src.shape), dtype, k_src.device)
    ref = torch.zeros(k_src.shape, dtype=dtype), torch.zeros(k_src.shape, dtype=dtype)
    slots = torch.arange(k_src.shape[0] * k_src.shape[1])
    rows = k_src.view(-1, *k_src.shape[2:]), v_src.view(-1, *v_src.shape[2:])
    cpu_attn.store_kvcache(*rows, *ours, slots, *scales)
    torch_ref.store_kvcache(*rows, *ref, slots, *scales)
    for a, b in zip(ours, ref):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    deq = [kv_quant.dequantize(c.view(-1, *c.shape[2:]), s, torch.float32).view(c.shape) for c, s in zip(ours, scales)]
    torch.testing.assert_close(cpu_attn.decode_attention(q, *ours, lens, tables, 0.25, None, *scales),
                               torch_ref.paged_attention(q, *deq, torch.arange(4, dtype=torch.int32), lens, tables, 0.25),
                               rtol=1e-5, atol=1e-5)


# ---- decode mirrors (kernels/cpu_decode_mirror.py) ------------------------------------------

def _layer_step(k_cache, v_cache, tables, seq_lens, q_lens, gen, num_heads=4):
    """One layer's work in an engine step: store this step's K/V, then attend; returns ours and
    the reference's output over the same cache (in fp32, on the same values, for a bf16 cache)."""
    kv_heads, d, block_size = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(seq_lens, q_lens)])
    rows = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    slots = tables[rows, positions // block_size].long() * block_size + positions % block_size
    dtype = k_cache.dtype
    key = torch.randn(len(slots), kv_heads, d, generator=gen).to(dtype)
    value = torch.randn(len(slots), kv_heads, d, generator=gen).to(dtype)
    cpu_attn.store_kvcache(key, value, k_cache, v_cache, slots)
    q = torch.randn(int(cu[-1]), num_heads, d, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ours = cpu_attn.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.3, max_seqlen_k=max(seq_lens))
    ref = torch_ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), cu, lens, tables, 0.3)
    return ours.float(), ref


def _engine_caches(num_blocks, block_size=4, kv_heads=2, d=8, dtype=torch.float32):
    caches = cpu_attn.new_kv_cache((num_blocks, block_size, kv_heads, d), dtype, torch.device("cpu"))
    for c in caches:
        c.fill_(float("nan"))  # what an unwritten cache may hold
    return caches


FAST_BF16 = cpu_has_fast_bf16()
# bf16 K/V, queries and probabilities against the fp32 reference on the same values: a few 2^-8 steps
MIRROR_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not FAST_BF16, reason="bf16 decode attention by products runs only where the CPU multiplies bf16 fast"))])
def test_decode_steps_through_the_mirror_match_the_reference(monkeypatch, dtype):
    """Prefill, then decode steps that cross block boundaries, one sequence ending (the batch
    shrinks: a rebuild), then growth again: every step equals the reference, and the steps after
    a batch lasted one step read the mirror (in bf16: its whole buffers, the zero tail masked)."""
    from nanovllm.kernels import cpu_decode_mirror
    appended = []
    append = cpu_decode_mirror.append
    monkeypatch.setattr(cpu_decode_mirror, "append", lambda *args: appended.append(1) or append(*args))
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = _engine_caches(64, dtype=dtype)
    tol = MIRROR_TOL[dtype]
    tables = torch.tensor([[0, 5, 9, 2, 7, 11], [3, 4, 1, 6, 8, 10], [12, 13, 14, 15, 16, 17]], dtype=torch.int32)
    lens = [6, 3, 9]
    ours, ref = _layer_step(k_cache, v_cache, tables, lens, lens, gen)  # prefill
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
    for step in range(10):
        if step == 5:  # the second sequence ends
            tables, lens = tables[[0, 2]], [lens[0], lens[2]]
        lens = [n + 1 for n in lens]
        ours, ref = _layer_step(k_cache, v_cache, tables, lens, [1] * len(lens), gen)
        torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
    assert len(appended) == 6  # all but the first two decode steps of each batch (gathered; mirrored at the second)


def test_a_prefill_into_an_ended_sequences_blocks_is_not_read_from_its_mirror():
    """Sequence X ends; a prompt Y takes X's blocks, in the same row, and its first decode step
    looks exactly like X's next one (same table, length + 1): the prefill step must have
    invalidated the mirror, or X's K/V would be read for Y."""
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache = _engine_caches(64)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    _layer_step(k_cache, v_cache, tables, [5, 7], [5, 7], gen)
    _layer_step(k_cache, v_cache, tables, [6, 8], [1, 1], gen)
    _layer_step(k_cache, v_cache, tables, [7, 9], [1, 1], gen)  # mirror filled
    _layer_step(k_cache, v_cache, tables[1:], [9], [9], gen)     # Y: a prompt of 9 into X's blocks
    ours, ref = _layer_step(k_cache, v_cache, tables, [8, 10], [1, 1], gen)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_no_mirror_where_it_would_outgrow_the_paged_cache():
    from nanovllm.kernels import cpu_decode_mirror
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = _engine_caches(4, block_size=16)  # 64 slots: a mirror needs 2 x (20 + slack) rows
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    _layer_step(k_cache, v_cache, tables, [20, 17], [20, 17], gen)
    for lens in ([21, 18], [22, 19]):
        ours, ref = _layer_step(k_cache, v_cache, tables, lens, [1, 1], gen)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    mirror = cpu_decode_mirror._mirror_of(k_cache)
    assert mirror.k is None and not mirror.held


@pytest.mark.skipif(not FAST_BF16,
                    reason="the bf16 products path runs only where the CPU multiplies bf16 fast")
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("sdpa_max_key_rows", [0, 10**6])  # by products / by SDPA (small steps)
def test_bf16_decode_by_products_matches_fp32_reference(num_heads, num_kv_heads, sdpa_max_key_rows, monkeypatch):
    """bf16 decode attention (two batched products around an fp32 softmax on AVX512-BF16 / AMX;
    SDPA for steps of at most SDPA_MAX_KEY_ROWS keys) equals the fp32 reference on the same bf16
    values to bf16 rounding."""
    monkeypatch.setattr(cpu_attn, "SDPA_MAX_KEY_ROWS", sdpa_max_key_rows)
    seq_lens = [1, 16, 17, 40, 5, 33]
    q, k_cache, v_cache, *rest = _paged_case(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads,
                                             layout="heads_major")
    q, k_cache, v_cache = (t.bfloat16() for t in (q, k_cache, v_cache))
    expected = torch_ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), *rest, scale=0.25)
    ours = cpu_attn.paged_attention(q, k_cache, v_cache, *rest, scale=0.25)
    assert ours.dtype == torch.bfloat16
    # bf16 outputs (|o| < ~1) and bf16 probabilities: off by a few 2^-8 steps; a wrong mask or
    # head mapping is off by ~0.1-1
    torch.testing.assert_close(ours.float(), expected, rtol=2e-2, atol=2e-2)
