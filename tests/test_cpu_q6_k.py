"""GGUF Q6_K weights kept quantized on the CPU by the Q8_0 kernel (kernels/cpu_q8_0.py: int8 values
and one fp32 scale per 16 values; layers/quantization/gguf.py).

- The values and scales read from the blocks give back `gguf.quants.dequantize`'s values exactly,
  and the kernel's product equals `x.float() @ dequantize(W).T` within fp32 summation-order error
  (its bf16 output is that fp32 result rounded).
- A tiny GGUF model written in Q6_K: its linear layers, embedding and LM head keep the values
  (no dense copies where oneDNN packs), and its greedy ids equal the dequantized path's or part only
  at a near-tie.
"""
import gguf
import numpy as np
import pytest
import torch

from nanovllm.kernels import cpu_q8_0

if not cpu_q8_0.built(torch.float32, 16):
    pytest.skip("the Q8_0 kernel cannot be built here (no C++ compiler)", allow_module_level=True)

QK_K = 256            # values per K-quant super-block
Q6_K_GROUP = 16       # values per Q6_K group scale
Q6_MAX = 32           # q - 32 lies in [-32, 31]
NEW_TOKENS = 12
TOP_K_CLOSE = 5


def q6_k_blocks(w: np.ndarray) -> np.ndarray:
    """w [rows, cols] (cols a multiple of 256) as Q6_K blocks [rows, cols / 256 * 210] uint8, laid out
    as ggml's block_q6_K (the inverse of gguf-py's Q6_K dequantization): a group scale per 16 values,
    the super-block's fp16 d, 6-bit values as 4 low bits (ql) and 2 high bits (qh)."""
    rows = w.shape[0]
    g = w.astype(np.float32).reshape(-1, QK_K // Q6_K_GROUP, Q6_K_GROUP)           # [blocks, 16, 16]
    group_scale = np.abs(g).max(-1) / Q6_MAX                                       # [blocks, 16]
    d = (group_scale.max(-1, keepdims=True) / 127).astype(np.float16)              # [blocks, 1]
    df = np.maximum(d.astype(np.float32), np.finfo(np.float32).tiny)
    sc = np.clip(np.round(group_scale / df), -128, 127).astype(np.int8)            # [blocks, 16]
    step = np.maximum(df * sc.astype(np.float32), np.finfo(np.float32).tiny)[..., None]
    q = (np.clip(np.round(g / step), -Q6_MAX, Q6_MAX - 1) + Q6_MAX).astype(np.uint8).reshape(-1, QK_K)
    low, high = (q & 0x0F).reshape(-1, 2, 2, 64), (q >> 4).reshape(-1, 2, 4, 32)  # [blocks, half, ., .]
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], -1)   # [blocks, 210]
    return blocks.reshape(rows, -1)


def _weight(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05


def _raw(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    w = _weight(rows, cols, seed)
    assert type_name == "Q6_K"
    return q6_k_blocks(w)


def _reference(raw: np.ndarray, type_name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).copy())


@pytest.mark.parametrize("type_name", ["Q6_K"])
def test_values_and_scales_give_gguf_values_exactly(type_name):
    raw = _raw(type_name, 9, 512)
    weight = cpu_q8_0.from_gguf(torch.from_numpy(raw), type_name)
    assert weight.block == cpu_q8_0.BLOCK_OF[type_name] and weight.values.dtype == torch.int8
    assert torch.equal(weight.dequantize(), _reference(raw, type_name))
    w = _weight(9, 512)
    error = (_reference(raw, type_name) - torch.from_numpy(w)).abs().max()
    assert error < np.abs(w).max() / 16, "the blocks hold the weight they were written from"


def test_random_q6_k_blocks_read_exactly():
    """Any bytes are a Q6_K block (negative group scales included) once d is a finite fp16."""
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (7, 3 * 210), generator=gen, dtype=torch.uint8)
    raw.view(7, 3, 210)[..., cpu_q8_0.Q6_K_D] = (torch.rand(7, 3, 1, generator=gen) * 1e-3).half().view(torch.uint8)
    weight = cpu_q8_0.from_gguf(raw, "Q6_K")
    assert torch.equal(weight.dequantize(), _reference(raw.numpy(), "Q6_K"))


@pytest.mark.parametrize("type_name", ["Q6_K"])
@pytest.mark.parametrize("m", [1, 2, 5, 9])
def test_products_match_dequantized(type_name, m):
    raw = _raw(type_name, 37, 768, seed=m)
    weight = cpu_q8_0.from_gguf(torch.from_numpy(raw), type_name)
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(m))
    expected = x.double() @ _reference(raw, type_name).double().T
    got = cpu_q8_0.q8_0_linear(x, weight)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    xb = x.bfloat16()
    assert torch.equal(cpu_q8_0.q8_0_linear(xb, weight), cpu_q8_0.q8_0_linear(xb.float(), weight).bfloat16())


def test_a_malformed_row_is_a_value_error():
    with pytest.raises(ValueError, match="Q6_K row of 100 bytes"):
        cpu_q8_0.from_gguf(torch.zeros(2, 100, dtype=torch.uint8), "Q6_K")


# ---- a tiny GGUF model written in Q6_K ----------------------------------------------------

@pytest.fixture(scope="module", params=["Q6_K"])
def typed_gguf(request, tmp_path_factory):
    import test_gguf
    from tiny_models import build_tiny_model
    type_name = request.param
    d = tmp_path_factory.mktemp(f"tiny-{type_name}")
    # Q6_K rows are whole super-blocks: every input size a multiple of 256
    hf = build_tiny_model("qwen3", str(d / "hf"), rope_scaling=None, hidden_size=256, intermediate_size=512, head_dim=64)
    path = str(d / f"tiny-{type_name}.gguf")
    quantize = gguf.quants.quantize
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_gguf, "WRITE_TYPES", (type_name,))  # every 2-D tensor of this type
        patch.setattr(gguf.quants, "quantize", lambda data, qtype: (
            q6_k_blocks(data) if qtype == gguf.GGMLQuantizationType.Q6_K else quantize(data, qtype)))
        test_gguf.write_tiny_gguf(hf, "qwen3", path, quantize=True)
    return path, type_name


def _llm(path: str, **options):
    from nanovllm import LLM
    return LLM(path, skip_tokenizer_init=True, num_kvcache_blocks=64, **options)


def test_model_keeps_values_for_layers_embedding_and_head(typed_gguf):
    from nanovllm.layers.linear import LinearBase
    path, type_name = typed_gguf
    model = _llm(path, dtype="bfloat16").llm_engine.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    block = cpu_q8_0.BLOCK_OF[type_name]
    assert layers and all(m.quant_method.q8 is not None and m.quant_method.q8.block == block for m in layers)
    assert model.model.embed_tokens.q8_weight.block == block and model.lm_head.q8_weight.block == block
    if hasattr(model.lm_head, "packed_weight"):  # oneDNN packs bf16 here: nothing reads the dense copies
        assert model.lm_head.weight is None and model.model.embed_tokens.weight is None
        assert all(m.weight is None for m in layers)


def test_greedy_ids_match_dequantized(typed_gguf):
    from nanovllm import SamplingParams
    from tiny_models import random_prompts
    path, _ = typed_gguf
    kept, dense = _llm(path, dtype="bfloat16"), _llm(path, dtype="bfloat16", quantization="gguf_dequant")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP_K_CLOSE)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 17, 33])]
    outs = [llm.generate(prompts, params, use_tqdm=False) for llm in (kept, dense)]
    for a, b in zip(*outs):
        ours, ref = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        if ours != ref:  # a near-tie may flip argmax: both must rank the other's token top-5
            i = next(i for i, (x, y) in enumerate(zip(ours, ref)) if x != y)
            assert ref[i] in a.outputs[0].logprobs[i] and ours[i] in b.outputs[0].logprobs[i], (i, ours, ref)


def test_head_rows_choose_the_kernel_up_to_its_crossover(typed_gguf, monkeypatch):
    from nanovllm.layers.quantization import gguf as gguf_method
    from nanovllm.utils.device import cpu_kind
    path, _ = typed_gguf
    head = _llm(path, dtype="bfloat16").llm_engine.model_runner.model.lm_head
    most = min(gguf_method.GGUFConfig().max_q8_0_head_rows, gguf_method.MAX_Q6_K_HEAD_ROWS[cpu_kind()])
    calls = []
    real = cpu_q8_0.q8_0_linear
    monkeypatch.setattr(cpu_q8_0, "q8_0_linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    for rows in (1, most, most + 1):
        calls.clear()
        logits = head(torch.randn(rows, head.q8_weight.shape[1]).bfloat16())
        assert calls == ([rows] if rows <= most else []) and logits.shape == (rows, head.vocab_size)
