"""kernels/cpu_small_ops.py (RMSNorm, RoPE + K/V store, SiLU-and-mul in C++) against the torch code
it replaces (kernels/fused_ops.py), and the engine with and without it. Skipped where no C++
compiler is found (the engine then runs the torch code)."""
import pytest
import torch

from nanovllm.kernels import cpu_attn, cpu_small_ops, fused_ops, torch_ref
from nanovllm.layers.attention import Attention
from nanovllm.utils import cpp_compiler

needs_compiler = pytest.mark.skipif(not cpp_compiler.cpp_compiler_found(), reason="no C++ compiler found")
pytestmark = needs_compiler

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2's attention
BLOCK_SIZE = 16


def _steps(x: torch.Tensor, n: int = 2) -> torch.Tensor:
    """n steps of x's dtype at x's magnitude: the RMSNorm's sum of squares, summed in another order,
    can move the normalized value by a step, and the product by the weight (up to 1.5 here) rounds
    again."""
    return n * torch.finfo(x.dtype).eps * x.float().abs().clamp_min(torch.finfo(x.dtype).tiny)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (64, 576), (300, 960), (7, 100)])
def test_rms_norm_with_and_without_residual(dtype, rows, hidden):
    """The sum x + residual bit for bit; the norm within two steps of the dtype of the torch code's
    (where the mean's fp32 sum rounds the other way), almost always equal."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    out, summed = cpu_small_ops.rms_norm(x, weight, 1e-5, residual)
    ref_sum = x + residual
    ref = fused_ops._rms_norm_torch(ref_sum, weight, 1e-5)
    assert torch.equal(summed, ref_sum)
    assert ((out.float() - ref.float()).abs() <= _steps(ref)).all()
    assert (out != ref).float().mean() < 1e-3
    alone = cpu_small_ops.rms_norm(x, weight, 1e-5)
    assert ((alone.float() - fused_ops._rms_norm_torch(x, weight, 1e-5).float()).abs()
            <= _steps(alone)).all()


def test_fp32_rms_norm_stays_torchs():
    """fp32 keeps torch's fused F.rms_norm (the reference's values exactly): fused_ops does not call the C++."""
    x, weight = torch.randn(4, 576), torch.rand(576)
    assert torch.equal(fused_ops.rms_norm(x, weight, 1e-6), torch.nn.functional.rms_norm(x, (576,), weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64, 257])
def test_silu_and_mul_equals_torch(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(dtype)
    gate, up = x.chunk(2, -1)
    assert torch.equal(cpu_small_ops.silu_and_mul(x), torch.nn.functional.silu(gate) * up)


def _qkv(rows: int, dtype: torch.dtype, seed: int):
    """A qkv product's output [rows, (heads + 2 kv_heads) d] and its q, k, v views, as DecoderAttention splits it."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    return qkv, q.view(rows, HEADS, HEAD_DIM), k.view(rows, KV_HEADS, HEAD_DIM), v.view(rows, KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["heads_major", "interleaved"])
@pytest.mark.parametrize("rows", [1, 70])
def test_rope_store_equals_rotation_then_store(dtype, layout, rows):
    """q and k rotated in place and k, v written at their slots: the same bits as fused_ops' rotation
    followed by torch_ref's store, on the engine's cache layout and the interleaved one; slot -1 is
    not written. One row (a one-sequence decode step) too, whose views report unequal row strides."""
    num_blocks = 12
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = []
    for _ in range(2):
        if layout == "heads_major":
            k_cache, v_cache = cpu_attn.new_kv_cache(shape, dtype, torch.device("cpu"))
        else:
            k_cache, v_cache = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        k_cache.fill_(7), v_cache.fill_(7)
        caches.append((k_cache, v_cache))
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 4000, (rows,), generator=gen)
    cos_sin = torch.randn(4096, HEAD_DIM, generator=gen)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:rows]
    slots[1::33] = -1
    qkv, q, k, v = _qkv(rows, dtype, seed=4)
    if rows == 1:  # a size-1 dimension's stride: the views share one row but say otherwise
        assert q.stride(0) != k.stride(0)
    _, q_ref, k_ref, v_ref = (t.clone() for t in _qkv(rows, dtype, seed=4))
    assert cpu_small_ops.rope_store_applies(q, k, v, caches[0][0])
    cpu_small_ops.rope_store(q, k, v, positions, cos_sin, *caches[0], slots)
    q_ref, k_ref = fused_ops._rotate(torch.cat([q_ref, k_ref], 1), *fused_ops._cos_sin(positions, cos_sin)) \
        .split([HEADS, KV_HEADS], 1)
    torch_ref.store_kvcache(k_ref, v_ref, *caches[1], slots)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_what_the_cpp_does_not_take_falls_back():
    """Shapes and dtypes the C++ is not for: None / False, and the callers run their torch code."""
    x = torch.randn(8, 576, dtype=torch.bfloat16)
    assert cpu_small_ops.rms_norm(x.t(), torch.ones(8, dtype=torch.bfloat16), 1e-6) is None  # not contiguous
    assert cpu_small_ops.rms_norm(x, torch.ones(576), 1e-6) is None  # fp32 weight, bf16 x
    assert cpu_small_ops.silu_and_mul(x[:, :575]) is None
    assert cpu_small_ops.rms_norm(x.double(), torch.ones(576, dtype=torch.double), 1e-6) is None
    qkv = torch.randn(4, (HEADS + 2 * KV_HEADS) * 40)  # head_dim 40: not built
    q, k, v = qkv.split([HEADS * 40, KV_HEADS * 40, KV_HEADS * 40], -1)
    cache = torch.empty(4, BLOCK_SIZE, KV_HEADS, 40)
    assert not cpu_small_ops.rope_store_applies(q.view(4, HEADS, 40), k.view(4, KV_HEADS, 40),
                                                v.view(4, KV_HEADS, 40), cache)
    _, q, k, v = _qkv(4, torch.float32, seed=0)
    assert not cpu_small_ops.rope_store_applies(q.clone(), k, v, torch.empty(4, BLOCK_SIZE, KV_HEADS, HEAD_DIM))
    assert not cpu_small_ops.rope_store_applies(q, k, v, torch.empty(4, BLOCK_SIZE, KV_HEADS, HEAD_DIM,
                                                                      dtype=torch.float8_e4m3fn))


def test_attention_asks_for_the_store_on_the_cpu():
    """Attention.kv_store: a KVStore on the CPU where the C++ is built and the cache has v's dtype;
    None for an fp8 cache, while scales are calibrated, and without a cache."""
    attn = Attention(HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS)
    v = torch.randn(2, KV_HEADS, HEAD_DIM)
    assert attn.kv_store(v) is None  # no cache attached yet
    attn.k_cache, attn.v_cache = cpu_attn.new_kv_cache((4, BLOCK_SIZE, KV_HEADS, HEAD_DIM), torch.float32,
                                                       torch.device("cpu"))
    from nanovllm.utils.context import Context, set_context
    one = torch.zeros(1, dtype=torch.int32)
    context = Context(slot_mapping=torch.tensor([0, 1]), cu_seqlens_q=one, seq_lens_k=one, block_tables=one[None],
                      max_seqlen_q=1, max_seqlen_k=1)
    with set_context(context):
        store = attn.kv_store(v)
        assert store is not None and store.k_cache is attn.k_cache
        attn.kv_amax = torch.zeros(2, KV_HEADS)
        assert attn.kv_store(v) is None
        attn.kv_amax = None
        attn.k_cache = attn.k_cache.to(torch.float8_e4m3fn)
        assert attn.kv_store(v) is None


def _generate(llm, prompts, tokens):
    from nanovllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,",
           "The best way to learn", "import torch\n", "Water boils at", "My favourite colour is"]


def _without_cpp(monkeypatch):
    monkeypatch.setattr(cpu_small_ops, "_runs_here", lambda x: False)
    monkeypatch.setattr(cpu_small_ops, "rope_store_built", lambda dtype, head_dim: False)


def test_engine_greedy_ids_equal_the_torch_code_in_fp32(monkeypatch):
    """The embedded SmolLM2 in fp32, 8 prompts of 24 greedy tokens: the same ids with the C++ small
    ops (RoPE + store and SiLU-and-mul: the same bits; fp32 RMSNorm stays torch's) as without."""
    from nanovllm import LLM
    calls = []
    silu = cpu_small_ops.silu_and_mul
    monkeypatch.setattr(cpu_small_ops, "silu_and_mul", lambda x: calls.append(1) or silu(x))
    with LLM(dtype="float32") as llm:
        with_cpp = _generate(llm, PROMPTS, 24)
        assert calls  # the C++ ran
        _without_cpp(monkeypatch)
        without = _generate(llm, PROMPTS, 24)
    assert with_cpp == without


def test_engine_bf16_with_the_cpp(monkeypatch):
    """bf16 (the default where the CPU multiplies bf16 fast; here forced): the C++ RMSNorm, RoPE +
    store and SiLU run in the engine's steps, and the Paris answer comes out."""
    from nanovllm import LLM
    calls = {"rms_norm": 0, "rope_store": 0}
    for name in calls:
        fn = getattr(cpu_small_ops, name)
        monkeypatch.setattr(cpu_small_ops, name, lambda *a, _fn=fn, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1)
                            or _fn(*a, **k))
    with LLM(dtype="bfloat16") as llm:
        (ids,) = _generate(llm, ["The capital of France is"], 6)
        text = llm.get_tokenizer().decode(ids)
    assert calls["rms_norm"] > 0 and calls["rope_store"] > 0
    assert "Paris" in text
