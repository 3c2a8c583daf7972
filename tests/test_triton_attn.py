"""Triton kernels (`kernels/triton_attn.py`) against the torch reference (`kernels/torch_ref.py`).

Where CUDA is available the kernels run natively, bf16 included, plus a CUDA-graph
capture of a decode batch. Without it they run under Triton's interpreter on CPU
tensors, in fp32 and fp16 only (the interpreter gets bf16 `tl.dot` wrong).

How the interpreter is switched on without leaking into other tests: Triton chooses
interpreter or compiler when a `@triton.jit` function is decorated, and its own library
functions (`tl.sum`, `tl.cdiv`, ...) are decorated when `triton` is first imported, so
`TRITON_INTERPRET=1` must be in the environment before any import of triton in the
process. A pytest session cannot promise that (another test module may import triton
first), so on a machine without CUDA this file re-runs itself in a child
`python -m pytest` whose environment has `TRITON_INTERPRET=1` from the start
(`test_kernels_under_triton_interpreter`); in the parent the kernel tests skip, and
the child's report is shown on failure. Run the file with `TRITON_INTERPRET=1` set to
see the individual tests. Without a GPU and without `triton`, everything skips.

Every run draws fresh random inputs (the seed is in each failure message); outputs,
split-KV workspaces and cache slots outside every context are NaN-poisoned, so an
unwritten element or an unmasked read shows up as NaN.
"""

import pytest
import torch

from nanovllm.kernels import torch_ref
from paged_batches import TOLERANCE  # atol = rtol
from triton_interpreter import HAS_TRITON, RUN_HERE, rerun_under_interpreter, run_programs_in_reverse

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
# ||out - ref|| / ||ref||; measured on the H200 over real shapes: bf16 <= 2.3e-3, fp16 <= 2.8e-4,
# fp32 <= 5.3e-7 (benchmarks/RESULTS.md, B4)
REL_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
SPARE_BLOCKS = 3   # cache blocks no sequence owns: they stay NaN
TABLE_PAD = 2      # extra -1 columns in every block table
CHILD_TIMEOUT_S = 600


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON, reason="kernels run in this process")
def test_kernels_under_triton_interpreter():
    """No GPU: run this file again, in a child process with the interpreter on."""
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)


@pytest.fixture(scope="module")
def kernels():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if not RUN_HERE:
        pytest.skip("no GPU: runs in test_kernels_under_triton_interpreter's child")
    from nanovllm.kernels import triton_attn
    return triton_attn


@pytest.fixture
def poisoned_kernels(kernels, monkeypatch):
    """The kernel module with NaN-filled split-KV workspaces."""
    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(kernels, "_empty", nan_empty)
    return kernels


def _randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


# ------------------------------------------------------------------------ store_kvcache
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 2, 64), (1, 3, 80), (5, 1, 32)])
def test_store_kvcache(kernels, gen, dtype, block_size, num_kv_heads, head_dim):
    num_tokens = 11
    num_blocks = num_tokens + SPARE_BLOCKS  # enough slots even at block size 1
    key = _randn(gen, num_tokens, num_kv_heads, head_dim, dtype=dtype)
    value = _randn(gen, num_tokens, num_kv_heads, head_dim, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.3] = -1
    slot_mapping = slots.to(device=DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = _randn(gen, *shape, dtype=dtype)
    v_cache = _randn(gen, *shape, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kernels.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    torch_ref.store_kvcache(key, value, k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache, k_ref), f"seed {gen.initial_seed()}"
    assert torch.equal(v_cache, v_ref), f"seed {gen.initial_seed()}"


# --------------------------------------------------------------------- paged_attention
def _make_batch(gen, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """A batch of (num_cached, q_len) sequences over a shuffled, NaN-poisoned cache."""
    ctx_lens = [cached + q_len for cached, q_len in seqs]
    blocks_per_seq = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(blocks_per_seq) + SPARE_BLOCKS
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(seqs), max(blocks_per_seq) + TABLE_PAD), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for b, (ctx, nb) in enumerate(zip(ctx_lens, blocks_per_seq)):
        blocks = torch.tensor([order.pop() for _ in range(nb)])
        block_tables[b, :nb] = blocks
        slots = torch_ref.context_slots(blocks, ctx, block_size)  # [ctx]
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
            ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
    q_lens = [q_len for _, q_len in seqs]
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu_seqlens_q,
                seq_lens_k=torch.tensor(ctx_lens, dtype=torch.int32), block_tables=block_tables)


def _reference(batch, scale):
    """torch_ref in fp32 on the CPU, from the same (upcast) inputs."""
    cpu = {k: v.cpu() for k, v in batch.items()}
    for k in ("q", "k_cache", "v_cache"):
        cpu[k] = cpu[k].float()
    return torch_ref.paged_attention(**cpu, scale=scale)


# (num_cached, q_len) per sequence; heads; kv heads; head_dim; block_size; kwargs
ATTENTION_CASES = {
    "mixed_gqa2": ([(0, 7), (19, 5), (130, 10), (0, 1), (32, 1), (40, 1)], 4, 2, 32, 16,
                   dict(max_seqlen_q=10, max_seqlen_k=140)),
    "mha_hd64_bs1": ([(3, 4), (0, 1), (9, 1)], 2, 2, 64, 1, {}),
    "qpk3_hd80_bs5": ([(11, 6), (0, 3), (20, 1)], 6, 2, 80, 5, {}),
    "long_prefill_hd96": ([(0, 150), (7, 1)], 2, 1, 96, 32, dict(max_seqlen_q=150)),
    "gqa4_hd128_bs256": ([(70, 3), (5, 1), (300, 2)], 4, 1, 128, 256, {}),
    "decode_split": ([(0, 1), (69, 1), (149, 1), (299, 1)], 8, 2, 64, 16,
                     dict(max_seqlen_q=1, num_splits=3)),
    "decode_qpk8": ([(15, 1), (40, 1)], 8, 1, 32, 4, dict(max_seqlen_q=1, max_seqlen_k=41)),
    "prefill_split_mqa": ([(100, 9), (0, 20), (3, 1)], 4, 1, 32, 8, dict(num_splits=2)),
    # more splits than the combine kernel reads at once (COMBINE_SPLITS_BLOCK = 8), all of
    # them with keys in the long sequences (so some row's largest split lies past the first
    # 8: the online rescaling across blocks of splits matters); the short ones fill split 0 only
    # (2,500 keys: 20 decode tiles of 128, one a split; 762: 24 prefill tiles of 32)
    "decode_many_splits": ([(0, 1), (2450, 1), (2499, 1)], 2, 1, 16, 16, dict(max_seqlen_q=1, num_splits=20)),
    "prefill_many_splits": ([(750, 12), (5, 3)], 2, 1, 16, 16, dict(num_splits=24)),
}


def _check_paged_attention(kernels, gen, batch: dict, dtype: torch.dtype, scale: float, **kwargs) -> None:
    """The kernel, run into a NaN-filled output, against the fp32 reference: element by
    element, and as a whole (at long contexts the outputs are small, so the element-wise
    bf16 tolerance alone would let part of a context go unread)."""
    expected = _reference(batch, scale)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    out = torch.full_like(batch["q"], float("nan"))
    got = kernels.paged_attention(**batch, scale=scale, out=out, **kwargs)
    assert got is out
    got = got.float().cpu()
    seed = f"seed {gen.initial_seed()}"
    assert not got.isnan().any(), f"NaN in output (unwritten or unmasked), {seed}"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol, msg=lambda m: f"{m}\n{seed}")
    rel_err = ((got - expected).norm() / expected.norm()).item()
    assert rel_err <= REL_TOLERANCE[dtype], f"||out - ref|| / ||ref|| = {rel_err:.2e}, {seed}"


# Under the interpreter (no GPU) each case runs in one dtype, the two dtypes taking turns
# over decode, prefill, split and many-split cases; the cheap mixed cases in both.
F32, F16 = torch.float32, torch.float16
INTERPRETED_DTYPES = {"mixed_gqa2": (F32, F16), "mha_hd64_bs1": (F16,), "qpk3_hd80_bs5": (F32,),
                      "long_prefill_hd96": (F16,), "gqa4_hd128_bs256": (F32,), "decode_split": (F16,),
                      "decode_qpk8": (F32, F16), "prefill_split_mqa": (F32,), "decode_many_splits": (F32,),
                      "prefill_many_splits": (F16,)}
assert INTERPRETED_DTYPES.keys() == ATTENTION_CASES.keys()
PAGED_CASES = [(case, dtype) for case in ATTENTION_CASES
               for dtype in (DTYPES if HAS_CUDA else INTERPRETED_DTYPES[case])]


@pytest.mark.parametrize("case,dtype", PAGED_CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_paged_attention(poisoned_kernels, gen, case, dtype):
    seqs, num_heads, num_kv_heads, head_dim, block_size, kwargs = ATTENTION_CASES[case]
    batch = _make_batch(gen, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype)
    _check_paged_attention(poisoned_kernels, gen, batch, dtype, head_dim ** -0.5, **kwargs)


@pytest.mark.parametrize("case", ["long_prefill_hd96", "prefill_many_splits", "mixed_gqa2"])
def test_large_prefill_tile(poisoned_kernels, gen, monkeypatch, case):
    """The Hopper prefill tile (PREFILL_LARGE_*: 256 rows, 64 keys) forced on, on any
    machine: partial query tiles, more splits than key tiles, decodes beside prefills."""
    monkeypatch.setattr(poisoned_kernels, "_large_prefill_tile", lambda *args: True)
    seqs, num_heads, num_kv_heads, head_dim, block_size, kwargs = ATTENTION_CASES[case]
    batch = _make_batch(gen, seqs, num_heads, num_kv_heads, head_dim, block_size, torch.float16)
    _check_paged_attention(poisoned_kernels, gen, batch, torch.float16, head_dim ** -0.5, **kwargs)


@pytest.mark.parametrize("case", ["mixed_gqa2", "long_prefill_hd96", "decode_split", "prefill_many_splits"])
def test_softmax_scale_in_exp(poisoned_kernels, gen, monkeypatch, case):
    """SOFTMAX_SCALE_IN_EXP (the scale inside each exponent's argument) against the torch reference:
    decodes beside prefills, a long prefill, split decodes, more splits than key tiles; poisoned
    slots past each context stay unread."""
    monkeypatch.setattr(poisoned_kernels, "SOFTMAX_SCALE_IN_EXP", True)
    seqs, num_heads, num_kv_heads, head_dim, block_size, kwargs = ATTENTION_CASES[case]
    dtype = INTERPRETED_DTYPES[case][0] if not HAS_CUDA else torch.bfloat16
    batch = _make_batch(gen, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype)
    _check_paged_attention(poisoned_kernels, gen, batch, dtype, head_dim ** -0.5, **kwargs)


# A decode batch for the fused RoPE: contexts (the new token included) of one key, of a split
# boundary and longer; heads, KV heads, head size, block size, splits
E4M3_STEP = 2 ** -3  # the spacing of e4m3 values relative to their size (3 mantissa bits)
FUSED_ROPE_CASES = {
    "qk_norm_splits3": ([1, 16, 33, 200], 4, 2, 32, 16, 3),
    "plain_qpk3_bs8": ([5, 64, 129], 6, 2, 16, 8, 2),
}


@pytest.mark.parametrize("with_norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("cache_dtype", [None, "float8_e4m3fn"], ids=["cache16", "cache_fp8"])
@pytest.mark.parametrize("kernel", ["tile", "fma"])
@pytest.mark.parametrize("case", list(FUSED_ROPE_CASES))
def test_decode_fused_rope_matches_the_separate_kernel(kernels, gen, monkeypatch, case, kernel, cache_dtype,
                                                       with_norm):
    """A decode batch's q/k norm + RoPE and K/V store inside the decode tile (DECODE_FUSED_ROPE) give
    the same cache contents and the same output bits as triton_ops' RoPE kernel before the attention
    (under the interpreter; on a GPU the two kernels' sums of squares for the norm may run in other
    orders, so there: the same within the dtype's tolerance)."""
    _check_decode_fused_rope(kernels, gen, monkeypatch, case, kernel, cache_dtype, with_norm)


# the same for gluon_decode_mma (heads of 64 or more; a GPU of sm_89 or later)
GLUON_FUSED_ROPE_CASES = {
    "gqa4_d64_splits3": ([1, 16, 33, 200], 8, 2, 64, 16, 3),
    "gqa2_d128": ([7, 300], 4, 2, 128, 16, None),
}


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() < (8, 9),
                    reason="Gluon kernel: a GPU of sm_89 or later")
@pytest.mark.parametrize("with_norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("cache_dtype", [None, "float8_e4m3fn"], ids=["cache16", "cache_fp8"])
@pytest.mark.parametrize("case", list(GLUON_FUSED_ROPE_CASES))
def test_decode_fused_rope_in_the_gluon_kernel(kernels, gen, monkeypatch, case, cache_dtype, with_norm):
    _check_decode_fused_rope(kernels, gen, monkeypatch, case, "gluon", cache_dtype, with_norm)


@pytest.mark.skipif(HAS_CUDA, reason="the order programs run in is the interpreter's alone to set")
@pytest.mark.parametrize("kernel", ["tile", "fma"])
@pytest.mark.parametrize("case", list(FUSED_ROPE_CASES))
def test_decode_fused_rope_in_reverse_program_order(kernels, gen, monkeypatch, case, kernel):
    """The same, with the grid's programs run last to first: a program that reads the new key
    which another program of the launch writes (decode_fma's head pairs did, racing on a GPU)
    then reads it unwritten."""
    run_programs_in_reverse(monkeypatch)
    _check_decode_fused_rope(kernels, gen, monkeypatch, case, kernel, None, True)


def _check_decode_fused_rope(kernels, gen, monkeypatch, case, kernel, cache_dtype, with_norm):
    """test_decode_fused_rope_matches_the_separate_kernel's check, for one case."""
    from nanovllm.kernels import fused_ops, triton_ops
    monkeypatch.setattr(kernels, "DECODE_FUSED_ROPE", True)
    fma = kernel == "fma"  # triton_decode_fma for every cache, for groups of 3 too (two head pairs); else the tile
    monkeypatch.setattr(kernels, "DECODE_FMA_FP8", fma)
    monkeypatch.setattr(kernels, "DECODE_FMA_16BIT", fma)
    monkeypatch.setattr(kernels, "DECODE_FMA_MAX_GROUP", 4 if fma else kernels.DECODE_FMA_MAX_GROUP)
    monkeypatch.setattr(kernels, "DECODE_MMA_FP8", kernel == "gluon")
    monkeypatch.setattr(kernels, "DECODE_MMA_16BIT", kernel == "gluon")
    cases = {**FUSED_ROPE_CASES, **GLUON_FUSED_ROPE_CASES}
    ctx_lens, num_heads, num_kv_heads, head_dim, block_size, splits = cases[case]
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    batch = _make_batch(gen, [(c - 1, 1) for c in ctx_lens], num_heads, num_kv_heads, head_dim, block_size, dtype)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    num_seqs = len(ctx_lens)
    k = _randn(gen, num_seqs, num_kv_heads, head_dim, dtype=dtype)
    v = _randn(gen, num_seqs, num_kv_heads, head_dim, dtype=dtype)
    positions = (batch["seq_lens_k"] - 1).to(torch.int64)
    blocks = batch["block_tables"].gather(1, (positions // block_size).view(-1, 1)).view(-1).to(torch.int64)
    slots = blocks * block_size + positions % block_size
    cos_sin = _randn(gen, max(ctx_lens), head_dim, dtype=torch.float32)
    q_w = _randn(gen, head_dim, dtype=dtype) if with_norm else None
    k_w = _randn(gen, head_dim, dtype=dtype) if with_norm else None
    scales = {}
    if cache_dtype is not None:
        fp8 = getattr(torch, cache_dtype)
        batch["k_cache"], batch["v_cache"] = batch["k_cache"].to(fp8), batch["v_cache"].to(fp8)
        scales = dict(k_scale=torch.rand(num_kv_heads, generator=gen).add(0.5).to(DEVICE),
                      v_scale=torch.rand(num_kv_heads, generator=gen).add(0.5).to(DEVICE))
    q = batch.pop("q")
    args = dict(**batch, scale=head_dim ** -0.5, max_seqlen_q=1, num_splits=splits, **scales)

    def store(k_cache, v_cache):
        return fused_ops.KVStore(v, k_cache, v_cache, slots, scales.get("k_scale"), scales.get("v_scale"))
    ref_q, ref_k = q.clone(), k.clone()
    ref_caches = {"k_cache": batch["k_cache"].clone(), "v_cache": batch["v_cache"].clone()}
    triton_ops.qk_norm_rope_(ref_q, ref_k, positions, cos_sin, q_w, k_w, 1e-6, store(**ref_caches))
    expected = kernels.paged_attention(ref_q, **{**args, **ref_caches})

    assert kernels.fuses_decode_rope(q, batch["k_cache"], 1)
    if kernel == "gluon":
        assert kernels._use_decode_mma(q, batch["k_cache"], batch["v_cache"], cache_dtype is not None)
    rope = fused_ops.DecodeRope(k.clone(), positions, cos_sin, q_w, k_w, 1e-6,
                                store(batch["k_cache"], batch["v_cache"]))
    got = kernels.paged_attention(q.clone(), **args, rope=rope)
    seed = f"seed {gen.initial_seed()}"
    if not HAS_CUDA:
        for name, cache in ref_caches.items():  # NaN-poisoned slots stay NaN in both: compare as bytes
            assert torch.equal(batch[name].view(torch.uint8), cache.view(torch.uint8)), f"{name}, {seed}"
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), seed
        return
    tol = TOLERANCE[dtype]
    cache_tol = tol if cache_dtype is None else E4M3_STEP  # an fp8 value may round to its neighbour
    for name, cache in ref_caches.items():
        torch.testing.assert_close(batch[name].float(), cache.float(), atol=cache_tol, rtol=cache_tol,
                                   equal_nan=True, msg=lambda m: f"{name}: {m}\n{seed}")
    torch.testing.assert_close(got.float(), expected.float(), atol=2 * tol, rtol=2 * tol, msg=lambda m: f"{m}\n{seed}")


def test_split_of_last_key_holds_it(kernels):
    """The split the fused RoPE's store is left to is the one whose tiles (split_tile_range's share)
    hold the new key, for contexts around tile and split boundaries: under the interpreter programs
    run one after another, so a wrong split would still read the key written, and only this checks it."""
    from split_probe import splits_kernel
    block_n = 16
    for num_splits in (1, 2, 3, 5, 48):
        for kv_end in (1, 15, 16, 17, 31, 33, 100, 257):
            out = torch.zeros(2 * num_splits + 1, dtype=torch.int32, device=DEVICE)
            splits_kernel[(num_splits,)](out, kv_end, num_splits, BLOCK_N=block_n)
            spans, chosen = out[:-1].view(-1, 2).tolist(), int(out[-1])
            last_tile = (kv_end - 1) // block_n
            holders = [i for i, (begin, end) in enumerate(spans) if begin <= last_tile < end]
            assert holders == [chosen], (num_splits, kv_end, spans, chosen)


def test_fused_rope_only_where_the_decode_tile_runs(kernels, monkeypatch):
    """fuses_decode_rope: with DECODE_FUSED_ROPE (the default), for decode-only batches on the decode
    tile or triton_decode_fma, with heads of a power-of-two size; never without it."""
    q = torch.zeros(2, 4, 32, dtype=torch.float16)
    cache16 = torch.zeros(4, 16, 2, 32, dtype=torch.float16)
    monkeypatch.setattr(kernels, "DECODE_FUSED_ROPE", False)
    assert not kernels.fuses_decode_rope(q, cache16, 1)
    monkeypatch.setattr(kernels, "DECODE_FUSED_ROPE", True)
    assert kernels.fuses_decode_rope(q, cache16, 1)
    assert not kernels.fuses_decode_rope(q, cache16, 2)  # a batch with prefill tokens
    assert not kernels.fuses_decode_rope(torch.zeros(2, 4, 48, dtype=torch.float16),
                                         torch.zeros(4, 16, 2, 48, dtype=torch.float16), 1)
    if hasattr(torch, "float8_e4m3fn"):  # an fp8 cache's decodes (triton_decode_fma by default) too
        assert kernels.fuses_decode_rope(q, cache16.to(torch.float8_e4m3fn), 1)
        monkeypatch.setattr(kernels, "DECODE_FP8_QUERY_QUANT", True)  # but not the fp8 tensor-core tile
        assert not kernels.fuses_decode_rope(q, cache16.to(torch.float8_e4m3fn), 1)


# Pages of whole 64-key tiles (triton_prefill_tma.BLOCK_N): prefills, a chunk over a prefix that
# ends inside a tile, decode rows beside them, a group of 3 query heads padded to 4, pages of two
# tiles; every page's slots past its context are NaN.
TMA_CASES = {
    "mixed_bs64": ([(0, 70), (130, 9), (63, 1), (200, 1)], 4, 2, 32, 64),
    "qpk3_bs128": ([(5, 40), (0, 129)], 6, 2, 16, 128),
}


@pytest.mark.parametrize("case", list(TMA_CASES))
def test_prefill_tma_kernel(kernels, gen, case):
    """The TMA prefill kernel (called directly, so the interpreter runs it too) against the
    reference."""
    from nanovllm.kernels import triton_prefill_tma
    seqs, num_heads, num_kv_heads, head_dim, block_size = TMA_CASES[case]
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    batch = _make_batch(gen, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    expected = _reference(batch, scale)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    assert triton_prefill_tma.pages_fit(batch["q"], batch["k_cache"], batch["v_cache"])
    out = torch.full_like(batch["q"], float("nan"))
    got = triton_prefill_tma.prefill_attention(**batch, scale=scale, max_seqlen_q=max(q for _, q in seqs), out=out)
    got = got.float().cpu()
    seed = f"seed {gen.initial_seed()}"
    assert not got.isnan().any(), f"NaN in output (unwritten or unmasked), {seed}"
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype],
                               msg=lambda m: f"{m}\n{seed}")


def test_prefill_tma_takes_pages_of_whole_tiles(kernels):
    """Which caches the TMA kernel takes: pages of whole tiles, 16-bit, power-of-two heads."""
    from nanovllm.kernels import triton_prefill_tma
    q = torch.zeros(3, 4, 64, dtype=torch.float16)

    def cache(block_size, head_dim=64, dtype=torch.float16):
        return torch.zeros(2, block_size, 2, head_dim, dtype=dtype)
    assert triton_prefill_tma.pages_fit(q, cache(64), cache(64))
    assert triton_prefill_tma.pages_fit(q, cache(256), cache(256))
    assert not triton_prefill_tma.pages_fit(q, cache(16), cache(16))  # a tile would span 4 pages
    assert not triton_prefill_tma.pages_fit(q, cache(96), cache(96))
    assert not triton_prefill_tma.pages_fit(q, cache(64, dtype=torch.float32), cache(64, dtype=torch.float32))
    q80 = torch.zeros(3, 4, 80, dtype=torch.float16)
    assert not triton_prefill_tma.pages_fit(q80, cache(64, 80), cache(64, 80))
    if hasattr(torch, "float8_e4m3fn"):
        fp8 = cache(64, dtype=torch.float8_e4m3fn)
        assert not triton_prefill_tma.pages_fit(q, fp8, fp8)


def _decodes(rnd, batch: int, max_ctx: int) -> list[tuple[int, int]]:
    return [(rnd(1, max_ctx) - 1, 1) for _ in range(batch)]


# Real shapes, on a GPU only (too slow for the interpreter): the anchor model's attention
# (16 q / 8 kv heads, d128, block 16) at batch 256 and at 8k context, the other families'
# head layouts, long prefills, chunks over long cached prefixes, and mixed steps.
# name: (seqs from rnd(lo, hi), heads, kv heads, head_dim, block_size)
LARGE_CASES = {
    "decode_b1_ctx8k": (lambda rnd: [(8191, 1)], 16, 8, 128, 16),
    "decode_b7_ctx3k_qpk4": (lambda rnd: _decodes(rnd, 7, 3000), 32, 8, 128, 16),
    "decode_b256_ctx1k": (lambda rnd: [(1023, 1)] * 256, 16, 8, 128, 16),
    "decode_b64_ctx8k": (lambda rnd: _decodes(rnd, 64, 8192), 16, 8, 128, 16),
    "decode_qwen2_14q2kv_bs1": (lambda rnd: _decodes(rnd, 64, 700), 14, 2, 64, 1),
    "decode_smollm_9q3kv_bs32": (lambda rnd: _decodes(rnd, 33, 2000), 9, 3, 64, 32),
    "decode_hd80_bs256": (lambda rnd: _decodes(rnd, 16, 5000), 32, 8, 80, 256),
    "prefill_4k": (lambda rnd: [(0, 4096)], 16, 8, 128, 16),
    "prefill_8x1k": (lambda rnd: [(0, rnd(1, 1024)) for _ in range(8)], 16, 8, 128, 16),
    "chunk_512_over_7k": (lambda rnd: [(7680, 512)], 16, 8, 128, 16),
    "chunks_hd64_bs128": (lambda rnd: [(rnd(1, 3000), rnd(1, 600)) for _ in range(6)], 32, 8, 64, 128),
    "mixed_hd96_bs32": (lambda rnd: [(0, 300), (rnd(1, 3000), 77), (rnd(1, 500), 1000)]
                        + _decodes(rnd, 100, 4000), 12, 4, 96, 32),
}


@pytest.mark.skipif(not HAS_CUDA, reason="real shapes: too slow for the interpreter")
@pytest.mark.parametrize("num_splits", [None, 5], ids=["own-splits", "splits5"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(LARGE_CASES))
def test_paged_attention_real_shapes(poisoned_kernels, gen, case, dtype, num_splits):
    make_seqs, num_heads, num_kv_heads, head_dim, block_size = LARGE_CASES[case]
    seqs = make_seqs(lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    batch = _make_batch(gen, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype)
    _check_paged_attention(poisoned_kernels, gen, batch, dtype, head_dim ** -0.5, num_splits=num_splits,
                           max_seqlen_q=max(q for _, q in seqs), max_seqlen_k=max(c + q for c, q in seqs))


def test_paged_attention_allocates_output(kernels, gen):
    batch = _make_batch(gen, [(5, 3), (9, 1)], 2, 1, 32, 4, torch.float32)
    expected = _reference(batch, 0.25)
    got = kernels.paged_attention(**{k: v.to(DEVICE) for k, v in batch.items()}, scale=0.25)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_rejects_heads_not_multiple_of_kv_heads(kernels, gen):
    batch = _make_batch(gen, [(0, 2)], 3, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kernels.paged_attention(**{k: v.to(DEVICE) for k, v in batch.items()}, scale=1.0)


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_decode_cuda_graph_replays_new_lengths(kernels, gen):
    """Captured once, replayed on other context lengths: no host sync, fixed grid."""
    seqs = [(300, 1), (17, 1), (1000, 1), (0, 1)]
    batch = _make_batch(gen, seqs, 8, 2, 128, 16, torch.bfloat16)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    kwargs = dict(scale=0.1, max_seqlen_q=1, num_splits=4)
    out = kernels.paged_attention(**batch, **kwargs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.paged_attention(**batch, **kwargs)
    batch["seq_lens_k"].copy_(torch.tensor([5, 18, 700, 1], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = _reference(batch, kwargs["scale"])
    torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2, rtol=3e-2)


def test_prefill_batches_take_their_own_split_target(kernels, gen, monkeypatch):
    """PREFILL_TARGET_PROGRAMS_PER_SM reaches the split policy for batches of more than one query
    tile a sequence, and only for them: decode-only batches, and short prefills whose queries fit
    one tile, keep TARGET_PROGRAMS_PER_SM."""
    seen = []
    choose = kernels._choose_num_splits

    def recording(programs, max_seqlen_k, device, programs_per_sm=None, max_splits=None):
        seen.append(programs_per_sm)
        return choose(programs, max_seqlen_k, device, programs_per_sm, max_splits)
    monkeypatch.setattr(kernels, "_choose_num_splits", recording)
    monkeypatch.setattr(kernels, "PREFILL_TARGET_PROGRAMS_PER_SM", 3)
    block_q = kernels._tile_config(2, 2, on_gpu=HAS_CUDA)["BLOCK_Q"]  # query tokens a prefill tile holds
    long_prefill = _make_batch(gen, [(20, block_q + 3)], 2, 1, 16, 4, torch.float32)
    short_prefill = _make_batch(gen, [(20, 5), (30, 1)], 2, 1, 16, 4, torch.float32)  # beside a decode
    decode = _make_batch(gen, [(20, 1)], 2, 1, 16, 4, torch.float32)
    for batch in (long_prefill, short_prefill, decode):
        expected = _reference(batch, 0.25)
        got = kernels.paged_attention(**{k: v.to(DEVICE) for k, v in batch.items()}, scale=0.25)
        torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    assert seen == [3, None, None]


def test_query_tiles_outer_grid_gives_the_same_bits(kernels, gen, monkeypatch):
    """QUERY_TILES_OUTER only reorders the unified kernel's programs: prefills of several query
    tiles, over a prefix, beside a decode, split or not, give the same output bits as the
    default grid; query tiles beyond the grid's second axis keep the first."""
    batch = _make_batch(gen, [(0, 45), (23, 30), (40, 1)], 4, 2, 16, 4, torch.float32)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    for splits in (1, 3):
        expected = kernels.paged_attention(**batch, scale=0.25, num_splits=splits)
        monkeypatch.setattr(kernels, "QUERY_TILES_OUTER", True)
        got = kernels.paged_attention(**batch, scale=0.25, num_splits=splits)
        monkeypatch.setattr(kernels, "QUERY_TILES_OUTER", False)
        assert torch.equal(got, expected), splits
    monkeypatch.setattr(kernels, "QUERY_TILES_OUTER", True)
    assert kernels._attention_grid(64, 8, 1) == ((8, 64, 1), True)
    assert kernels._attention_grid(kernels.MAX_GRID_YZ + 1, 8, 1) == ((kernels.MAX_GRID_YZ + 1, 8, 1), False)
    monkeypatch.setattr(kernels, "QUERY_TILES_OUTER", False)
    assert kernels._attention_grid(64, 8, 1) == ((64, 8, 1), False)


def test_split_policy_caps_each_decode_kernel(monkeypatch):
    """On an H200-sized GPU (132 multiprocessors): one 32k-token sequence of 8 KV heads splits into
    MAX_SPLITS (one wave of the tensor-core tile), the CUDA-core kernel into its own cap; a short
    context splits no finer than MIN_KEYS_PER_SPLIT; a full batch does not split."""
    pytest.importorskip("triton")
    from nanovllm.kernels import triton_attn as ta
    monkeypatch.setattr(ta, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    assert ta._choose_num_splits(8, 40960, cpu) == ta.MAX_SPLITS == 48
    fma = ta._choose_num_splits(8, 40960, cpu, ta.DECODE_FMA_PROGRAMS_PER_SM, ta.DECODE_FMA_MAX_SPLITS)
    assert fma == ta.DECODE_FMA_MAX_SPLITS == 32
    assert ta._choose_num_splits(8, 4096, cpu) == 4096 // ta.MIN_KEYS_PER_SPLIT
    assert ta._choose_num_splits(256 * 8, 40960, cpu) == 1
