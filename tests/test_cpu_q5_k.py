"""GGUF Q5_K weights kept quantized on the CPU by the Q8_0 kernel with offsets (kernels/cpu_q8_0.py:
int8 values 0..31, one fp32 scale and one fp32 offset per 32 values; layers/quantization/gguf.py).

- Values, scales and offsets read from any valid Q5_K blocks give back `gguf.quants.dequantize`'s
  values (and the loader's, utils/dequant.py) exactly.
- The kernel's fp32 product equals `x.float() @ dequantize(W).T` within an fp32 summation-order bound;
  its bf16 output is its fp32 output of the same x rounded once.
- A tiny GGUF model written in Q5_K: its linear layers, embedding and LM head keep the values and
  offsets; batches up to the measured crossover run the kernel and larger ones the dense product; its
  greedy ids equal the dequantized path's exactly in fp32 (the AVX2 kind, emulated: ATEN_CPU_CAPABILITY
  =avx2), and in bf16 part from them only at a near-tie.
"""
import math

import numpy as np
import pytest
import torch

from nanovllm.kernels import cpu_q8_0
from nanovllm.utils import dequant, device

gguf = pytest.importorskip("gguf")

if not cpu_q8_0.built_for(torch.float32, "Q5_K"):
    pytest.skip("the Q8_0 kernel cannot be built here (no C++ compiler)", allow_module_level=True)

# ggml-common.h's block_q5_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, qh[32], qs[128]
QK_K = dequant.QK_K                  # values per super-block
SUB_BLOCKS = 8                       # sub-blocks of 32 values, each with a 6-bit scale and min
SUB_BLOCK = QK_K // SUB_BLOCKS
BLOCK_BYTES = 176
D, DMIN, SCALES, QH, QS = slice(0, 2), slice(2, 4), slice(4, 16), slice(16, 48), slice(48, 176)
Q5_MAX = 31                          # the largest 5-bit value
SIX_BIT_MAX = 63                     # the largest 6-bit scale or min
F16_SIZE = 1e-3                      # the size of the random blocks' d and dmin
FP32_EPS = 2.0 ** -24                # unit roundoff of fp32
# The products' largest error against the largest output, allowed: measured 5.2e-7 over the shapes and
# row counts of test_products_match_dequantized (the bound of `_bound` is far looser: 8.5e-4 of it)
PRODUCT_RTOL = 1e-5
NEW_TOKENS = 12
TOP_K_CLOSE = 5


def random_q5_k_blocks(rows: int, blocks: int, seed: int = 0) -> torch.Tensor:
    """[rows, blocks * 176] uint8: random bytes (any bytes are valid scales, mins and values) with d
    and dmin set to small positive fp16 values."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, blocks, BLOCK_BYTES), generator=gen, dtype=torch.uint8)
    raw[..., :4] = (torch.rand(rows, blocks, 2, generator=gen) * F16_SIZE).half().view(torch.uint8)  # d, dmin
    return raw.view(rows, -1)


def _pack_scales_mins(sc: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [blocks, 8] -> the 12 bytes of their block_q5_K packing [blocks, 12]
    (the inverse of utils/dequant._k_scale_min)."""
    low = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mins[:, :4] | ((mins[:, 4:] >> 4) << 6)], -1)
    return np.concatenate([low, (sc[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)], -1).astype(np.uint8)


def q5_k_blocks(w: np.ndarray) -> np.ndarray:
    """w [rows, cols] (cols a multiple of 256) as Q5_K blocks [rows, cols / 256 * 176] uint8: each
    sub-block's range [min(w, 0), max(w)] in 31 steps, its step and -min as 6-bit multiples of the
    super-block's fp16 d and dmin (a plain round-to-nearest quantizer, not llama.cpp's search)."""
    rows = w.shape[0]
    g = w.astype(np.float32).reshape(-1, SUB_BLOCKS, SUB_BLOCK)                     # [blocks, 8, 32]
    low = np.minimum(g.min(-1), 0)                                                  # [blocks, 8]
    step = (g.max(-1) - low) / Q5_MAX
    tiny = np.finfo(np.float32).tiny
    d = (step.max(-1, keepdims=True) / SIX_BIT_MAX).astype(np.float16)              # [blocks, 1]
    dmin = (-low.min(-1, keepdims=True) / SIX_BIT_MAX).astype(np.float16)
    sc = np.clip(np.round(step / np.maximum(d.astype(np.float32), tiny)), 0, SIX_BIT_MAX).astype(np.uint8)
    mins = np.clip(np.round(-low / np.maximum(dmin.astype(np.float32), tiny)), 0, SIX_BIT_MAX).astype(np.uint8)
    scale = np.maximum(d.astype(np.float32) * sc, tiny)[..., None]                  # [blocks, 8, 1]
    offset = (dmin.astype(np.float32) * mins)[..., None]
    q = np.clip(np.round((g + offset) / scale), 0, Q5_MAX).astype(np.uint8)         # [blocks, 8, 32]
    nibbles = (q & 0x0F).reshape(-1, 4, 2, SUB_BLOCK)                               # sub-blocks 2j, 2j+1
    qs = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(-1, 128)
    qh = ((q >> 4) << np.arange(SUB_BLOCKS, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8)  # [blocks, 32]
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), _pack_scales_mins(sc, mins), qh, qs], -1)
    return blocks.reshape(rows, -1)


def _reference(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K).copy())


def test_random_blocks_read_exactly():
    raw = random_q5_k_blocks(7, 3)
    weight = cpu_q8_0.from_gguf(raw, "Q5_K")
    assert weight.values.shape == (7, 3 * QK_K) and weight.values.dtype == torch.int8
    assert weight.scales.shape == weight.offsets.shape == (7, 3 * SUB_BLOCKS)
    assert weight.values.min() >= 0 and weight.values.max() == Q5_MAX and weight.block == SUB_BLOCK
    assert torch.equal(weight.dequantize(), _reference(raw.numpy()))
    assert torch.equal(weight.dequantize(), dequant.dequantize(raw.flatten(), "Q5_K", (7, 3 * QK_K)))
    assert weight.nbytes == 7 * 3 * QK_K * (1 + 2 * 4 / SUB_BLOCK)  # 1.25 bytes a weight


def test_written_blocks_hold_their_weight():
    """The test's own writer (the tiny model's Q5_K file): gguf reads back what it was given."""
    w = np.random.default_rng(0).standard_normal((9, 512)).astype(np.float32) * 0.05
    back = _reference(q5_k_blocks(w))
    assert (back - torch.from_numpy(w)).abs().max() < np.abs(w).max() / Q5_MAX


def test_rows_and_padding_keep_offsets():
    weight = cpu_q8_0.from_gguf(random_q5_k_blocks(6, 2), "Q5_K")
    part = weight.rows(2, 3).padded(5)
    assert torch.equal(part.dequantize()[:3], weight.dequantize()[2:5])
    assert torch.equal(part.dequantize()[3:], torch.zeros(2, 2 * QK_K))


def test_row_parallel_gather_takes_this_ranks_columns():
    """GGUFLinearMethod's gather of Q5_K parts for rank 1 of 2 of a row-parallel layer: values, scales and
    offsets each take the second half of the columns (a super-block each here)."""
    import types
    from nanovllm.layers.quantization.gguf import GGUFConfig, GGUFLinearMethod
    weight = cpu_q8_0.from_gguf(random_q5_k_blocks(8, 2), "Q5_K")
    layer = types.SimpleNamespace(weight=torch.empty(8, QK_K), tp_rank=1)
    source = torch.stack([torch.zeros(8), torch.arange(8)], 1).long()         # [out, (part, row)]
    values, scales, offsets = GGUFLinearMethod(GGUFConfig())._gather(layer, source, [weight.tensors()], SUB_BLOCK)
    half = SUB_BLOCKS                                                          # sub-blocks in the first half
    assert torch.equal(values, weight.values[:, QK_K:]) and torch.equal(scales, weight.scales[:, half:])
    assert torch.equal(offsets, weight.offsets[:, half:])


def _bound(x: torch.Tensor, weight: cpu_q8_0.Q8Weight) -> torch.Tensor:
    """An fp32 bound on the kernel's error against the exact product [m, n]: its k products q * scale *
    x and k / 32 products offset * (a block's sum of x), added in any order, each term within
    2 k eps of its size (the rounding of dequantize's q * scale + offset adds half an ulp a weight)."""
    k = x.shape[1]
    terms = (weight.values.double() * weight.scales.double().repeat_interleave(SUB_BLOCK, 1)).abs() \
        + weight.offsets.double().abs().repeat_interleave(SUB_BLOCK, 1)               # [n, k]
    return 2 * k * FP32_EPS * (x.double().abs() @ terms.T)


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 17])
@pytest.mark.parametrize("n, blocks", [(1, 1), (7, 2), (130, 3), (64, 6), (33, 9)])
def test_products_match_dequantized(m, n, blocks):
    """Shapes whose offsets fill whole vectors and leave partial ones (8, 16, 24, 48, 72 blocks of 32)."""
    raw = random_q5_k_blocks(n, blocks, seed=m * n)
    weight = cpu_q8_0.from_gguf(raw, "Q5_K")
    x = torch.randn(m, blocks * QK_K, generator=torch.Generator().manual_seed(blocks))
    expected = x.double() @ _reference(raw.numpy()).double().T                      # [m, n]
    got = cpu_q8_0.q8_0_linear(x, weight)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got.double() - expected).abs() <= _bound(x, weight)).all()
    assert (got.double() - expected).abs().max() <= PRODUCT_RTOL * expected.abs().max()
    xb = x.bfloat16()
    assert torch.equal(cpu_q8_0.q8_0_linear(xb, weight), cpu_q8_0.q8_0_linear(xb.float(), weight).bfloat16())


def test_offsets_are_not_ignored():
    """The same values and scales without the offsets give another product."""
    weight = cpu_q8_0.from_gguf(random_q5_k_blocks(16, 2), "Q5_K")
    x = torch.randn(3, 2 * QK_K)
    plain = cpu_q8_0.Q8Weight(weight.values, weight.scales)
    assert (cpu_q8_0.q8_0_linear(x, weight) - cpu_q8_0.q8_0_linear(x, plain)).abs().max() > 1e-3


def test_a_malformed_row_is_a_value_error():
    with pytest.raises(ValueError, match="Q5_K rows"):
        cpu_q8_0.from_gguf(torch.zeros(2, 100, dtype=torch.uint8), "Q5_K")


# ---- a tiny GGUF model written in Q5_K ----------------------------------------------------

def write_q5_k_gguf(hf_model, path: str) -> None:
    """`hf_model` (a tiny_models Qwen3, every input size a multiple of 256) as a GGUF file at `path`
    with every 2-D tensor Q5_K, by `q5_k_blocks` (gguf cannot write K-quants itself); also used by
    benchmarks/bench_cpu_q5_k_model.py."""
    import test_gguf
    quantize = gguf.quants.quantize
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_gguf, "WRITE_TYPES", ("Q5_K",))  # every 2-D tensor Q5_K
        patch.setattr(gguf.quants, "quantize", lambda data, qtype: (
            q5_k_blocks(data) if qtype == gguf.GGMLQuantizationType.Q5_K else quantize(data, qtype)))
        test_gguf.write_tiny_gguf(hf_model, "qwen3", path, quantize=True)


@pytest.fixture(scope="module")
def q5_k_gguf(tmp_path_factory):
    from tiny_models import build_tiny_model
    d = tmp_path_factory.mktemp("tiny-Q5_K")
    # Q5_K rows are whole super-blocks: every input size a multiple of 256
    hf = build_tiny_model("qwen3", str(d / "hf"), rope_scaling=None, hidden_size=256, intermediate_size=512,
                          head_dim=64)
    path = str(d / "tiny-Q5_K.gguf")
    write_q5_k_gguf(hf, path)
    return path


def _llm(path: str, **options):
    from nanovllm import LLM
    return LLM(path, skip_tokenizer_init=True, num_kvcache_blocks=64, **options)


def _layers(model):
    from nanovllm.layers.linear import LinearBase
    return [m for m in model.modules() if isinstance(m, LinearBase)]


def _kept_q5_k(model) -> bool:
    layers = _layers(model)
    kept = [m.quant_method.q8 for m in layers] + [model.model.embed_tokens.q8_weight, model.lm_head.q8_weight]
    return bool(layers) and all(w is not None and w.block == SUB_BLOCK and w.offsets is not None for w in kept)


def test_model_keeps_values_and_offsets(q5_k_gguf):
    from nanovllm.layers.quantization import gguf as gguf_method
    from nanovllm.utils.device import cpu_kind
    model = _llm(q5_k_gguf, dtype="bfloat16").llm_engine.model_runner.model
    assert _kept_q5_k(model)
    assert all(m.quant_method.q8_max_rows == gguf_method.MAX_Q5_K_ROWS[cpu_kind()] for m in _layers(model))
    dense = _llm(q5_k_gguf, dtype="bfloat16", quantization="gguf_dequant").llm_engine.model_runner.model
    assert all(not hasattr(m.quant_method, "q8") for m in _layers(dense)) and dense.lm_head.q8_weight is None


def _greedy(llm, prompts, params):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _prompts():
    from tiny_models import random_prompts
    return [{"prompt_token_ids": p} for p in random_prompts([5, 17, 33])]


def test_greedy_ids_match_dequantized_bf16(q5_k_gguf, monkeypatch):
    """Every product by the kernel (crossovers raised), bf16 activations: the dense bf16 weight rounds the
    values the kernel multiplies by exactly, so a near-tie may part them (both rank the other's token top-5)."""
    from nanovllm import SamplingParams
    from nanovllm.layers.quantization import gguf as gguf_method
    monkeypatch.setattr(gguf_method, "MAX_Q5_K_ROWS", dict.fromkeys(gguf_method.MAX_Q5_K_ROWS, math.inf))
    calls = []
    real = cpu_q8_0.q8_0_linear
    monkeypatch.setattr(cpu_q8_0, "q8_0_linear", lambda x, w: calls.append(x.dtype) or real(x, w))
    kept, dense = _llm(q5_k_gguf, dtype="bfloat16"), _llm(q5_k_gguf, dtype="bfloat16", quantization="gguf_dequant")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP_K_CLOSE)
    outs = [llm.generate(_prompts(), params, use_tqdm=False) for llm in (kept, dense)]
    assert calls and set(calls) == {torch.bfloat16}  # the kept engine's products ran the kernel
    for a, b in zip(*outs):
        ours, ref = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        if ours != ref:
            i = next(i for i, (x, y) in enumerate(zip(ours, ref)) if x != y)
            assert ref[i] in a.outputs[0].logprobs[i] and ours[i] in b.outputs[0].logprobs[i], (i, ours, ref)


def test_greedy_ids_equal_dequantized_fp32_on_avx2(q5_k_gguf, avx2_only, monkeypatch):
    """The AVX2 kind runs fp32: the kernel's products differ from the dense fp32 product by summation order
    only (~1e-7 relative), far below the tiny model's gaps between its top logits, so the ids are equal."""
    from nanovllm import SamplingParams
    from nanovllm.layers.quantization import gguf as gguf_method
    assert device.cpu_kind() == "avx2"
    calls = []
    real = cpu_q8_0.q8_0_linear
    monkeypatch.setattr(cpu_q8_0, "q8_0_linear", lambda x, w: calls.append(x.dtype) or real(x, w))
    monkeypatch.setattr(gguf_method, "MAX_Q5_K_ROWS", dict.fromkeys(gguf_method.MAX_Q5_K_ROWS, math.inf))
    kept = _llm(q5_k_gguf)
    assert _kept_q5_k(kept.llm_engine.model_runner.model)
    dense = _llm(q5_k_gguf, quantization="gguf_dequant")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = _greedy(kept, _prompts(), params)
    assert calls and set(calls) == {torch.float32}
    assert ours == _greedy(dense, _prompts(), params)


def test_layer_rows_choose_the_kernel_up_to_its_crossover(q5_k_gguf, monkeypatch):
    from nanovllm.layers.quantization import gguf as gguf_method
    from nanovllm.utils.device import cpu_kind
    model = _llm(q5_k_gguf, dtype="bfloat16").llm_engine.model_runner.model
    layer, head = _layers(model)[0], model.lm_head
    calls = []
    real = cpu_q8_0.q8_0_linear
    monkeypatch.setattr(cpu_q8_0, "q8_0_linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    kind = cpu_kind()
    for module, most in ((layer, gguf_method.MAX_Q5_K_ROWS[kind]), (head, gguf_method.MAX_Q5_K_HEAD_ROWS[kind])):
        for rows in (1, most, most + 1):
            calls.clear()
            y = module(torch.randn(rows, layer.input_size).bfloat16())  # (both take the hidden size)
            assert calls == ([rows] if rows <= most else []) and y.shape[0] == rows
