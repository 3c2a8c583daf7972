"""GGUF Q8_0 weights kept quantized on the CPU (kernels/cpu_q8_0.py, layers/quantization/gguf.py,
layers/embed_head.py).

- The blocks rearranged at load give back `gguf.quants.dequantize`'s values exactly, and the
  kernel's product equals `x.float() @ dequantize(W).T` within fp32 summation-order error (fp32
  activations), or that product rounded once to bf16 (bf16 activations); shards of the rows and
  of the columns (tensor parallel) take the matching slices.
- A tiny GGUF model written all in Q8_0 (a tied and an untied family): its linear layers, LM head
  and embedding keep the blocks, the dense weights are dropped, batches up to the measured
  crossover run the kernel and larger ones the dense product, and its greedy ids equal the
  dequantized path's or part only at a near-tie; dtype="float32" and quantization="gguf_dequant"
  keep every weight dense.
"""
import types

import numpy as np
import pytest
import torch

from nanovllm.kernels import cpu_q8_0

gguf = pytest.importorskip("gguf")

if not cpu_q8_0.built(torch.float32):
    pytest.skip("the Q8_0 kernel cannot be built here (no C++ compiler)", allow_module_level=True)

FP32_EPS = 2.0 ** -24  # unit roundoff of fp32
BF16_EPS = 2.0 ** -8   # unit roundoff of bf16
NEW_TOKENS = 24
TOP_K_CLOSE = 5


def _q8_0_raw(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Q8_0 blocks [rows, cols / 32 * 34] of a random weight, as llama.cpp's quantizer writes them."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)


def _reference(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).copy())  # [rows, cols]


def test_blocks_give_gguf_values_exactly():
    raw = _q8_0_raw(5, 96)
    weight = cpu_q8_0.from_gguf_blocks(torch.from_numpy(raw.copy()))
    assert weight.values.shape == (5, 96) and weight.scales.shape == (5, 3)
    assert torch.equal(weight.dequantize(), _reference(raw))


@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 17])
@pytest.mark.parametrize("n, k", [(1, 32), (7, 96), (130, 576), (64, 1536)])
def test_fp32_product_matches_dequantized(m, n, k):
    raw = _q8_0_raw(n, k, seed=m * n)
    w = _reference(raw)                                                        # [n, k]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    y = cpu_q8_0.q8_0_linear(x, cpu_q8_0.from_gguf_blocks(torch.from_numpy(raw.copy())))
    ref = (x.double() @ w.double().T)                                          # [m, n]
    bound = 2 * k * FP32_EPS * (x.abs().double() @ w.abs().double().T)        # summation error of any order
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("m", [1, 3, 16])
def test_bf16_product_is_the_fp32_product_rounded(m):
    n, k = 96, 576
    raw = _q8_0_raw(n, k)
    w = _reference(raw)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = cpu_q8_0.q8_0_linear(x, cpu_q8_0.from_gguf_blocks(torch.from_numpy(raw.copy())))
    ref = x.double() @ w.double().T
    bound = BF16_EPS * ref.abs() + 2 * k * FP32_EPS * (x.abs().double() @ w.abs().double().T)
    assert y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs() <= bound).all()


def test_row_shard_and_padding_take_the_matching_outputs():
    """A vocabulary shard (rows [start, start + size), zero rows after): the full product's
    columns, then zeros."""
    raw = _q8_0_raw(50, 64)
    full = cpu_q8_0.from_gguf_blocks(torch.from_numpy(raw.copy()))
    x = torch.randn(3, 64)
    shard = full.rows(40, 10).padded(16)
    y = cpu_q8_0.q8_0_linear(x, shard)
    assert torch.allclose(y[:, :10], cpu_q8_0.q8_0_linear(x, full)[:, 40:], rtol=0, atol=1e-6)
    assert torch.equal(y[:, 10:], torch.zeros(3, 6))


def test_row_parallel_gather_takes_this_ranks_columns():
    """GGUFLinearMethod's gather of Q8_0 parts for rank 1 of 2 of a row-parallel layer."""
    from nanovllm.layers.quantization.gguf import GGUFConfig, GGUFLinearMethod
    raw = _q8_0_raw(8, 128)
    blocks = cpu_q8_0.from_gguf_blocks(torch.from_numpy(raw.copy()))
    method = GGUFLinearMethod(GGUFConfig())
    layer = types.SimpleNamespace(weight=torch.empty(8, 64), tp_rank=1)
    source = torch.stack([torch.zeros(8), torch.arange(8)], 1).long()         # [out, (part, row)]
    values, scales = method._gather(layer, source, [(blocks.values, blocks.scales)], cpu_q8_0.BLOCK)
    assert torch.equal(values, blocks.values[:, 64:]) and torch.equal(scales, blocks.scales[:, 2:])


def test_bad_input_size_is_a_value_error():
    weight = cpu_q8_0.from_gguf_blocks(torch.from_numpy(_q8_0_raw(4, 64).copy()))
    with pytest.raises(ValueError, match="features"):
        cpu_q8_0.q8_0_linear(torch.randn(1, 32), weight)


# ---- a tiny GGUF model written all in Q8_0 -----------------------------------------------

@pytest.fixture(scope="module", params=["qwen3", "llama"])  # tied embeddings; untied (a Q8_0 output.weight)
def q8_gguf(request, tmp_path_factory):
    import test_gguf
    from tiny_models import build_tiny_model
    d = tmp_path_factory.mktemp(f"q8-{request.param}")
    hf = build_tiny_model(request.param, str(d / "hf"), rope_scaling=None)
    path = str(d / "tiny-q8_0.gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_gguf, "WRITE_TYPES", ("Q8_0",))  # every 2-D tensor Q8_0
        test_gguf.write_tiny_gguf(hf, request.param, path, quantize=True)
    return path


def _llm(path: str, **options):
    from nanovllm import LLM
    return LLM(path, skip_tokenizer_init=True, num_kvcache_blocks=64, **options)


def _model(llm):
    return llm.llm_engine.model_runner.model


def test_q8_0_model_keeps_blocks_and_drops_dense_weights(q8_gguf):
    from nanovllm.layers.linear import LinearBase
    model = _model(_llm(q8_gguf, dtype="bfloat16"))
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert layers and all(m.quant_method.q8 is not None for m in layers)
    assert all(m.quant_method.vnni is None for m in layers)  # Q8_0 layers: no VNNI pack (gguf.VNNI_GGUF_TYPES)
    assert model.model.embed_tokens.q8_weight is not None and model.lm_head.q8_weight is not None
    assert model.lm_head.q8_dtype == model.model.embed_tokens.q8_dtype == torch.bfloat16
    if hasattr(model.lm_head, "packed_weight"):  # oneDNN packs bf16 here: nothing reads the dense copies
        assert model.lm_head.weight is None and model.model.embed_tokens.weight is None
        assert all(m.weight is None for m in layers)


def test_rows_choose_the_kernel_up_to_the_crossover(q8_gguf, monkeypatch):
    from nanovllm.layers.quantization.gguf import GGUFConfig
    model = _model(_llm(q8_gguf, dtype="bfloat16"))
    config = GGUFConfig()
    calls = []
    real = cpu_q8_0.q8_0_linear
    monkeypatch.setattr(cpu_q8_0, "q8_0_linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    layer, head = model.model.layers[0].mlp.down_proj, model.lm_head
    for module, most in ((layer, config.max_q8_0_rows), (head, config.max_q8_0_head_rows)):
        for rows in (1, most, most + 1):
            calls.clear()
            x = torch.randn(rows, module.q8_weight.shape[1] if module is head else layer.input_size).bfloat16()
            y = module(x)
            assert calls == ([rows] if rows <= most else [])
            assert y.shape == (rows, module.vocab_size if module is head else layer.output_size)


def test_q8_0_greedy_ids_match_dequantized(q8_gguf):
    from nanovllm import SamplingParams
    from tiny_models import random_prompts
    kept, dense = _llm(q8_gguf, dtype="bfloat16"), _llm(q8_gguf, dtype="bfloat16", quantization="gguf_dequant")
    prompts = random_prompts([5, 17, 33])
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP_K_CLOSE)
    outs = [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False) for llm in (kept, dense)]
    for a, b in zip(*outs):
        ours, ref = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        if ours != ref:  # a near-tie may flip argmax: both must rank the other's token top-5
            i = next(i for i, (x, y) in enumerate(zip(ours, ref)) if x != y)
            assert ref[i] in a.outputs[0].logprobs[i] and ours[i] in b.outputs[0].logprobs[i], (i, ours, ref)


@pytest.mark.parametrize("options", [{"dtype": "float32"}, {"dtype": "bfloat16", "quantization": "gguf_dequant"}])
def test_float32_and_gguf_dequant_keep_dense_weights(q8_gguf, options):
    from nanovllm.layers.linear import LinearBase
    model = _model(_llm(q8_gguf, **options))
    assert model.model.embed_tokens.q8_weight is None and model.lm_head.q8_weight is None
    assert all(getattr(m.quant_method, "q8", None) is None for m in model.modules() if isinstance(m, LinearBase))
    assert model.model.embed_tokens.weight is not None


def test_embedding_rows_equal_the_dense_copy():
    """The rows read from the blocks are the dequantized rows rounded to the dtype, as the dense
    embedding's copy holds them (bit for bit)."""
    weight = cpu_q8_0.from_gguf_blocks(torch.from_numpy(_q8_0_raw(40, 96).copy()))
    ids = torch.tensor([0, 39, 7, 7])
    for dtype in (torch.float32, torch.bfloat16):
        dense = weight.dequantize().to(dtype)
        assert torch.equal(cpu_q8_0.embedding(ids, weight, dtype), torch.nn.functional.embedding(ids, dense))
